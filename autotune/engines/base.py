"""What every engine adapter shares: the EngineAdapter interface, the captured flag schema, argv checks against it (and
against the installed engine's own parser), and rewriting flags that were renamed."""
import difflib
import functools
import importlib.util
import json
import re
import subprocess
import sys
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

from autotune import package_path
from autotune.embedded.draft_schedule import DraftSchedule
from autotune.engines.facts import EngineFacts

SCHEMA_DIR = package_path("engines", "schemas")
_NUMBER = re.compile(r"^-?\d+(\.\d+)?([eE]-?\d+)?$")
_SUFFIXED_INT = re.compile(r"^\d+(\.\d+)?(k|K|M|G|T|Ki|Mi|Gi|Ti)?$")
# The draft checkpoint kind (predict.drafts.DRAFT_KINDS) each drafter family runs; the other families need
# none (mtp: the target's own layers; lookup and the embedded self-drafters).
DRAFT_KIND_OF_FAMILY = {"eagle": "eagle", "eagle3": "eagle3", "dflash": "dflash", "draft": "standalone"}
WANTED = {"int": "an integer", "float": "a number", "json": "a JSON value", "int_suffix": "an integer like 8192 or 8k",
          "int_suffix_or_auto": "an integer like 8192 or 8k, or auto"}


def flag(name: str) -> str:
    """tp_size -> --tp-size"""
    return "--" + name.replace("_", "-")


def is_flag(token: str) -> bool:
    return token.startswith("-") and len(token) > 1 and not _NUMBER.match(token)


def flag_groups(args: list[str]):
    """Yield (token, flag name, values) per flag: `--x=1` carries its value; `--x 1 2` takes the
    non-flag tokens after it. A stray leading non-flag token comes alone, with no values."""
    i = 0
    while i < len(args):
        token = args[i]
        i += 1
        name, eq, inline = token.partition("=")
        values = [inline] if eq else []
        if not eq and is_flag(token):
            while i < len(args) and not is_flag(args[i]):
                values.append(args[i])
                i += 1
        yield token, name, values


def flag_lines(args: list[str]) -> list[list[str]]:
    """[flag, *values] per flag, as the tokens appear (`--x=1` stays one token): one line each in a script."""
    return [[token] if "=" in token or not values else [token, *values] for token, _, values in flag_groups(args)]


@functools.cache
def load_schema(engine: str, version: str) -> dict:
    schema = json.loads((SCHEMA_DIR / f"{engine}-{version}.json").read_text())
    schema["by_flag"] = {f: o for o in schema["options"] for f in o["flags"]}
    schema["renamed"] = {r["old"]: r for r in schema["renames"]}
    return schema


def _value_problem(value: str, option: dict) -> str | None:
    kind = option["type"]
    if option["optional"] and value in ("", "None"):
        return None
    try:
        if kind == "int":
            int(value)
        elif kind == "float":
            float(value)
        elif kind == "json":
            json.loads(value)
        elif kind.startswith("int_suffix") and not (_SUFFIXED_INT.match(value) or (kind.endswith("auto") and value == "auto")):
            raise ValueError
    except ValueError:
        return f"{option['flags'][0]} takes {WANTED[kind]}, got {value!r}"
    if option["choices"] is not None and value not in [str(c) for c in option["choices"]]:
        return f"{option['flags'][0]} must be one of {', '.join(map(str, option['choices']))}; got {value!r}"
    return None


def _arity(nargs) -> tuple[int, int]:
    return {None: (1, 1), 0: (0, 0), "?": (0, 1), "+": (1, 10**9), "*": (0, 10**9)}.get(nargs, (nargs, nargs))


def schema_errors(args: list[str], schema: dict) -> list[str]:
    """Every flag known, every value of the right type and choice, the right number of values."""
    label = f"{schema['engine']} {schema['version']}"
    errors = []
    for token, name, values in flag_groups(args):
        if not is_flag(token):
            errors.append(f"{token!r} is not a flag and follows no flag that takes it")
            continue
        option = schema["by_flag"].get(name)
        if option is None and "." in name and schema["by_flag"].get(name.split(".")[0], {}).get("type") == "json":
            continue  # vLLM's --compilation-config.mode 3: one key of a JSON option
        if option is None:
            rename = schema["renamed"].get(name)
            if rename is not None:
                errors.append(f"{name} does not exist in {label}: {rename['note']}")
            else:
                close = difflib.get_close_matches(name, schema["by_flag"], n=1)
                errors.append(f"unknown flag {name} for {label}" + (f" (did you mean {close[0]}?)" if close else ""))
            continue
        low, high = _arity(option["nargs"])
        if not low <= len(values) <= high:
            want = "no value" if high == 0 else "one value" if high == 1 else f"at least {low} values"
            errors.append(f"{name} takes {want}, got {len(values)}: {' '.join(values)}".rstrip(": "))
            continue
        errors += [p for p in (_value_problem(v, option) for v in values) if p]
    return errors


def engine_parser_verdicts(engine: str, arg_lists: list[list[str]], timeout_s: float = 600.0,
                           python: str | None = None) -> list[list[str]] | None:
    """The installed engine's own errors for each argument list, asked of `python` in one child process (importing
    an engine takes seconds); `python` defaults to autotune's own where the engine is importable (None: it is not).
    real_parser.py imports nothing of autotune, so it runs as the source of `python -c` in an engine's own
    environment (as a script by path, its folder would shadow the engines)."""
    if python is None:
        if importlib.util.find_spec(engine) is None:
            return None
        python = sys.executable
    source = package_path("engines", "real_parser.py").read_text()
    proc = subprocess.run([python, "-c", source, engine, "--batch"], input=json.dumps(arg_lists), capture_output=True,
                          text=True, timeout=timeout_s, check=False)
    try:
        return json.loads(proc.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return [[f"{engine}'s parser could not be run: {last}"] for _ in arg_lists]


def translate_renamed(args: list[str], schema: dict) -> tuple[list[str], list[str]]:
    """Rewrite flags of older versions to this one's; (new args, one note per rewrite)."""
    out, notes, merged = [], [], {}  # merged: JSON option -> {key: value} gathered from old flags
    for token, name, values in flag_groups(args):
        rename = schema["renamed"].get(name) if is_flag(token) else None
        if rename is None:
            out += [token] if "=" in token else [token, *values]
            continue
        notes.append(f"{name}: {rename['note']}")
        if "into" in rename:
            value = values[0] if values else "true"
            merged.setdefault(rename["into"], {})[rename["key"]] = json.loads(value) if _NUMBER.match(value) else value
        for new in rename.get("new", []):
            out += [new, *([rename["value"]] if "value" in rename else values)]
    for option, keys in merged.items():
        if keys.get("model") == "[ngram]":  # how vLLM < 0.9 spelled prompt-lookup decoding
            del keys["model"]
            keys["method"] = "ngram"
        out += [option, json.dumps(keys)]
    return out, notes


def config_args(config: dict, schema: dict) -> list[str]:
    """{tp_size: 2, enable_torch_compile: True, cuda_graph_bs_decode: [1, 2]} -> engine flags.

    Keys are the engine's option names (dests); None and "none" mean the flag is left out.
    """
    by_dest = {}
    for o in schema["options"]:  # a dest's deprecated aliases (sglang 0.5.17's --cuda-graph-max-bs) never win
        if o["dest"] not in by_dest or by_dest[o["dest"]]["deprecated"]:
            by_dest[o["dest"]] = o
    args = []
    for key, value in config.items():
        option = by_dest.get(key)
        if option is None:
            raise ValueError(f"{key} is not a {schema['engine']} {schema['version']} option")
        if value is None or value == "none":
            continue
        if option["type"] == "flag":  # store_true, or a --x/--no-x pair
            if value:
                args.append(option["flags"][0])
            elif option["default"] is not False and len(option["flags"]) > 1:
                args.append(option["flags"][1])
        elif isinstance(value, (list, tuple)):
            args += [option["flags"][0], *map(str, value)]
        else:
            args += [option["flags"][0], json.dumps(value) if isinstance(value, dict) else str(value)]
    return args


def schedule_departures(schedule: DraftSchedule, length: int, top_batch: int) -> str:
    """Where one fixed draft `length` departs from `schedule` over the batches 1..top_batch an engine can run, as
    "batch 1: 8, batches 5-8: 0" ("" where nowhere): what an engine of one fixed length loses."""
    spans: list[list[int]] = []  # [first, last, k] of consecutive batches with the same differing k
    for batch in range(1, top_batch + 1):
        k = schedule.length_for(batch)
        if k == length:
            continue
        if spans and spans[-1][1] == batch - 1 and spans[-1][2] == k:
            spans[-1][1] = batch
        else:
            spans.append([batch, batch, k])
    return ", ".join(f"batch {a}: {k}" if a == b else f"batches {a}-{b}: {k}" for a, b, k in spans)


@dataclass(frozen=True)
class ScheduleRendering:
    """How one engine runs a draft-length schedule (its adapter's schedule_args): settings merged into the launch
    config before command(), flags added after its own, environment, files to write at the paths the flags name
    (path -> text), and one plain sentence for each thing of the schedule the engine cannot express (none: the
    engine runs the schedule as fitted)."""
    config: dict = field(default_factory=dict)
    args: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    files: dict[str, str] = field(default_factory=dict)
    cannot_express: tuple[str, ...] = ()

    def write_files(self) -> list[Path]:
        written = []
        for path, text in self.files.items():
            Path(path).write_text(text)
            written.append(Path(path))
        return written


# What `autotune bundle` leaves out for a CUDA 13 target whatever the engine: cutlass-dsl's CUDA 12 flavor (SGLang's
# and vLLM's pins name both; a distribution no requirement names is never fetched, so the entry is inert elsewhere).
CUDA12_ONLY = {"nvidia-cutlass-dsl-libs-cu12": "cutlass/_mlir/_mlir_libs/__init__.py loads the newest CUDA flavor the "
                                               "driver supports: cu13 on a CUDA 13 driver"}


class EngineAdapter:
    """What all engine adapters share; each engine's own behaviour (command, check, effective, knobs, schedule_args;
    autotune/engines/protocol.py) is its subclass's, and what it is as data is its `facts` (an EngineFacts, read as
    `adapter.facts.<name>`). Nothing outside autotune/engines/ branches on an engine's name: it reads these."""

    name = ""
    version = ""  # of the captured flag schema
    entry: tuple[str, ...] = ()  # argv before the engine's own arguments, e.g. [python, -m, module]
    facts: EngineFacts

    def installed(self) -> bool:
        """Whether this machine can launch the engine at all."""
        return importlib.util.find_spec(self.name) is not None

    def for_target(self, on_gpu: bool, this_machine: bool = True) -> "EngineAdapter":
        """The adapter as it would launch the engine on the target machine (`autotune estimate --gpu PROFILE` on
        another one): this one, unless the build installed here serves only the other kind of device. Not
        `this_machine` (a profile's): commands name the engine as installed there, never this machine's paths."""
        return self

    def use_binary(self, path: str) -> None:
        """`--engine-binary PATH`: launch this build of the engine instead of the installed one."""
        raise ValueError(f"--engine-binary: the {self.name} engine runs as a Python module, not a binary")

    def missing(self) -> str:
        """One line: how to install the engine on this machine."""
        return f"{self.name} is not installed on this machine (pip install {self.name}); --engine embedded runs anywhere"

    def installed_version(self) -> str | None:
        try:
            return metadata.version(self.name)
        except metadata.PackageNotFoundError:
            return None

    def recorded_version(self, provenance: dict) -> str | None:
        """The engine version an older provenance.json (one without a fingerprint) recorded."""
        return ((provenance.get("hardware") or {}).get("versions") or {}).get(self.name)

    def default_model(self) -> str | None:
        """The checkpoint the engine loads when given none (None: it needs one)."""
        return None

    def model_space(self, space, model: str | None):
        """`space` (an autotune.space.Space) narrowed to what the model's files offer (llama.cpp: the GGUF types
        of a --model directory); ValueError (one line) for a choice the user pinned that no file has."""
        return space

    def portable_model(self, model: str | None) -> str | None:
        """The model argument an exported script should carry (the embedded engine's bundled model: none)."""
        return model

    def tokenizer(self, model: str | None):
        """The served model's tokenizer (an object with .encode(text) -> ids), for comparing outputs token by
        token; None where the adapter cannot read it (outputs are then compared character by character)."""
        return None

    def health_url(self, base_url: str) -> str:
        return base_url.rstrip("/") + "/health"

    def draft_problem(self, config: dict, draft) -> str | None:
        """Why the engine would refuse `config`'s drafter with the draft checkpoint `draft` (a
        predict.drafts.DraftCheckpoint), or run it as something else; None: it runs it as asked. Here: the
        checkpoint kind the drafter family runs; an engine whose code maps architecture names says more."""
        family = self.knobs(config, True).drafter
        need = DRAFT_KIND_OF_FAMILY.get(family)
        if need and need != draft.kind:
            return f"{family} needs a{'n' if need[0] in 'ae' else ''} {need} draft checkpoint; --draft-model is {draft.kind}"
        return None

    def config_keys(self) -> set[str]:
        """Every key a config of this engine may carry: its flag schema's option names."""
        return {o["dest"] for o in load_schema(self.name, self.version)["options"]}

    def explicit(self, config: dict) -> dict:
        """The settings that differ from the engine's own defaults (unset, "none" and defaults dropped)."""
        defaults = {o["dest"]: o["default"] for o in load_schema(self.name, self.version)["options"]}
        return {k: v for k, v in config.items() if v is not None and v != "none" and v != defaults.get(k)}

    def engine_args(self, argv: list[str]) -> list[str]:
        """argv without the entry prefix (the adapter's own command() output is accepted as is)."""
        return list(argv[len(self.entry):]) if tuple(argv[:len(self.entry)]) == self.entry else list(argv)

    def validate_flags(self, argv: list[str]) -> list[str]:
        return self.validate_many([argv])[0]

    def validate_many(self, argvs: list[list[str]]) -> list[list[str]]:
        """Each command's errors: the captured schema's, then (for those it passes) the installed engine's own
        parser's, asked once for all of them."""
        arg_lists = [self.engine_args(argv) for argv in argvs]
        errors = [schema_errors(args, load_schema(self.name, self.version)) for args in arg_lists]
        unchecked = [i for i, e in enumerate(errors) if not e]
        verdicts = self.parser_verdicts([arg_lists[i] for i in unchecked]) if unchecked else []
        for i, verdict in zip(unchecked, verdicts or []):
            errors[i] = verdict
        return errors

    def parser_verdicts(self, arg_lists: list[list[str]]) -> list[list[str]] | None:
        """The installed engine's own parser on each argument list (None: not installed where it can be asked)."""
        return engine_parser_verdicts(self.name, arg_lists)

    def scheduled_command(self, config: dict, schedule: DraftSchedule, *, model: str | None, draft_model: str | None,
                          host: str, port: int, directory: str | Path = ".",
                          extra_args: list[str] = ()) -> tuple[list[str], dict[str, str], ScheduleRendering]:
        """command() of `config` running `schedule`: (argv, env, the rendering, whose files are not yet written)."""
        rendering = self.schedule_args(config, schedule, directory=directory)
        argv, env = self.command({**config, **rendering.config}, model=model, draft_model=draft_model, host=host,
                                 port=port, extra_args=[*rendering.args, *extra_args])
        return argv, {**env, **rendering.env}, rendering

    def draft_length(self, config: dict) -> int:
        """Tokens a request drafts per step under `config` (0: it does not draft): the draft-length key's value."""
        drafter_key, k_key = self.facts.draft_keys
        if not (drafter_key and k_key) or config.get(drafter_key) in (None, "none"):
            return 0
        return int(config.get(k_key) or 0)

    def with_draft_length(self, config: dict, k: int) -> dict:
        """`config` drafting `k` tokens per step, its drafter kept (k = 0: the drafter set to draft nothing, which
        an engine without a runtime length cannot launch; turn speculation off instead)."""
        return {**config, self.facts.draft_keys[1]: k}

    def _drafting(self, config: dict) -> str:
        """`config`'s drafter; ValueError where it drafts with none (a schedule has nothing to shorten)."""
        drafter = config.get(self.facts.draft_keys[0])
        if drafter in (None, "none"):
            raise ValueError(f"a draft-length schedule needs a drafter: the {self.name} configuration has "
                             f"{self.facts.draft_keys[0]} {drafter or 'unset'}")
        return drafter

    def apply_runtime(self, base_url: str, runtime: dict) -> None:
        raise NotImplementedError(f"{self.name} cannot change settings on a running server; relaunch it")

    def translate_renamed(self, argv: list[str]) -> tuple[list[str], list[str]]:
        prefix = argv[:len(argv) - len(self.engine_args(argv))]
        args, notes = translate_renamed(self.engine_args(argv), load_schema(self.name, self.version))
        return list(prefix) + args, notes

    # -- predict -----------------------------------------------------------------------------------
    def tp_size(self, config: dict) -> int:
        """GPUs one server of `config` spans: its tensor-parallel size (1 for an engine without TP)."""
        return int(config.get(self.facts.tp_key) or 1) if self.facts.tp_key else 1

    def default_memory_fraction(self, tp: int, gpu_mib: float | None = None, config: dict | None = None) -> float:
        """The share of a GPU (of gpu_mib MiB) the engine takes when `config` sets none."""
        return 0.9

    def default_batch_tokens(self, gpu_mib: float, tp: int) -> int | None:
        """Tokens of the largest prefill chunk the engine picks on a GPU of gpu_mib MiB (None: not GPU-dependent)."""
        return None

    def bundle_drops(self, cuda: int) -> dict[str, str]:
        """`autotune bundle`: distributions the engine's requirements name that its server never imports on a GPU
        of CUDA major `cuda`, each with why (they are left out of an offline bundle)."""
        return {**self.facts.bundle_never_imported, **(CUDA12_ONLY if cuda >= 13 else {})}

    def bundle_adds(self) -> dict[str, str]:
        """`autotune bundle`: requirements (PEP 508) the server imports that the engine's own requirements name only
        through a distribution `bundle_drops` leaves out, each with why (they are added to the engine's)."""
        return dict(self.facts.bundle_undeclared)

    def preset_model(self, preset: str, hub_repo: str | None, given: str) -> str | None:
        """What the engine is told to load for a model preset (`given` is its name, not a path): the
        preset's Hugging Face repo where it names one."""
        return hub_repo or given
