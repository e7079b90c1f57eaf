"""A search space: parameters from YAML, narrowed or pinned by the user, sampled by an Optuna trial.

The YAML format (search_spaces/<engine>.yaml) is shared by every engine:

    parameters:
      drafter:      {type: categorical, choices: [none, ngram], default: none}
      draft_length: {type: int, low: 1, high: 8, default: 4, runtime: true, when: {drafter: [ngram]}}
      cuda_graph_bs: {type: batch_sizes, choices: [[1, 2, 4], [1, 2, 4, 8]], default: null}
    seeds: [{}, {drafter: ngram}]

A parameter with `when` exists only while every named parameter takes one of the listed values, so
Optuna is only asked for it then (conditional search space). `runtime` parameters can change on a
running server without a relaunch.

What depends on the machine and the load is written as data too, and resolved by `Space.fitted`
(autotune/space/fit.py reads the machine's facts):

    compile:      {type: categorical, choices: [none, inductor], default: none, device: cuda}
    dtype:        {type: categorical, choices: [float32, bfloat16], default: float32, units: {bfloat16: bf16}}
    verify_slots: {type: int, low: 1, high: 16, default: 4, load: true}
    seeds: [{device: cuda, compile: inductor, verify_slots: load}]

`device`: searched only where the engine runs on that device (elsewhere it keeps its default).
`units`: a choice kept only where the hardware has native units of that type. `load: true`: the
values follow the study's concurrency (an int reaches it; batch sizes are the powers of two up to
it). In a seed, `device` says where it applies and the value `load` is the load-matched value.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from autotune import shipped_folder

SPACES_DIR = shipped_folder("search_spaces")
TYPES = ("int", "float", "categorical", "batch_sizes")
DEVICES = ("cuda", "cpu")
LOAD = "load"  # a seed's value for a `load: true` parameter: the value matched to the study's load
_UNSET = object()


class SpaceError(ValueError):
    """A space file or a narrowing the user gave cannot be used (message fits on one line)."""


@dataclass
class Param:
    name: str
    type: str
    default: Any = None
    low: float | None = None
    high: float | None = None
    step: float | None = None
    log: bool = False
    choices: list | None = None
    when: dict[str, list] = field(default_factory=dict)
    runtime: bool = False
    device: str | None = None  # searched only where the engine runs on this device
    units: dict[str, str] = field(default_factory=dict)  # choice -> the native unit it needs
    load: bool = False  # values follow the study's concurrency
    narrowed: bool = False  # the user narrowed it: machine and load rules leave it alone
    fixed: Any = _UNSET  # pinned by the user: never asked of Optuna

    @property
    def pinned(self) -> bool:
        return self.fixed is not _UNSET

    def contains(self, value) -> bool:
        if self.pinned:
            return value == self.fixed
        if self.type in ("categorical", "batch_sizes"):
            return value in self.choices
        if value is None:  # "leave it to the engine", allowed where that is the default
            return self.default is None
        return self.low <= value <= self.high

    def suggest(self, trial):
        if self.type == "int":
            return trial.suggest_int(self.name, int(self.low), int(self.high), step=int(self.step or 1), log=self.log)
        if self.type == "float":
            return trial.suggest_float(self.name, self.low, self.high, step=self.step, log=self.log)
        if self.type == "batch_sizes":  # Optuna's categoricals hold scalars: lists travel as JSON text
            return json.loads(trial.suggest_categorical(self.name, [json.dumps(c) for c in self.choices]))
        return trial.suggest_categorical(self.name, self.choices)

    def encode(self, value):
        """The value as Optuna stores it for this parameter (for enqueued seeds)."""
        return json.dumps(value) if self.type == "batch_sizes" else value


@dataclass
class Space:
    engine: str
    params: dict[str, Param]
    seeds: list[dict] = field(default_factory=list)
    version: str | None = None
    source: str = ""

    # -- which parameters exist in a configuration --------------------------------------------
    def active(self, param: Param, config: dict) -> bool:
        return all(ref in config and config[ref] in allowed for ref, allowed in param.when.items())

    def suggest(self, trial) -> dict:
        """A configuration from an Optuna trial; inactive parameters are never suggested.

        An enqueued seed carries its config in user_attrs["seed_config"]: a value of None there
        ("the engine's default", e.g. threads) is not a number Optuna can hold, so it is not asked."""
        seed = trial.user_attrs.get("seed_config") or {}
        config = {}
        for p in self.params.values():  # declaration order: `when` only names earlier parameters
            if not self.active(p, config):
                continue
            if p.pinned:
                config[p.name] = p.fixed
            elif p.name in seed and seed[p.name] is None:
                config[p.name] = None
            else:
                config[p.name] = p.suggest(trial)
        return config

    def complete(self, partial: dict) -> dict:
        """Pins over `partial` over defaults, keeping only the parameters active in the result."""
        config = {}
        for p in self.params.values():
            if self.active(p, config):
                config[p.name] = p.fixed if p.pinned else partial.get(p.name, p.default)
        return config

    def defaults(self) -> dict:
        return self.complete({})

    def runtime_names(self) -> set[str]:
        return {p.name for p in self.params.values() if p.runtime}

    def seed_configs(self) -> list[dict]:
        """Seeds completed with defaults and pins, dropping those outside the user's narrowing (and
        those that name a device or the load, until the space is fitted to a machine and a load)."""
        out = []
        for seed in self.seeds:
            if "device" in seed or LOAD in seed.values():
                continue
            config = self.complete(seed)
            if all(self.params[k].contains(v) for k, v in config.items()) and config not in out:
                out.append(config)
        return out

    def trial_params(self, config: dict) -> dict:
        """A config as the params dict of `study.enqueue_trial` (pinned parameters are not Optuna's)."""
        return {k: self.params[k].encode(v) for k, v in config.items() if not self.params[k].pinned and v is not None}

    # -- the machine and the load ---------------------------------------------------------------
    def fitted(self, device: str, concurrency: int, units: set[str] | None) -> Space:
        """The space for an engine on `device` ("cuda" | "cpu") under `concurrency` requests at a time,
        on hardware with native `units` (None: not known, every choice kept). Parameters the user pinned
        or narrowed stay as the user left them."""
        params = {}
        for name, p in self.params.items():
            if not p.pinned and not p.narrowed:
                if p.device and p.device != device:
                    p = replace(p, fixed=p.default)
                elif p.load and p.type == "int":
                    p = replace(p, high=max(concurrency, p.low, p.default or p.low))
                elif p.load and p.type == "batch_sizes":
                    p = replace(p, choices=[[], powers_of_two(concurrency)])
                if p.units and units is not None and not p.pinned:
                    p = replace(p, choices=[c for c in p.choices if c not in p.units or p.units[c] in units])
            params[name] = p
        seeds = [{k: (load_matched(params[k], concurrency) if v == LOAD else v) for k, v in seed.items() if k != "device"}
                 for seed in self.seeds if seed.get("device", device) == device]
        return replace(self, params=params, seeds=seeds)

    # -- user narrowing -----------------------------------------------------------------------
    def narrowed(self, overrides: dict[str, Any]) -> "Space":
        """A copy with user narrowing applied. Values: a scalar pins; a list keeps those choices;
        {low, high} (or the text "low..high") changes a numeric range; text from the command line
        is parsed ("a,b" is a list)."""
        params = dict(self.params)
        for name, spec in overrides.items():
            if name not in params:
                raise SpaceError(f"unknown parameter {name!r} for {self.engine} (known: {', '.join(params)})")
            params[name] = replace(_narrow(params[name], spec), narrowed=True)
        return replace(self, params=params)


def powers_of_two(limit: int) -> list[int]:
    """1, 2, 4, ... up to the first power of two that reaches `limit`: batch sizes for every load up to it."""
    sizes = [1]
    while sizes[-1] < limit:
        sizes.append(2 * sizes[-1])
    return sizes


def load_matched(p: Param, concurrency: int):
    """A `load: true` parameter's value for `concurrency` requests at a time (a seed's `load`)."""
    if p.pinned:
        return p.fixed
    return powers_of_two(concurrency) if p.type == "batch_sizes" else concurrency


def _narrow(p: Param, spec) -> Param:
    if isinstance(spec, str):
        spec = _parse_text(p, spec)
    if isinstance(spec, dict):
        if p.type not in ("int", "float") or set(spec) - {"low", "high"}:
            raise SpaceError(f"{p.name}: a range {{low, high}} only applies to int/float parameters")
        low, high = _number(p, spec.get("low", p.low)), _number(p, spec.get("high", p.high))
        if low > high:
            raise SpaceError(f"{p.name}: empty range {low}..{high}")
        return replace(p, low=low, high=high, log=p.log and low > 0, fixed=_UNSET)
    is_list_of_values = isinstance(spec, list) and (p.type != "batch_sizes" or all(isinstance(s, list) for s in spec))
    if not is_list_of_values:
        return replace(p, fixed=_value(p, spec))
    values = [_value(p, s) for s in spec]
    if not values:
        raise SpaceError(f"{p.name}: no values given")
    if len(values) == 1:
        return replace(p, fixed=values[0])
    kind = p.type if p.type in ("categorical", "batch_sizes") else "categorical"
    return replace(p, type=kind, choices=values, fixed=_UNSET)


def _parse_text(p: Param, text: str):
    text = text.strip()
    if ".." in text and p.type in ("int", "float"):
        low, high = text.split("..", 1)
        return {"low": low, "high": high}
    if p.type == "batch_sizes":
        try:
            return yaml.safe_load(text)  # "[1,2,4]" pins a list, "[[1,2],[1,2,4]]" keeps two, "null"
        except yaml.YAMLError:
            raise SpaceError(f"{p.name}: cannot read {text!r} (write a list such as [1,2,4,8])") from None
    return text.split(",") if "," in text else text


def _number(p: Param, value):
    try:
        return int(value) if p.type == "int" else float(value)
    except (TypeError, ValueError):
        raise SpaceError(f"{p.name}: {value!r} is not a{'n int' if p.type == 'int' else ' number'}") from None


def _value(p: Param, value):
    """One value of this parameter, from YAML or command-line text, checked against its choices."""
    if p.type in ("int", "float"):
        return _number(p, value)
    if p.type == "batch_sizes":
        if value is None or (isinstance(value, list) and all(isinstance(b, int) and b > 0 for b in value)):
            return value
        raise SpaceError(f"{p.name}: {value!r} is not a list of batch sizes")
    for choice in p.choices:
        if value == choice or str(value).lower() == str(choice).lower():
            return choice
    raise SpaceError(f"{p.name}: {value!r} is not one of {p.choices}")


# -- loading ---------------------------------------------------------------------------------------
def load_space(path_or_engine: str | Path) -> Space:
    """Load search_spaces/<engine>.yaml (given the engine name) or a space file by path."""
    path = Path(path_or_engine)
    if not path.suffix and not path.exists():
        path = SPACES_DIR / f"{path_or_engine}.yaml"
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as e:
        raise SpaceError(f"cannot read search space {path}: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise SpaceError(f"{path}: not valid YAML ({str(e).splitlines()[0]})") from None
    return parse_space(data, source=str(path))


def parse_space(data, source: str = "<space>") -> Space:
    if not isinstance(data, dict) or not isinstance(data.get("parameters"), dict) or not data["parameters"]:
        raise SpaceError(f"{source}: a search space needs a non-empty 'parameters' mapping")
    params: dict[str, Param] = {}
    for name, spec in data["parameters"].items():
        params[name] = _param(name, spec, params, source)
    seeds = data.get("seeds") or [{}]
    if not isinstance(seeds, list) or not all(isinstance(s, dict) for s in seeds):
        raise SpaceError(f"{source}: 'seeds' must be a list of mappings")
    for seed in seeds:
        if seed.get("device", "cuda") not in DEVICES:
            raise SpaceError(f"{source}: a seed's device must be one of {DEVICES}, got {seed['device']!r}")
        for k, v in seed.items():
            if k != "device" and k not in params:
                raise SpaceError(f"{source}: seed names unknown parameter {k!r}")
            if v == LOAD and not params[k].load:
                raise SpaceError(f"{source}: a seed sets {k} to {LOAD!r}, but {k} does not follow the load")
    return Space(engine=str(data.get("engine", Path(source).stem)), params=params, seeds=seeds,
                 version=data.get("version"), source=source)


def _param(name: str, spec, earlier: dict[str, Param], source: str) -> Param:
    where = f"{source}: parameter {name!r}"
    if not isinstance(spec, dict) or spec.get("type") not in TYPES:
        raise SpaceError(f"{where}: needs 'type' in {TYPES}")
    unknown = set(spec) - {"type", "low", "high", "step", "log", "choices", "default", "when", "runtime", "device",
                           "units", "load"}
    if unknown:
        raise SpaceError(f"{where}: unknown keys {sorted(unknown)}")
    p = Param(name=name, type=spec["type"], default=spec.get("default"), low=spec.get("low"), high=spec.get("high"),
              step=spec.get("step"), log=bool(spec.get("log", False)), choices=spec.get("choices"),
              when=spec.get("when") or {}, runtime=bool(spec.get("runtime", False)), device=spec.get("device"),
              units=spec.get("units") or {}, load=bool(spec.get("load", False)))
    if p.device is not None and p.device not in DEVICES:
        raise SpaceError(f"{where}: device must be one of {DEVICES}, got {p.device!r}")
    if not isinstance(p.units, dict) or (p.units and not set(p.units) <= set(p.choices or [])):
        raise SpaceError(f"{where}: 'units' maps some of its choices to the native unit each needs")
    if p.load and p.type not in ("int", "batch_sizes"):
        raise SpaceError(f"{where}: 'load: true' applies to int and batch_sizes parameters")
    if p.type in ("int", "float"):
        if not isinstance(p.low, (int, float)) or not isinstance(p.high, (int, float)) or p.low > p.high:
            raise SpaceError(f"{where}: needs numeric low <= high")
        if p.log and (p.step is not None or p.low <= 0):
            raise SpaceError(f"{where}: log scale needs low > 0 and no step")
    elif not isinstance(p.choices, list) or not p.choices:
        raise SpaceError(f"{where}: needs a non-empty 'choices' list")
    elif p.type == "batch_sizes" and not all(c is None or isinstance(c, list) for c in p.choices):
        raise SpaceError(f"{where}: batch_sizes choices are lists of sizes")
    if p.default is not None and not p.contains(p.default):
        raise SpaceError(f"{where}: default {p.default!r} is outside the parameter's values")
    if not isinstance(p.when, dict):
        raise SpaceError(f"{where}: 'when' maps earlier parameters to lists of values")
    for ref, allowed in p.when.items():
        if ref not in earlier:
            raise SpaceError(f"{where}: 'when' names {ref!r}, which must be declared before it")
        if not isinstance(allowed, list) or not all(earlier[ref].contains(v) for v in allowed):
            raise SpaceError(f"{where}: 'when' lists values {allowed!r} that {ref!r} cannot take")
    return p


def load_overrides(path: str | Path) -> dict:
    """A YAML narrowing file: {name: value | [values] | {low, high}}."""
    try:
        data = yaml.safe_load(Path(path).read_text())
    except OSError as e:
        raise SpaceError(f"cannot read {path}: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise SpaceError(f"{path}: not valid YAML ({str(e).splitlines()[0]})") from None
    if not isinstance(data, dict):
        raise SpaceError(f"{path}: expected a mapping of parameter names to values, lists or ranges")
    return data


def parse_set_options(items: list[str]) -> dict[str, str]:
    """`--set name=value` options (value may be a,b or low..high) as {name: text}."""
    out = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name.strip() or not value.strip():
            raise SpaceError(f"--set {item!r}: expected name=value, name=a,b or name=low..high")
        out[name.strip().replace("-", "_")] = value.strip()
    return out
