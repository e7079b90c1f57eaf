"""vLLM 0.33.0: config -> `python -m vllm.entrypoints.cli.main serve` argv, its cross-flag rules,
and the settings it would actually run (read from vllm/config/{speculative,scheduler,vllm}.py).

Config keys are vLLM's option names (`max_num_seqs`, `cudagraph_capture_sizes`, ...), except the
speculative ones, which are keys of its `--speculative-config` JSON: `speculative_method`
(none | ngram | draft_model | eagle | eagle3 | dflash | mtp), `num_speculative_tokens`, `prompt_lookup_min`,
`prompt_lookup_max`. Quantization `w8a16_fp8` = FP8 weights through Marlin (`--quantization fp8`:
vLLM picks Marlin by itself on Ampere, where it is the only FP8 path); `awq_marlin` / `gptq_marlin` = an
AWQ / GPTQ checkpoint, whose own quantization_config vLLM follows (no flag).
"""
import sys

from autotune.engines.base import EngineAdapter, config_args, load_schema
from autotune.predict.knobs import FAMILIES, Knobs, make_knobs, settings

SPEC_KEYS = ("speculative_method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max")
METHODS = ("ngram", "draft_model", "eagle", "eagle3", "dflash", "mtp")
NEEDS_DRAFT_MODEL = ("draft_model", "eagle", "eagle3", "dflash")
NGRAM_DEFAULT_LOOKUP = 5  # both min and max, when neither is given
CHECKPOINT_QUANTIZATION = ("awq_marlin", "gptq_marlin")  # 4-bit checkpoints, read as their config says
# KV block size on CUDA when --block-size is unset (vllm/platforms/cuda.py sets 16; a hybrid model's
# attention blocks grow until a page holds one recurrent state: predict/memory.py).
DEFAULT_BLOCK_SIZE = 16
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9  # vllm/config/cache.py: gpu_memory_utilization


class VLLMAdapter(EngineAdapter):
    name = "vllm"
    version = "0.33.0"
    entry = (sys.executable, "-m", "vllm.entrypoints.cli.main", "serve")
    image = "vllm/vllm-openai:v{version}"
    config_file_use = "vllm serve --config best/config.yaml --host 127.0.0.1 --port 8000"
    numerics = ("dtype", "quantization", "kv_cache_dtype")
    speculation_off = {"speculative_method": None}
    draft_keys = ("speculative_method", "num_speculative_tokens")
    spec_counters = ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
                     "vllm:spec_decode_num_accepted_tokens_total")
    tp_key = "tensor_parallel_size"
    modelled = ("tensor_parallel_size", "quantization", "kv_cache_dtype", "speculative_method", "num_speculative_tokens",
                "gpu_memory_utilization")
    # gpu_memory_utilization (default 0.9) x total memory is everything the instance may use; the KV
    # cache gets what the weights, the profiled activation peak and the CUDA graphs leave.
    memory_pool = "utilization"
    graph_max_bs_default = 512
    needs_draft_model = {"speculative_method": NEEDS_DRAFT_MODEL}

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

    def config_keys(self):
        return super().config_keys() | set(SPEC_KEYS)  # the --speculative-config JSON's keys, flattened

    def command(self, config, *, model, draft_model, host, port, extra_args=()):
        flags = {k: v for k, v in config.items() if k not in SPEC_KEYS}
        if flags.get("quantization") == "w8a16_fp8":
            flags["quantization"] = "fp8"
        if flags.get("quantization") in CHECKPOINT_QUANTIZATION:
            # the checkpoint's quantization_config decides: vLLM 0.33 serves AWQ/GPTQ checkpoints through
            # AutoAWQ/AutoGPTQ, which pick the Marlin kernels on cc >= 8.0 by themselves
            # (model_executor/layers/quantization/auto_awq.py, override_quantization_method); an explicit
            # awq_marlin is refused where Marlin is not (the CPU)
            flags.pop("quantization")
        spec = self.speculative_config(config, draft_model)
        if spec is not None:
            flags["speculative_config"] = spec
        args = config_args(flags, load_schema(self.name, self.version))
        head = (["--model", model] if model else []) + ["--host", host, "--port", str(port)]
        return [*self.entry, *head, *args, *extra_args], {}

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
        return out

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
        drafter = FAMILIES.get(c.get("speculative_method"))
        tokens = int(c.get("num_speculative_tokens", 1 if drafter == "mtp" else 3)) if drafter else 0
        # dflash drafts the whole block in one parallel pass (SpeculativeConfig: parallel_drafting)
        steps = 1 if drafter == "dflash" else tokens
        sizes = c.get("cudagraph_capture_sizes")
        graph_max = max(sizes) if sizes else c.get("max_cudagraph_capture_size")
        return make_knobs(self.name, c, on_gpu, tp=self.tp_size(c), drafter=drafter, draft_steps=steps,
                          verify_tokens=tokens + 1, cuda_graphs=not c.get("enforce_eager", False),
                          graph_max_bs=graph_max or self.graph_max_bs_default,
                          mem_fraction=c.get("gpu_memory_utilization"), max_running=c.get("max_num_seqs"),
                          max_batch_tokens=c.get("max_num_batched_tokens"),
                          block_size=c.get("block_size") or DEFAULT_BLOCK_SIZE)

    def default_memory_fraction(self, tp, gpu_mib=None, config=None):
        return DEFAULT_GPU_MEMORY_UTILIZATION
