"""The embedded engine: config -> `python -m autotune.cli serve` argv, its rules, and runtime knobs
changed on a running server (POST /admin/runtime), so trials that differ only in them need no relaunch.

Config keys are EngineConfig fields (autotune/embedded/config.py); its flags are the same names in
kebab-case. Metrics are `autotune_*` on /metrics (autotune/embedded/metrics.py).
"""
import dataclasses
import json
import sys
import types
from pathlib import Path

import httpx
import yaml

from autotune import __version__
from autotune.embedded import config as engine_config
from autotune.embedded.bundled import BUNDLED_PRESET, bundled_gguf_path
from autotune.embedded.draft_schedule import DraftSchedule
from autotune.engines.base import EngineAdapter, ScheduleRendering, schema_errors
from autotune.engines.facts import EngineFacts
from autotune.predict.knobs import Knobs, make_knobs, settings

CHOICES = engine_config.CHOICES
DEFAULTS = dataclasses.asdict(engine_config.EngineConfig())
DRAFT_KNOBS = ("draft_length", "draft_policy", "draft_estimator", "early_exit_layers", "ngram_min", "ngram_max",
               "draft_model")
SCHEDULE_FILE = "draft_schedule.yaml"  # beside launch.sh (the name study/schedule.py writes best/ with)
SERVE_ONLY = {"host": str, "port": int, "log_level": str}  # serve flags that are not EngineConfig fields
# Kernels of one decoder layer run op by op (autotune/embedded/model.py, counted from forward): 2 RMSNorms
# of 8 ops (float, pow, mean, add, rsqrt, mul, cast, weight), wqkv, rope of 6 ops (neg, cat, 2 mul, add,
# cast) on q and k, the cache write (2) and attention (2), the transpose copy, wo, w13, silu, mul, w2, 2
# residual adds. Int8Linear adds 3 per linear layer (weight cast, scale cast, scale mul) x 4.
UNFUSED_LAYER_KERNELS = 16 + 1 + 12 + 4 + 1 + 1 + 4 + 2
INT8_UNFUSED_KERNELS = 3 * 4


def _schema() -> dict:
    """EngineConfig's fields as a flag schema, so `autotune serve` argv is checked like the others."""
    options = []
    for name, typ in [*((f.name, f.type) for f in dataclasses.fields(engine_config.EngineConfig)), *SERVE_ONLY.items()]:
        base = next(t for t in typ.__args__ if t is not type(None)) if isinstance(typ, types.UnionType) else typ
        options.append({"flags": ["--" + name.replace("_", "-")], "dest": name, "optional": False, "nargs": None,
                        "type": {int: "int", float: "float"}.get(base, "str"), "choices": CHOICES.get(name)})
    return {"engine": "embedded", "version": "autotune serve", "options": options, "renamed": {},
            "by_flag": {o["flags"][0]: o for o in options}}


SCHEMA = _schema()


class EmbeddedAdapter(EngineAdapter):
    name = "embedded"
    entry = (sys.executable, "-m", "autotune.cli", "serve")
    facts = EngineFacts(
        default_port=30000,
        numerics=("dtype", "quantization", "compile"),
        speculation_off={"drafter": "none"},
        finish_validation={"top": 2, "repeats": 2, "max_repeats": 4},
        sampling_defaults={"temperature": 0.0, "top_p": 1.0},
        # Small for a CPU: a trial is about half a minute, so the default study (11 min, then validation of the top
        # 2 twice, up to 4 times in a close race, and the report) ends in about 15-20 minutes on a small machine.
        default_load={"concurrency": 4, "num_requests": 8, "max_tokens": 48},
        default_budget_s=11 * 60,
        runtime_params=frozenset(engine_config.RUNTIME_KNOBS),
        startup_compile_gauge="autotune_startup_compile_seconds",  # inductor's cache (TORCHINDUCTOR_CACHE_DIR)
        draft_keys=("drafter", "draft_length"),
        spec_counters=("autotune_spec_verify_steps_total", "autotune_spec_draft_tokens_total",
                       "autotune_spec_accepted_tokens_total"),
        fingerprint_keys=("cpu", "torch_threads", "fast_dtypes"),
        needs_draft_model={"drafter": ("draft_model",)},
        modelled=("drafter", "draft_length", "early_exit_layers", "verify_slots", "dtype", "quantization", "compile",
                  "cuda_graph_batch_sizes"),
        drafter_families={"ngram": "lookup", "early_exit": "early_exit", "quantized_self": "quantized_self",
                          "draft_model": "draft"},
        # A slot cache of verify_slots x max_seq_len tokens is allocated up front (in host RAM on a CPU machine);
        # with the weights it must fit default_memory_fraction of a GPU, or the available RAM.
        memory_pool="slots",
        default_context_len=2048,  # a slot's max_seq_len
    )

    def installed(self):
        return True  # it ships inside autotune

    def installed_version(self):
        return __version__

    def recorded_version(self, provenance):
        return (provenance.get("versions") or {}).get("autotune")

    def default_model(self):
        return str(bundled_gguf_path())

    def portable_model(self, model):
        """`autotune serve` finds the bundled model itself: the exported script stays portable."""
        try:
            return None if model and Path(model).resolve() == bundled_gguf_path().resolve() else model
        except Exception:  # noqa: BLE001 - no bundled model installed: keep the path as given
            return model

    def tokenizer(self, model):
        """The checkpoint's own tokenizer: the GGUF's vocabulary (the bundled one when none is given) or a
        safetensors directory's tokenizer.json; the weights are not read."""
        from autotune.embedded.gguf_header import read_header
        from autotune.embedded.tokenizer import tokenizer_from_gguf, tokenizer_from_hf_dir

        path = Path(model).expanduser() if model else bundled_gguf_path()
        if path.is_dir():
            return tokenizer_from_hf_dir(path, json.loads((path / "config.json").read_text()))
        return tokenizer_from_gguf(read_header(path).meta)

    def command(self, config, *, model, draft_model, host, port, extra_args=()):
        unknown = set(config) - set(DEFAULTS)
        if unknown:
            raise ValueError(f"not embedded-engine settings: {', '.join(sorted(unknown))}")
        settings = {**config, "model": model, "draft_model": draft_model}
        args = []
        for key, value in settings.items():
            if value is None or (isinstance(value, list) and not value):
                continue
            text = ",".join(map(str, value)) if isinstance(value, list) else str(value)
            args += ["--" + key.replace("_", "-"), text]
        return [*self.entry, *args, "--host", host, "--port", str(port), *extra_args], {}

    def check(self, config, hardware=None, *, has_draft_model=None):
        """The engine's own rules (embedded/config.py: rule_violations), all of them, before any launch."""
        unknown = set(config) - set(DEFAULTS)
        if unknown:
            return [f"not embedded-engine settings: {', '.join(sorted(unknown))}"]
        c = {**DEFAULTS, **{k: v for k, v in config.items() if v is not None}}
        if has_draft_model is not False:  # given at launch (or not known here): only its absence is a fault
            c["draft_model"] = c["draft_model"] or "--draft-model"
        return engine_config.rule_violations(engine_config.EngineConfig(**c))

    def schedule_args(self, config, schedule, *, directory="."):
        """`--draft-schedule FILE`: the engine applies the schedule itself at every step, as fitted."""
        self._drafting(config)
        path = str(Path(directory) / SCHEDULE_FILE)
        text = yaml.safe_dump(schedule.model_dump(mode="json"), sort_keys=False)  # DraftSchedule.dump's YAML
        return ScheduleRendering(config={"draft_schedule": path}, files={path: text})

    def effective(self, config):
        c = {**DEFAULTS, **{k: v for k, v in config.items() if v is not None}}
        if c["drafter"] == "none":
            for key in DRAFT_KNOBS:
                c[key] = DEFAULTS[key]
        if c["drafter"] != "ngram":
            c["ngram_min"], c["ngram_max"] = DEFAULTS["ngram_min"], DEFAULTS["ngram_max"]
        if c["drafter"] != "early_exit":
            c["early_exit_layers"] = DEFAULTS["early_exit_layers"]
        c["cuda_graph_batch_sizes"] = sorted(set(c["cuda_graph_batch_sizes"] or []))
        return {k: v for k, v in c.items() if v != DEFAULTS[k]}

    def knobs(self, config: dict, on_gpu: bool = True) -> Knobs:
        c = settings(config)
        drafter = self.facts.drafter_families.get(c.get("drafter"))
        steps = int(c.get("draft_length", 4)) if drafter else 0
        sizes = c.get("cuda_graph_batch_sizes") or []
        graphs = bool(sizes) and on_gpu
        # no CUDA context is counted unless graphs are captured; int8 quantizes the tied head too. On a GPU
        # without inductor every op of a layer is a kernel of its own (UNFUSED_LAYER_KERNELS, and int8's
        # casts and scaling around each linear layer); else the model's fused count
        unfused = on_gpu and c.get("compile") != "inductor"
        int8 = INT8_UNFUSED_KERNELS if c.get("quantization") == "int8" else 0
        layer_kernels = UNFUSED_LAYER_KERNELS + int8 if unfused else None
        k = make_knobs(self.name, c, on_gpu, tp=self.tp_size(c), drafter=drafter, draft_steps=steps,
                       verify_tokens=steps + 1, cuda_graphs=graphs, graph_max_bs=max(sizes) if sizes else None,
                       mem_fraction=None,
                       max_running=c.get("verify_slots", 4), max_batch_tokens=c.get("prefill_ubatch", 256),
                       cuda_context=graphs, quantized_head=True, layer_kernels=layer_kernels)
        # a slot's cache holds max_seq_len + the longest draft + 1 positions (embedded/scheduler.py: headroom)
        max_seq_len = c.get("max_seq_len", engine_config.EngineConfig.max_seq_len)
        return dataclasses.replace(k, slot_tokens=max_seq_len + engine_config.MAX_DRAFT_LENGTH + 1)

    def preset_model(self, preset, hub_repo, given):
        """Local files only: the bundled GGUF for its preset (None = the engine's default), else as given."""
        return None if preset == BUNDLED_PRESET else given

    def config_keys(self):
        return set(DEFAULTS)

    def validate_flags(self, argv):
        return schema_errors(self.engine_args(argv), SCHEMA)

    def translate_renamed(self, argv):
        return list(argv), []

    def apply_runtime(self, base_url, runtime):
        if not runtime:
            return
        runtime = dict(runtime)
        if isinstance(runtime.get("draft_schedule"), str):  # the launch flag's file; the server takes the schedule
            runtime["draft_schedule"] = DraftSchedule.load(runtime["draft_schedule"]).model_dump(mode="json")
        r = httpx.post(base_url.rstrip("/") + "/admin/runtime", json=runtime, timeout=10.0)
        if r.status_code != 200:
            try:
                detail = r.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                detail = r.text.strip()[:300]
            raise ValueError(f"runtime settings {runtime} refused: {detail}")
