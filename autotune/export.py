"""Export the winner of a study as files a person or a machine runs as they are.

studies/<name>/best/ (or --out DIR):
  launch.sh       the exact engine command and environment, every argument shlex-quoted; HOST, PORT
                  (and PYTHON) may be overridden from the environment, extra engine flags appended
                  as the script's arguments; comments carry the validated numbers, the hardware and
                  versions, and the study it came from. Checked with `bash -n` and the engine's schema.
  config.yaml     the engine's own config file (`sglang ... --config`, `vllm serve --config`: option
                  names as keys); for an engine with no config-file flag, the same YAML of its flags,
                  which launch.sh passes.
  launch.json     everything above for machines: argv, env, config, numbers, provenance.
  docker-run.sh   `docker run` of the engine's official image (adapter.facts.image: lmsysorg/sglang,
                  vllm/vllm-openai); an engine without one gets none (launch.json says so).
  provenance.json the study's provenance plus what was exported from where.
  draft_schedule.yaml  where the schedule was fitted for the winner (study/schedule.py): the engine's
                  launch files carry it as far as the engine can express it; launch.sh says what it cannot.
The winner comes from best/validation.json; a study never validated exports its best trial, marked so.
"""
from __future__ import annotations

import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

import yaml

from autotune.bench.metric_registry import SHOWN, metric
from autotune.engines.base import flag_lines
from autotune.study.schedule import read_fit
from autotune.study.storage import StudyContext, load_study
from autotune.validate.record import Validation

FORMATS = ("sh", "yaml", "json", "docker")


def chosen(ctx: StudyContext) -> dict:
    """The configuration to export: the validated winner, else (never validated) the study's best trial."""
    doc = Validation.load(ctx.best_dir)
    if doc is not None:
        if doc.winner is None:
            why = "; ".join(f"trial {d.trial}: {d.reasons[0].text}" for d in doc.demoted)
            raise ValueError(f"no configuration of {ctx.name!r} passed validation ({why or 'none measured'})")
        w = doc.winner
        return {"trial": w.trial, "config": w.config, "validated": True,
                "stats": {k: s.model_dump() for k, s in w.stats.items()}, "gain": w.gain_over_baseline,
                "settings": doc.settings, "written": doc.written, "warning": w.warning, "repeats": w.repeats,
                "tie": doc.tie.model_dump() if doc.tie else None}
    best = ctx.ranked()
    if not best:
        raise ValueError(f"study {ctx.name!r} has no measured trial that met its requirements: nothing to export")
    t = best[0]
    stats = {k: {"median": v} for k, v in (t.user_attrs.get("metrics") or {}).items() if isinstance(v, (int, float))}
    return {"trial": t.number, "config": t.user_attrs.get("config") or {}, "validated": False, "stats": stats,
            "gain": ctx.study.user_attrs.get("gain_over_default"), "settings": ctx.load}


def command(ctx: StudyContext, config: dict) -> tuple[list[str], dict[str, str]]:
    """argv and env at the default address; refused if the flags fail the engine's schema."""
    adapter = ctx.adapter
    argv, env = adapter.command(config, model=ctx.model, draft_model=ctx.draft_model, host="127.0.0.1",
                                port=adapter.facts.default_port)
    errors = adapter.validate_flags(argv)
    if errors:
        raise ValueError(f"the winner's flags fail the {ctx.engine} schema: {'; '.join(errors)}")
    return argv, env


def with_schedule(ctx: StudyContext, pick: dict, argv: list[str], env: dict[str, str], directory: Path):
    """(argv, env, the line launch.sh says, files written) carrying the draft-length schedule fitted for this
    winner (best/draft_schedule_fit.json), in the engine's own terms (adapter.scheduled_command: its
    schedule_args) with what it cannot express said; as given, with no line, where none was fitted for it."""
    fitted = read_fit(ctx.best_dir)
    if fitted is None or fitted.trial != pick["trial"]:
        return argv, env, None, []
    adapter, said = ctx.adapter, f"draft schedule (batch -> draft length): {fitted.rows_text()}"
    try:
        argv, env, rendering = adapter.scheduled_command(
            pick["config"], fitted.schedule, model=ctx.model, draft_model=ctx.draft_model, host="127.0.0.1",
            port=adapter.facts.default_port, directory=directory.resolve())
    except NotImplementedError:  # an engine with no rendering yet: it runs the fixed draft length
        return argv, env, f"{said}; {ctx.engine} cannot run it: launched with the fixed draft length", []
    errors = adapter.validate_flags(argv)
    if errors:
        raise ValueError(f"the winner's flags with its draft schedule fail the {ctx.engine} schema: {'; '.join(errors)}")
    cannot = "; ".join(rendering.cannot_express)
    return argv, env, said + (f"; {ctx.engine} cannot express: {cannot}" if cannot else ""), rendering.write_files()


# -- launch.sh -------------------------------------------------------------------------------------
def comments(ctx: StudyContext, pick: dict) -> list[str]:
    prov, load = ctx.provenance, pick["settings"]
    lines = [f"study: {ctx.name} (trial {pick['trial']}), storage {ctx.storage}",
             (f"objective: {ctx.objective}; workload {ctx.workload}, concurrency {load.get('concurrency')}, "
              f"{load.get('num_requests')} requests, max_tokens {load.get('max_tokens')}")]
    numbers = []
    for m in map(metric, SHOWN):
        s = pick["stats"].get(m.name) or {}
        if s.get("median") is None:
            continue
        text = f"{m.label} {m.format(s['median'])}"
        if s.get("ci95"):
            text += f" (95% CI {m.format(s['ci95'][0])}..{m.format(s['ci95'][1])}, MAD {s['rel_mad']:.1%})"
        numbers.append(text)
    if pick["validated"]:
        lines.append(f"validated {pick.get('written')}: median of {pick.get('repeats') or load.get('repeats')} benchmarks "
                     "on fresh servers:")
    else:
        lines.append(f"NOT VALIDATED: measured once during the study (run `autotune validate {ctx.name}`):")
    lines += [f"  {n}" for n in numbers]
    if pick.get("gain"):
        lines.append(f"  gain over the engine defaults: {pick['gain']:.2f}x")
    if pick.get("warning"):
        lines.append(f"WARNING: {pick['warning']}")
    if pick.get("tie"):
        lines.append(f"TIE: {pick['tie']['why']}")
    if pick.get("schedule"):
        lines.append(pick["schedule"])
    lines.append(f"hardware: {hardware_line(prov)}")
    lines.append("versions: " + ", ".join(f"{k} {v}" for k, v in versions(prov).items() if v))
    if prov.get("model"):
        digest = prov.get("model_sha256")
        lines.append(f"model: {prov['model']}" + (f" (sha256 {digest})" if digest else ""))
    return lines


def hardware_line(prov: dict) -> str:
    hw = prov.get("hardware") or {}
    gpus = hw.get("gpus") or []
    if gpus:
        names = sorted({f"{g.get('name')} ({g.get('memory_gb') or '?'} GiB)" for g in gpus})
        text = f"{len(gpus)}x {' + '.join(names)}, driver {hw.get('driver_version')}, CUDA {hw.get('cuda_driver_version')}"
    else:
        cpu = hw.get("cpu") or {}
        text = f"CPU only: {cpu.get('model')}, {cpu.get('cores')} cores, {cpu.get('ram_gb')} GB RAM"
    profile = (hw.get("profile") or {}).get("name")
    return text + (f" (profile {profile})" if profile else "")


def versions(prov: dict) -> dict:
    engine_versions = ((prov.get("hardware") or {}).get("versions") or {})
    return {**(prov.get("versions") or {}), **{k: v for k, v in engine_versions.items() if k != "torch"}}


def launch_script(ctx: StudyContext, pick: dict, argv: list[str], env: dict[str, str]) -> str:
    port = str(ctx.adapter.facts.default_port)
    lines = ["#!/usr/bin/env bash", f"# autotune: launch the {ctx.engine} engine with the configuration tuned by study {ctx.name}"]
    lines += [f"# {' '.join(c.splitlines())}" for c in comments(ctx, pick)]
    lines += ["# HOST, PORT and PYTHON may be set in the environment; script arguments are added to the engine's flags.",
              "set -euo pipefail", ""]
    python = argv[0] == sys.executable
    if python:
        lines.append(f"PYTHON=${{PYTHON:-{shlex.quote(argv[0])}}}")
    lines += ["HOST=${HOST:-127.0.0.1}", f"PORT=${{PORT:-{port}}}"]
    lines += [f"export {k}={shlex.quote(str(v))}" for k, v in env.items()]
    args = ctx.adapter.engine_args(argv)
    entry = argv[:len(argv) - len(args)]
    head = ['"$PYTHON"' if python else shlex.quote(entry[0]), *map(shlex.quote, entry[1:])]
    body = []
    for group in flag_lines(args):
        if group[0] in ("--host", "--port") and len(group) == 2:
            body.append(f'{group[0]} "${group[0][2:].upper()}"')
        else:
            body.append(shlex.join(group))
    lines += ["", f"exec {' '.join(head)} \\"] + [f"  {g} \\" for g in body] + ['  "$@"']
    return "\n".join(lines) + "\n"


# -- config.yaml, launch.json, docker-run.sh -------------------------------------------------------
def _scalar(text: str):
    for kind in (int, float):
        try:
            value = kind(text)
        except ValueError:
            continue
        if str(value) == text:
            return value
    return text


def config_yaml(ctx: StudyContext, pick: dict, argv: list[str], env: dict[str, str] | None = None) -> str:
    """The engine's flags (not the address) as {name: value}; flags without a value are `true`. An engine reads
    no environment from its config file, so the environment the winner ran with (SGLANG_FORCE_FP8_MARLIN=1 keeps
    fp8 weight-only) leads the `use:` line and is listed in the header."""
    options = {}
    for group in flag_lines(ctx.adapter.engine_args(argv)):
        name, values = group[0].removeprefix("--"), group[1:]
        if name in ("host", "port"):
            continue
        options[name] = True if not values else _scalar(values[0]) if len(values) == 1 else [_scalar(v) for v in values]
    use = ctx.adapter.facts.config_file_use
    assignments = " ".join(f"{k}={shlex.quote(str(v))}" for k, v in (env or {}).items())
    head = [f"# {ctx.engine} options of study {ctx.name}, trial {pick['trial']}"
            + ("" if pick["validated"] else " (NOT VALIDATED)")]
    if assignments:
        head.append(f"# environment (set it too, the engine reads it from there): {assignments}")
    head.append(f"# use: {assignments + ' ' if assignments else ''}{use}" if use else
                f"# {ctx.engine} flags (--name value); it reads no config file: best/launch.sh passes exactly these")
    return "\n".join(head) + "\n" + yaml.safe_dump(options, sort_keys=False)


def docker_line(ctx: StudyContext, argv: list[str], env: dict[str, str]) -> str | None:
    adapter = ctx.adapter
    if adapter.facts.image is None:
        return None
    port = adapter.facts.default_port
    args = [a if prev != "--host" else "0.0.0.0" for prev, a in zip([None, *argv], argv)][len(adapter.entry):]
    cmd = ["docker", "run", "--rm", "--gpus", "all", "--ipc=host", "--shm-size", "16g",
           "-p", f"127.0.0.1:{port}:{port}", "-v", "$HOME/.cache/huggingface:/root/.cache/huggingface"]
    for path in {ctx.model, ctx.draft_model} - {None}:
        if Path(path).exists():  # a local checkpoint: mounted at the same path, read-only
            cmd += ["-v", f"{path}:{path}:ro"]
    for k, v in env.items():
        cmd += ["-e", f"{k}={v}"]
    cmd += [adapter.facts.image.format(version=adapter.version), *adapter.facts.image_command]
    text = shlex.join(cmd + args)
    return text.replace("'$HOME/.cache/huggingface:/root/.cache/huggingface'", '"$HOME/.cache/huggingface:/root/.cache/huggingface"')


# -- all of it -------------------------------------------------------------------------------------
def export(study: str | Path | StudyContext, *, storage: str | None = None, formats=FORMATS,
           out: str | Path | None = None) -> list[Path]:
    """Write the chosen formats (sh, yaml, json, docker) and provenance.json; returns the files written."""
    ctx = study if isinstance(study, StudyContext) else load_study(study, storage)
    unknown = set(formats) - set(FORMATS)
    if unknown:
        raise ValueError(f"unknown format {', '.join(sorted(unknown))} (choose from {', '.join(FORMATS)} or all)")
    if formats == ("docker",) and ctx.adapter.facts.image is None:
        raise ValueError(f"the {ctx.engine} engine has no official container image; use launch.sh")
    pick = chosen(ctx)
    argv, env = command(ctx, pick["config"])
    directory = Path(out) if out else ctx.best_dir
    directory.mkdir(parents=True, exist_ok=True)
    argv, env, pick["schedule"], written = with_schedule(ctx, pick, argv, env, directory)

    def write(name: str, text: str, mode: int = 0o644) -> None:
        path = directory / name
        path.write_text(text)
        path.chmod(mode)
        written.append(path)

    if "sh" in formats:
        write("launch.sh", launch_script(ctx, pick, argv, env), 0o755)
        check = subprocess.run(["bash", "-n", str(directory / "launch.sh")], capture_output=True, text=True, check=False)
        if check.returncode:
            raise ValueError(f"generated launch.sh does not parse: {check.stderr.strip().splitlines()[0]}")
    if "yaml" in formats:
        write("config.yaml", config_yaml(ctx, pick, argv, env))
    docker = docker_line(ctx, argv, env)
    if "docker" in formats and docker:
        write("docker-run.sh", "#!/usr/bin/env bash\n# the engine's official image, same flags as launch.sh\n"
                               f"set -euo pipefail\nexec {docker}\n", 0o755)
    if "json" in formats:
        doc = {"engine": ctx.engine, "study": ctx.name, "storage": ctx.storage, "trial": pick["trial"],
               "validated": pick["validated"], "config": pick["config"], "argv": argv, "env": env,
               "address_flags": {"host": "127.0.0.1", "port": ctx.adapter.facts.default_port},
               "metrics": pick["stats"], "gain_over_default": pick.get("gain"), "load": pick["settings"],
               "docker": docker, "docker_note": None if docker else f"no official image for the {ctx.engine} engine",
               "draft_schedule": pick["schedule"],
               "hardware": hardware_line(ctx.provenance), "versions": versions(ctx.provenance)}
        write("launch.json", json.dumps(doc, indent=2, default=str) + "\n")
    provenance = {**ctx.provenance, "exported": {"written": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "study": ctx.name,
                                                 "storage": ctx.storage, "trial": pick["trial"],
                                                 "validated": pick["validated"], "files": [p.name for p in written]}}
    write("provenance.json", json.dumps(provenance, indent=2, default=str) + "\n")
    return written
