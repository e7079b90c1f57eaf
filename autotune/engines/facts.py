"""What an engine is, as data: the static facts the rest of the package reads (`adapter.facts.<name>`), grouped by
who reads them. Each adapter declares one record; behaviour (launching, rules, runtime changes) stays in its
class (autotune/engines/protocol.py lists it)."""
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import Literal, get_args

from autotune.predict.knobs import DRAFTER_FAMILIES

MemoryPool = Literal["static_fraction", "utilization", "slots"]  # how predict/memory.py splits a GPU for it


def _frozen(mapping: Mapping) -> Mapping:
    return MappingProxyType(dict(mapping))


@dataclass(frozen=True)
class EngineFacts:
    # export: where launch.sh listens unless PORT says otherwise; the docker image ("{version}" filled in) and the
    # argv inside it before the engine's arguments; how the engine reads best/config.yaml.
    default_port: int = 8000
    image: str | None = None
    image_command: tuple[str, ...] = ()
    config_file_use: str | None = None
    # validation: settings that change what the model computes (with the baseline's values, greedy output must
    # match); the config update that turns speculation off (the baseline); validation's size after `autotune run`
    # (empty: validate's own); the server's sampling where a request leaves it out.
    numerics: tuple[str, ...] = ()
    speculation_off: Mapping[str, object] = field(default_factory=dict)
    finish_validation: Mapping[str, int] = field(default_factory=dict)
    sampling_defaults: Mapping[str, float] = field(default_factory=lambda: {"temperature": 1.0, "top_p": 1.0})
    # the tuner: per-trial load and budget when the user gives none; settings a running server changes in place
    # (no relaunch: the adapter's apply_runtime).
    default_load: Mapping[str, int] = field(
        default_factory=lambda: {"concurrency": 32, "num_requests": 128, "max_tokens": 256})
    default_budget_s: float | None = None
    runtime_params: frozenset[str] = frozenset()
    # the /metrics gauge of the seconds a launch spent compiling before it answered, for an engine whose compile
    # cache serves the relaunch of a configuration already run (the budget then prices a relaunch without it).
    startup_compile_gauge: str | None = None
    # report and the draft-length schedule: (config key naming the drafter, the space's key of its draft length:
    # the length itself reads and writes through the adapter's draft_length / with_draft_length).
    draft_keys: tuple[str | None, str | None] = (None, None)
    # bench: acceptance on /metrics, as (verify steps, draft tokens, accepted tokens) counters or (accept length,
    # accept rate) gauges.
    spec_counters: tuple[str, str, str] | None = None
    spec_gauges: tuple[str, str] | None = None
    # ci: host facts beyond GPUs, driver and versions that decide this engine's speed (a CPU engine's CPU model,
    # thread count and native dtypes).
    fingerprint_keys: tuple[str, ...] = ()
    # space: choices of a parameter that draft with a second checkpoint, offered only with --draft-model.
    needs_draft_model: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    # prediction (autotune/predict/): the config key of the tensor-parallel size (None: no TP); the keys the memory
    # and speed model read (what `autotune estimate` enumerates); the drafter family (predict/knobs.py:
    # DRAFTER_FAMILIES) each value of draft_keys[0] drafts with (a value not here: none the model prices); how
    # the engine splits a GPU: "static_fraction"
    # (weights + KV pool inside a fraction, the workspace outside it), "utilization" (everything inside a fraction;
    # the KV cache gets what is left) or "slots" (a KV cache of max_running x context tokens allocated up front);
    # the context one sequence must hold unless the caller says; the largest CUDA-graph batch when the config sets
    # none (0: no graphs by default).
    tp_key: str | None = None
    modelled: tuple[str, ...] = ()
    drafter_families: Mapping[str, str] = field(default_factory=dict)
    memory_pool: MemoryPool = "utilization"
    default_context_len: int = 4096
    graph_max_bs_default: int = 0
    # host time each speculative step costs on a GPU that the engine does not overlap with the GPU's work (building
    # the draft tree, reading back and applying what was accepted), in place of the speed model's engine-neutral
    # prior (autotune/predict/speed.py: Coefficients.spec_step_s); None: that prior.
    spec_step_host_s: float | None = None
    # autotune bundle: distributions the engine's requirements name that its server never imports on one Hopper
    # GPU, and requirements (PEP 508) it imports that only those name, each with why.
    bundle_never_imported: Mapping[str, str] = field(default_factory=dict)
    bundle_undeclared: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self):
        # a frozen record holds read-only mappings too: a reader that merges one into its own dict copies it
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, dict):
                object.__setattr__(self, f.name, _frozen(value))
        if self.memory_pool not in get_args(MemoryPool):
            raise ValueError(f"memory_pool {self.memory_pool!r} is not one of {', '.join(get_args(MemoryPool))}")
        unknown = set(self.drafter_families.values()) - set(DRAFTER_FAMILIES)
        if unknown:
            raise ValueError(f"drafter_families: {', '.join(sorted(unknown))} not among {', '.join(DRAFTER_FAMILIES)}")

    def split_runtime(self, config: Mapping, names: set[str] | None = None) -> tuple[dict, dict]:
        """`config` as (what a server is launched with, what a running server takes in place): runtime settings are
        runtime_params, or those of `names` (a space may allow fewer)."""
        runtime = self.runtime_params if names is None else names
        return ({k: v for k, v in config.items() if k not in runtime},
                {k: v for k, v in config.items() if k in runtime})

    def __reduce__(self):
        # read-only mappings neither pickle nor deep-copy: the record is rebuilt from plain ones
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        return _rebuilt, ({k: dict(v) if isinstance(v, MappingProxyType) else v for k, v in values.items()},)


def _rebuilt(values: dict) -> EngineFacts:
    return EngineFacts(**values)
