"""The command line as a first-time user meets it: `--version`, every command's help on one screen saying
each option's default, errors that name their fix, and `--studies-dir` on the commands that keep studies.
Each case runs the CLI as a user does (a subprocess); the cases of one test run side by side."""
import hashlib
import importlib.util
import json
import os
import shlex
import subprocess
import sys

import optuna
import typer

import autotune
from autotune.cli import app
from autotune.embedded.bundled import bundled_gguf_path

SCREEN_LINES = 40  # at 100 columns
CLI = [sys.executable, "-m", "autotune.cli"]


def commands(group=None, path=()):
    """Every command path of the app, the app itself first: (), ("run",), ("estimator", "fit"), ..."""
    group = group or typer.main.get_command(app)
    found = [(path, group)]
    for name, command in getattr(group, "commands", {}).items():
        found += commands(command, (*path, name))
    return found


def run_all(cases: dict, env: dict | None = None, timeout: float = 600) -> dict:
    """{key: argv} -> {key: CompletedProcess}, the processes started together."""
    env = {**os.environ, "COLUMNS": "100", **(env or {})}
    procs = {key: subprocess.Popen(CLI + list(argv), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                   env=env) for key, argv in cases.items()}
    done = {}
    for key, proc in procs.items():
        out, err = proc.communicate(timeout=timeout)
        done[key] = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    return done


def test_version_and_every_help_fit_a_screen():
    shown = run_all({"version": ["--version"], **{path: [*path, "--help"] for path, _ in commands()}})
    assert shown.pop("version").stdout == f"autotune {autotune.__version__}\n"
    assert len(shown) >= 14  # the app, 11 commands, estimator's group and its two
    for path, done in shown.items():
        assert done.returncode == 0, (path, done.stderr)
        lines = done.stdout.splitlines()
        assert len(lines) <= SCREEN_LINES and max(map(len, lines)) <= 100, (path, len(lines))
        assert "--help" in done.stdout
    assert "--version" in shown[()].stdout and "./studies" in shown[()].stdout


def undocumented_defaults(command) -> list[str]:
    """Options of `command` whose help says nothing of their default: not required, not a flag that is off
    unless given, no default the help shows ([default: x]) and no "default" in their own text."""
    missing = []
    for param in command.params:
        if param.param_type_name != "option" or param.name in ("help", "version"):
            continue
        shown = param.show_default is not False and param.default not in (None, "", [], ())
        off_flag = param.is_flag and param.default is False
        if not (param.required or shown or off_flag or "default" in (param.help or "")):
            missing.append(param.opts[0])
    return missing


def test_every_option_says_its_default():
    assert {" ".join(path): undocumented_defaults(command) for path, command in commands()
            if undocumented_defaults(command)} == {}
    # the check sees an option that keeps its default to itself
    bare = typer.Typer(add_completion=False)

    @bare.command()
    def tune(model: str = typer.Option(None, help="model path"), trials: int = typer.Option(3, help="trials"),
             quiet: bool = typer.Option(False, help="say less"), study: str = typer.Option(..., help="name")):
        pass

    assert undocumented_defaults(typer.main.get_command(bare)) == ["--model"]


def test_each_error_names_its_fix(tmp_path):
    """A missing engine names its set-up command; a missing model says how to get one. Each condition is made
    real here: a binary that is not there, a cache without a build, a path that does not exist."""
    no_build = {"AUTOTUNE_CACHE": str(tmp_path / "cache"), "AUTOTUNE_STUDIES_DIR": str(tmp_path / "studies"),
                # llama-server on PATH would be found too: only the interpreter's folder and the system's
                "PATH": os.pathsep.join([os.path.dirname(sys.executable), "/usr/bin", "/bin"])}
    cases = {  # (condition, argv): the fix its error must name
        ("llama-server binary not there", "run", "--engine", "llamacpp", "--engine-binary", "/nonexistent"):
            "bash setup.sh llamacpp",
        ("no llama-server built", "run", "--engine", "llamacpp"): "bash setup.sh llamacpp",
        ("vLLM Python not there", "run", "--engine", "vllm", "--engine-binary", "/nonexistent"): "bash setup.sh vllm",
        ("model not there", "run", "--model", "/nonexistent.gguf"): "hf download",
        ("model not there", "serve", "--model", "/nonexistent.gguf"): "hf download",
        ("model not there", "estimate", "--model", "/nonexistent.gguf", "--gpu", "h100-sxm5"): "hf download",
        # one GGUF file holds one type: another comes from a directory of the model's files
        ("another type of one GGUF", "estimate", "--engine", "llamacpp", "--model", str(bundled_gguf_path()),
         "--set", "gguf_type=Q8_0"): "--model a directory",
    }
    if importlib.util.find_spec("vllm") is None:  # else autotune's own Python runs vLLM: none is missing
        cases[("no vLLM venv in the cache", "run", "--engine", "vllm")] = "bash setup.sh vllm"
    for case, done in run_all({case: case[1:] for case in cases}, env=no_build).items():
        assert done.returncode == 2, (case, done.stderr)
        assert done.stderr.startswith("error: ") and len(done.stderr.splitlines()) == 1, (case, done.stderr)
        assert cases[case] in done.stderr, (case, done.stderr)
    assert not (tmp_path / "studies").exists()  # nothing was started


def test_estimate_for_another_machine_names_the_engine_not_this_machines_path(tmp_path):
    """`estimate --gpu PROFILE` plans for a machine autotune never saw: its launch lines name llama-server as
    installed there (on its PATH), not the build this machine would launch (here --engine-binary's, by its
    environment variable), which `--gpu cpu`, this machine, still names. A single GGUF file estimates at its
    own type when the user pins it."""
    here = str(tmp_path / "build" / "bin" / "llama-server")
    gguf = ["--engine", "llamacpp", "--model", str(bundled_gguf_path()), "--top", "3", "--json"]
    done = run_all({"planned": ["estimate", "--gpu", "h200-sxm", *gguf],
                    "this machine": ["estimate", "--gpu", "cpu", *gguf],
                    "its own type": ["estimate", "--gpu", "h200-sxm", *gguf, "--set", "gguf_type=Q4_1"]},
                   env={"AUTOTUNE_LLAMA_SERVER": here})
    lines = {}
    for case, proc in done.items():
        assert proc.returncode == 0, (case, proc.stderr)
        lines[case] = [shlex.split(row["launch"]) for row in json.loads(proc.stdout)["configs"]]
        assert lines[case], case
    assert all(argv[0] == "llama-server" and here not in argv for argv in lines["planned"] + lines["its own type"])
    assert all(argv[0] == here for argv in lines["this machine"])


def test_studies_dir_is_where_every_study_command_looks(tmp_path):
    chosen, elsewhere = tmp_path / "chosen", tmp_path / "elsewhere"
    db = chosen / "keep" / "study.db"
    db.parent.mkdir(parents=True)
    study = optuna.create_study(study_name="keep", storage=f"sqlite:///{db}", direction="maximize")
    study.tell(study.ask(), 1.0)
    before = hashlib.sha256(db.read_bytes()).hexdigest()
    given = ["--studies-dir", str(chosen)]
    readers = {("validate",), ("export",), ("report",), ("show",), ("ci",), ("estimator", "fit")}
    cases = {
        # run: the study exists there, so a fresh run of that name is refused before anything launches
        "run": ["run", "--study", "keep", "--set", "drafter=none", *given],
        "show": ["show", "keep", *given],
        "show, no flag": ["show", "keep"],  # $AUTOTUNE_STUDIES_DIR, the default the flag overrides
        **{cmd: [*cmd, "nope", *given] for cmd in readers},
        "estimator eval": ["estimator", "eval", "--study", "nope", *given],
    }
    done = run_all(cases, env={"AUTOTUNE_STUDIES_DIR": str(elsewhere)})
    assert done["run"].returncode == 2 and f"already exists in sqlite:///{db}" in done["run"].stderr, done["run"].stderr
    assert done["show"].returncode == 0 and "study keep" in done["show"].stdout, done["show"].stderr
    assert done["show, no flag"].returncode == 2 and str(elsewhere / "keep") in done["show, no flag"].stderr
    for cmd in [*readers, "estimator eval"]:
        assert done[cmd].returncode == 2 and str(chosen / "nope") in done[cmd].stderr, (cmd, done[cmd].stderr)
        assert len(done[cmd].stderr.splitlines()) == 1, (cmd, done[cmd].stderr)
    assert hashlib.sha256(db.read_bytes()).hexdigest() == before  # read, never written
    assert not elsewhere.exists() and sorted(p.name for p in chosen.iterdir()) == ["keep"]
    # every command that keeps studies takes the flag
    keeps = {("run",), ("worker",), ("estimator", "eval"), *readers}
    for path, command in commands():
        if path in keeps:
            assert "--studies-dir" in {o for p in command.params for o in p.opts}, path
