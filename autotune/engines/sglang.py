"""SGLang: config -> `python -m sglang.launch_server` argv, its cross-flag rules, and the settings it would
actually run (read from sglang/srt/arg_groups/speculative_hook.py of 0.5.23, the data's pin).

Which flags: the schema captured from the installed version's own parser (0.5.17: the release that pins the
H200's torch 2.11.0; 0.5.23: the data's), else the newest captured one not newer than it; without SGLang here,
the data's. Flags renamed between them (deprecated aliases of 0.5.17 that 0.5.23 dropped) are translated by each
schema's "renames". Readiness is /health_generate: 503 while the server starts, then one generated token
(entrypoints/http_server.py, health_generate, in both versions).

Config keys are SGLang's own option names (`tp_size`, `speculative_num_steps`, ...); "none" or None
leaves a flag out. Two quantization values are ours: `w8a16_fp8` = weight-only FP8 through the Marlin
kernels (`--quantization fp8` with SGLANG_FORCE_FP8_MARLIN=1; what fp8 does by itself on Ampere);
`awq_marlin` / `gptq_marlin` = an AWQ / GPTQ checkpoint through Marlin (`--quantization awq_marlin`, the
method SGLang resolves such a checkpoint to by itself where Marlin runs; the row names the checkpoint:
autotune/predict/checkpoints.py).
"""
import functools
import json
import sys
from pathlib import Path

from packaging.version import Version

from autotune.engines.base import (
    EngineAdapter,
    ScheduleRendering,
    config_args,
    load_schema,
    schedule_departures,
)
from autotune.engines.facts import EngineFacts
from autotune.engines.hf_model import ServesHFDirectories
from autotune.predict.knobs import Knobs, make_knobs, settings

# NEXTN is an alias of EAGLE (for models that carry their own MTP layers, e.g. DeepSeek-V3).
EAGLE_FAMILY = ("EAGLE", "EAGLE3", "NEXTN", "STANDALONE")
ALGORITHMS = (*EAGLE_FAMILY, "NGRAM", "DFLASH")
NEEDS_DRAFT_MODEL = ("EAGLE", "EAGLE3", "STANDALONE", "DFLASH")
TREE_ATTENTION_BACKENDS = ("flashinfer", "fa3", "triton")  # EAGLE topk > 1 with page_size > 1
NGRAM_DEFAULT_DRAFT_TOKENS = 12
# NGRAM runs a tree of speculative_ngram_max_bfs_breadth (default 10) branches as its topk, and with
# page_size > 1 only on flashinfer (sglang 0.5.23 arg_groups/speculative_hook.py, _handle_ngram: "topk > 1 with
# page_size > 1 ... only supported for the 'flashinfer' backend"; fields: speculative_ngram_max_bfs_breadth = 10).
# An unset backend is not assured to be flashinfer: SGLang picks fa3 on Hopper for most architectures
# (utils/common.py, is_fa3_default_architecture).
NGRAM_DEFAULT_BFS_BREADTH = 10
# The draft architectures each algorithm runs. SGLang loads the draft checkpoint's own architecture from its
# model registry (configs/model_config.py, _config_draft_model remaps only NextN/MTP targets): EAGLE heads
# are *ForCausalLMEagle (models/llama_eagle.py: LlamaForCausalLMEagle), EAGLE-3 heads *ForCausalLMEagle3
# (models/llama_eagle3.py: LlamaForCausalLMEagle3), DFlash drafters DFlash* (models/dflash.py: DFlashDraftModel,
# DFlashLagunaForCausalLM). An EAGLE head released as LlamaForCausalLM would load as a whole Llama model.
DRAFT_ARCHITECTURES = {"EAGLE": ("eagle", lambda a: a.endswith("ForCausalLMEagle")),
                       "EAGLE3": ("eagle3", lambda a: a.endswith("Eagle3")),
                       "DFLASH": ("dflash", lambda a: a.startswith("DFlash")),
                       "STANDALONE": ("standalone", lambda a: True)}
# DFLASH without --speculative-num-draft-tokens takes the draft config's block_size, else 16
# (sglang/srt/arg_groups/speculative_hook.py, _handle_dflash: `inferred_block_size = 16`).
DFLASH_DEFAULT_BLOCK = 16
# Every speculative algorithm resets an unset max_running_requests to 48 (_handle_eagle_family,
# _handle_dflash: "Max running requests is reset to 48 for speculative decoding").
SPEC_MAX_RUNNING = 48
SPEC_SHAPE = ("speculative_num_steps", "speculative_eagle_topk", "speculative_num_draft_tokens")
# --speculative-adaptive with --speculative-adaptive-config FILE (0.5.17 and 0.5.23 alike,
# speculative/adaptive_spec_params.py): tiers keyed by the smallest batch each covers, {"1": {"candidate_steps":
# [...]}, ...}; a decode step's batch, first padded up to the next decode CUDA-graph size, takes the tier of the
# largest key <= it, whose EMA of acceptance picks among its candidates (one candidate: a fixed length). SGLang runs
# it for EAGLE / EAGLE3 (NEXTN is EAGLE) with topk 1 only and turns it off beside the settings below
# (adaptive_unsupported_reason); speculative_num_steps must be one of the candidates (speculative_hook.py).
ADAPTIVE_ALGORITHMS = ("EAGLE", "EAGLE3", "NEXTN")
ADAPTIVE_OFF_WITH = ("enable_dp_attention", "enable_two_batch_overlap", "enable_pdmux", "enable_multi_layer_eagle")
ADAPTIVE_FILE = "sglang_adaptive.json"
# sglang/srt/arg_groups/memory_hook.py (handle_gpu_memory_settings), by GPU memory in MiB: the upper bound
# of each band, (chunked_prefill_size, decode CUDA-graph max batch for tp < 4, for tp >= 4).
MEMORY_BANDS = ((20 * 1024, 2048, 8, 8), (35 * 1024, 4096, 48, 160), (60 * 1024, 4096, 32, 160),
                (90 * 1024, 8192, 256, 512), (160 * 1024, 8192, 256, 512), (float("inf"), 16384, 512, 512))


SCHEMA_VERSIONS = ("0.5.17", "0.5.23")  # captured parsers (autotune/engines/schemas/); the last is the data's pin
# What `autotune bundle` leaves out of an offline SGLang install for a Hopper server: distributions the release's
# requirements name that no module of a text server on CUDA 13 imports (sglang 0.5.17's sources: where each is
# imported, and only there).
NEVER_IMPORTED = {
    "tokenspeed-mla": "only srt/layers/attention/tokenspeed_mla_backend.py (--attention-backend tokenspeed_mla, for "
                      "MLA models); brings tokenspeed-triton, 95 MB",
    "tilelang": "only kernels/ops/attention/dsa/tilelang_kernel.py (DeepSeek sparse attention); brings z3-solver",
    "humming-kernels": "only srt/layers/quantization/humming*.py and moe_runner/humming.py (--quantization humming); "
                       "its [cu13] extra brings pip's nvcc, nvvm and cccl, 127 MB",
    "nvidia-mathdx": "only kernels/ops/lplb (the expert-placement solver of --enable-eplb, MoE expert parallelism)",
    "mistral-common": "only srt/models/voxtral.py (an audio model); its numpy<2.4 pin would replace the machine's numpy",
    "datasets": "only sglang/test and sglang/benchmark (evaluation data), never the server",
    "modelscope": "only a lazy import in srt/model_loader/loader.py for SGLANG_USE_MODELSCOPE (ModelScope downloads: "
                  "no network offline)",
    "smg-grpc-servicer": "only srt/entrypoints/grpc_server.py (the gRPC server mode, not the HTTP one)",
    "anthropic": "only sglang/lang/backend/anthropic.py (the frontend language's client of Anthropic's API)",
    "outlines": "only srt/constrained/outlines_*.py (--grammar-backend outlines; xgrammar is the default)",
}
# Imported as a text server starts, yet named by sglang 0.5.17's requirements only through what NEVER_IMPORTED leaves
# out (found on the H200: the first launch from the bundle stopped at each).
UNDECLARED_IMPORTS = {
    "dill": "srt/sampling/custom_logit_processor.py, imported at start through configs/deepseek_ocr.py; named only "
            "by datasets",
    "jsonschema": "srt/entrypoints/openai/serving_chat.py, imported by http_server.py; named only by mistral-common "
                  "and outlines",
}


def schema_version(installed: str | None) -> str:
    """The captured schema for an installed SGLang version: its own, else the newest one not newer (flags added
    later are not offered to it), else the oldest; the data's pin where none is installed."""
    if installed is None:
        return SCHEMA_VERSIONS[-1]
    older = [v for v in SCHEMA_VERSIONS if Version(v) <= Version(installed)]
    return older[-1] if older else SCHEMA_VERSIONS[0]


def prefill_graph_sizes(max_tokens: int) -> list[int]:
    """Token counts SGLang captures prefill graphs for (cuda_graph_hook.generate_prefill_cuda_graph_batch_sizes)."""
    sizes = [*range(4, 33, 4), *range(48, 257, 16), *range(288, 513, 32), *range(576, 1025, 64),
             *range(1280, 4097, 256), *range(4608, max_tokens + 1, 512)]
    return [s for s in sizes if s <= max_tokens]


def _dp_attention(c: dict) -> bool:
    return bool(c.get("enable_dp_attention")) or (c.get("attn_dp_size") or 1) > 1


def spec_decode_graph_sizes(max_bs: int) -> list[int]:
    """Decode CUDA-graph batch sizes SGLang captures under speculation when the config lists none (0.5.23
    arg_groups/cuda_graph_hook.py, generate_decode_cuda_graph_batch_sizes; 0.5.17 server_args.py, the same list)."""
    sizes = [*range(1, 9), *range(10, 33, 2), *range(40, 65, 4), *range(72, 257, 8), *range(272, max_bs + 1, 16)]
    return sorted({s for s in sizes if s <= max_bs} | {max_bs})


class SGLangAdapter(ServesHFDirectories, EngineAdapter):
    name = "sglang"
    python = sys.executable
    entry = (python, "-m", "sglang.launch_server")
    facts = EngineFacts(
        default_port=30000,
        image="lmsysorg/sglang:v{version}",
        image_command=("python3", "-m", "sglang.launch_server"),
        config_file_use="python -m sglang.launch_server --config best/config.yaml --host 127.0.0.1 --port 30000",
        numerics=("dtype", "quantization", "kv_cache_dtype", "enable_torch_compile"),
        speculation_off={"speculative_algorithm": None},
        draft_keys=("speculative_algorithm", "speculative_num_draft_tokens"),
        spec_gauges=("sglang:spec_accept_length", "sglang:spec_accept_rate"),
        needs_draft_model={"speculative_algorithm": NEEDS_DRAFT_MODEL},
        tp_key="tp_size",
        modelled=("tp_size", "quantization", "kv_cache_dtype", "speculative_algorithm", "speculative_num_steps",
                  "speculative_eagle_topk", "speculative_num_draft_tokens", "mem_fraction_static"),
        drafter_families={"EAGLE": "eagle", "EAGLE3": "eagle3", "NEXTN": "mtp", "STANDALONE": "draft", "NGRAM": "lookup",
                          "DFLASH": "dflash"},
        # mem_fraction_static x total memory holds the weights and the KV pool; the rest is left for
        # activations, CUDA graphs and the CUDA context (model_runner.py, profile_max_num_token).
        memory_pool="static_fraction",
        graph_max_bs_default=256,
        # A speculative step's host time beyond its passes: 0.5 ms (the speed model's prior) plus the median, 2.40 ms,
        # of what 11 public SGLang EAGLE-3 runs at batch 1 measured beyond the predicted step at their published
        # accept length (-2.3 to +5.8 ms; their plain steps within 0.4 ms): sgl-project/sglang issue #11948
        # (A800 x2, Qwen3-8B), sgl-project/SpecForge issue #339 (H100 x2) and Tencent/AngelSlim issue #163 (H100 x4,
        # both Qwen3-30B-A3B); benchmarks/results/predict-published-2026-12-05 has the table.
        spec_step_host_s=2.9e-3,
        bundle_never_imported=NEVER_IMPORTED,
        bundle_undeclared=UNDECLARED_IMPORTS,
    )

    @functools.cached_property
    def found_version(self) -> str | None:
        """The SGLang version the entry's Python has (None: none)."""
        return self.installed_version()

    @property
    def version(self) -> str:
        return schema_version(self.found_version)

    def health_url(self, base_url):
        return base_url.rstrip("/") + "/health_generate"

    def command(self, config, *, model, draft_model, host, port, extra_args=()):
        config, model = dict(config), self.model_or_default(model)
        # a local checkpoint needs no hub: offline (the H200), a hub look-up fails or waits (sglang 0.5.17 also asks
        # the hub for its FA3 kernels, kernels/ops/attention/flash_attention_v3.py, and falls back to sgl-kernel's)
        env = {"HF_HUB_OFFLINE": "1"} if model and Path(model).is_dir() else {}
        if config.get("quantization") == "w8a16_fp8":
            config["quantization"], env["SGLANG_FORCE_FP8_MARLIN"] = "fp8", "1"
        # awq_marlin / gptq_marlin stay as given: the flag SGLang itself resolves an AWQ/GPTQ checkpoint to where
        # Marlin runs (layers/quantization/awq.py, AWQMarlinConfig.override_quantization_method: awq_marlin for
        # user_quant None, "marlin" or "awq_marlin", applied by configs/model_config.py _verify_quantization;
        # GPTQMarlinConfig likewise), so the launch line says what it runs
        if draft_model and config.get("speculative_algorithm") in NEEDS_DRAFT_MODEL:
            config.setdefault("speculative_draft_model_path", draft_model)
        elif model and config.get("speculative_algorithm") == "NEXTN":  # never the --draft-model (an EAGLE head ...)
            # the draft worker loads the MTP layers from --speculative-draft-model-path, which SGLang fills
            # in by itself only for the DeepSeek-style architectures it lists (speculative_hook.py,
            # _handle_eagle_family; tp_worker._init_model_config): the target's own checkpoint
            config.setdefault("speculative_draft_model_path", model)
        args = config_args(config, load_schema(self.name, self.version))
        head = (["--model-path", model] if model else []) + ["--host", host, "--port", str(port), "--enable-metrics"]
        return [*self.entry, *head, *args, *extra_args], env

    def schedule_args(self, config, schedule, *, directory="."):
        """EAGLE / EAGLE3 / NEXTN at topk 1: --speculative-adaptive with one tier per schedule row, each of one
        candidate (its length), so the tiers follow the batch size and never the acceptance EMA; what SGLang's
        CUDA-graph padding moves is said. Any other drafter (or setting that turns adaptive off): one fixed length,
        the schedule's at the server's most running requests."""
        algo = self._drafting(config)
        top = int(config.get("max_running_requests") or SPEC_MAX_RUNNING)
        off = [key for key in ADAPTIVE_OFF_WITH if config.get(key)] + (["attn_dp_size"] if _dp_attention(config) else [])
        topk = int(config.get("speculative_eagle_topk") or 1)
        if algo in ADAPTIVE_ALGORITHMS and topk == 1 and not off and schedule.max_draft_length:
            path = str(Path(directory) / ADAPTIVE_FILE)
            starts = [1, *(row.max_batch + 1 for row in schedule.rows[:-1])]
            tiers = {str(start): {"candidate_steps": [row.draft_length]} for start, row in zip(starts, schedule.rows)}
            k = schedule.max_draft_length
            update = {"speculative_adaptive": True, "speculative_adaptive_config": path, "speculative_num_steps": k,
                      "speculative_eagle_topk": 1, "speculative_num_draft_tokens": k + 1}
            moved = self._padded(config, schedule, top)
            lost = (f"SGLang pads a decode batch up to its next CUDA-graph size before it picks a tier, so {moved}.",)
            return ScheduleRendering(config=update, files={path: json.dumps(tiers, indent=1) + "\n"},
                                     cannot_express=lost if moved else ())
        length = schedule.length_for(top)
        departs = schedule_departures(schedule, length, top)
        why = (f"SGLang turns --speculative-adaptive off beside {', '.join(off)}" if off else
               f"SGLang's --speculative-adaptive runs only EAGLE / EAGLE3 at topk 1, not {algo}"
               + (f" at topk {topk}" if topk != 1 else ""))
        fixed = (f"{why}: one length runs at every batch size, {length} (0: no speculation), the schedule's at {top} "
                 f"running requests (max_running_requests), where the schedule asks {departs}.")
        lost = (fixed,) if departs else ()
        if not length:
            return ScheduleRendering(config=dict(self.facts.speculation_off), cannot_express=lost)
        return ScheduleRendering(config=self._length_settings(config, length), cannot_express=lost)

    def draft_length(self, config):
        """NGRAM and DFLASH draft all but one of the tokens they verify; the EAGLE family drafts a token per step
        (its tree's width is topk, not the length)."""
        algo = config.get("speculative_algorithm")
        if algo in (None, "none"):
            return 0
        if algo in ("NGRAM", "DFLASH"):
            block = NGRAM_DEFAULT_DRAFT_TOKENS if algo == "NGRAM" else DFLASH_DEFAULT_BLOCK
            return int(config.get("speculative_num_draft_tokens") or block) - 1
        return int(config.get("speculative_num_steps") or 0)

    def with_draft_length(self, config, k):
        return {**config, **self._length_settings(config, k)}

    @staticmethod
    def _length_settings(config: dict, length: int) -> dict:
        """The settings that make `config`'s drafter draft `length` tokens per step."""
        if config.get("speculative_algorithm") in ("NGRAM", "DFLASH"):  # a verify of the drafted tokens and the next
            return {"speculative_num_draft_tokens": length + 1}
        topk = int(config.get("speculative_eagle_topk") or 1)
        tree = 1 + topk + (length - 1) * topk * topk  # check(): the most tokens a tree of these steps offers
        tokens = length + 1 if topk == 1 else min(int(config.get("speculative_num_draft_tokens") or tree), tree)
        return {"speculative_num_steps": length, "speculative_eagle_topk": topk, "speculative_num_draft_tokens": tokens}

    @staticmethod
    def _padded(config: dict, schedule, top: int) -> str:
        """The batches up to `top` whose CUDA-graph padding lands in another row's tier ("" where none): with
        graphs off or unpadded none; else the config's decode sizes, or SGLang's own up to its graph maximum
        (assumed `top` where the config sets none: the most padding)."""
        if config.get("disable_cuda_graph") or config.get("disable_cuda_graph_padding"):
            return ""
        sizes = sorted(config.get("cuda_graph_bs_decode") or
                       spec_decode_graph_sizes(int(config.get("cuda_graph_max_bs_decode") or top)))
        moved = []
        for batch in range(1, top + 1):
            padded = next((s for s in sizes if s >= batch), batch)
            if schedule.length_for(padded) != schedule.length_for(batch):
                moved.append(f"batch {batch} runs {schedule.length_for(padded)} (batch {padded}'s), not "
                             f"{schedule.length_for(batch)}")
        return "; ".join(moved)

    def check(self, config, hardware=None, *, has_draft_model=None):
        c = {k: v for k, v in config.items() if v is not None}
        algo = c.get("speculative_algorithm", "none")
        out = []
        if algo != "none" and algo not in ALGORITHMS:
            out.append(f"speculative_algorithm {algo!r} is not one of {', '.join(ALGORITHMS)}")
        given = [k for k in SPEC_SHAPE if k in c]
        if algo in EAGLE_FAMILY and given and len(given) < 3:
            out.append("speculative_num_steps, speculative_eagle_topk and speculative_num_draft_tokens must be "
                       f"set all together or not at all (got only {', '.join(given)})")
        if algo in EAGLE_FAMILY and len(given) == 3:
            steps, topk, tokens = (c[k] for k in SPEC_SHAPE)
            # The tree offers topk candidates at the first step and topk*topk at each later one, and
            # verification picks tokens-1 of them (eagle_utils.organize_draft_results: torch.topk).
            # topk 1 is not refused: SGLang silently runs steps+1 tokens (see effective()).
            candidates = topk + (steps - 1) * topk * topk
            if topk > 1 and tokens - 1 > candidates:
                out.append(f"speculative_num_draft_tokens {tokens} exceeds the draft tree: at most "
                           f"1 + topk + (steps-1)*topk^2 = {candidates + 1} for steps {steps}, topk {topk}")
            if topk > 1 and c.get("attention_backend") == "trtllm_mha":
                out.append("attention_backend trtllm_mha supports only speculative_eagle_topk 1")
            if topk > 1 and (c.get("page_size") or 1) > 1 and c.get("attention_backend", "flashinfer") not in (
                    TREE_ATTENTION_BACKENDS):
                out.append(f"speculative_eagle_topk > 1 with page_size > 1 needs attention_backend "
                           f"{' / '.join(TREE_ATTENTION_BACKENDS)}")
        breadth = c.get("speculative_ngram_max_bfs_breadth", NGRAM_DEFAULT_BFS_BREADTH)
        if algo == "NGRAM" and breadth > 1 and (c.get("page_size") or 1) > 1 and c.get("attention_backend") != "flashinfer":
            out.append(f"NGRAM (a tree of {breadth} branches) with page_size {c['page_size']} > 1 needs "
                       f"attention_backend flashinfer (got {c.get('attention_backend') or 'unset: fa3 on Hopper'})")
        if algo in ("NGRAM", "STANDALONE") and _dp_attention(c):
            out.append(f"{algo} speculative decoding does not support dp attention")
        if algo in NEEDS_DRAFT_MODEL and has_draft_model is False:
            out.append(f"{algo} needs a draft model (--draft-model); only NEXTN uses the target's own MTP layers")
        if not (0 < c.get("mem_fraction_static", 0.5) < 1):
            out.append(f"mem_fraction_static must be between 0 and 1, got {c['mem_fraction_static']}")
        chunk = c.get("chunked_prefill_size")
        if chunk is not None and chunk != -1 and chunk < 1:
            out.append(f"chunked_prefill_size must be positive or -1 (off), got {chunk}")
        return out

    def draft_problem(self, config, draft):
        algo = config.get("speculative_algorithm")
        if algo not in DRAFT_ARCHITECTURES:
            return None
        kind, named = DRAFT_ARCHITECTURES[algo]
        if draft.kind != kind:
            return f"{algo} runs a{'n' if kind[0] in 'ae' else ''} {kind} draft checkpoint; --draft-model is {draft.kind}"
        if draft.architectures and not any(named(a) for a in draft.architectures):
            return (f"{algo}: SGLang loads the draft's own architecture, and {', '.join(draft.architectures)} is not "
                    f"one it runs as {algo} (an SGLang-named head is)")
        return None

    def effective(self, config):
        """What SGLang would run: its silent rewrites applied, defaults and inert flags dropped."""
        c = self.explicit(config)
        algo = c.get("speculative_algorithm")
        if algo is None:
            c = {k: v for k, v in c.items() if not k.startswith("speculative_")}
        elif algo in EAGLE_FAMILY:
            c["speculative_algorithm"] = "EAGLE" if algo == "NEXTN" else algo
            if c.get("speculative_eagle_topk") == 1 and "speculative_num_steps" in c:
                c["speculative_num_draft_tokens"] = c["speculative_num_steps"] + 1
        elif algo == "DFLASH":  # a block of draft tokens, always one step of topk 1
            c.update(speculative_num_steps=1, speculative_eagle_topk=1)
        elif algo == "NGRAM":  # steps and topk derive from the BFS breadth and the token count
            c.setdefault("speculative_num_draft_tokens", NGRAM_DEFAULT_DRAFT_TOKENS)
            c.pop("speculative_num_steps", None)
            c.pop("speculative_eagle_topk", None)
        if not c.get("enable_torch_compile"):
            c.pop("torch_compile_max_bs", None)
        for key in ("cuda_graph_bs_decode", "cuda_graph_bs_prefill"):
            if key in c:
                c[key] = sorted(set(c[key]))
        return c

    @staticmethod
    def memory_band(gpu_mib: float, tp: int) -> tuple[int, int]:
        """(chunked_prefill_size, decode CUDA-graph max batch) SGLang picks for a GPU of gpu_mib MiB."""
        for top, chunk, small_tp, large_tp in MEMORY_BANDS:
            if gpu_mib < top:
                return chunk, small_tp if tp < 4 else large_tp
        raise AssertionError("the last band is unbounded")

    def default_batch_tokens(self, gpu_mib, tp):
        return self.memory_band(gpu_mib, tp)[0]

    def default_memory_fraction(self, tp, gpu_mib=None, config=None):
        """mem_fraction_static when unset, as SGLang 0.5.23 resolves it (memory_hook.py,
        handle_gpu_memory_settings): (gpu_mem - reserved) / gpu_mem in MiB, reserved = 512 + 1.5 x
        max(chunked_prefill_size, 2048) + tp/8 x 1024 + the graph reserve (reserve_for_graph_mb: 2 per
        decode batch size up to the max, 8 per prefill-graph token size: breakable prefill graphs are on
        by default on CUDA), at least 10 GiB on a GPU above 60 GiB; rounded to 3 decimals."""
        if not gpu_mib:
            return 0.88  # no GPU size: SGLang's value for a 1-GPU H100
        c = settings(config or {})
        band_chunk, band_bs = self.memory_band(gpu_mib, tp)
        chunk = c.get("chunked_prefill_size") or band_chunk
        decode_bs = max(c["cuda_graph_bs_decode"]) if c.get("cuda_graph_bs_decode") else (
            c.get("cuda_graph_max_bs_decode") or band_bs)
        if c.get("max_running_requests"):
            decode_bs = min(decode_bs, c["max_running_requests"])
        prefill_sizes = prefill_graph_sizes(min(8192, chunk) if chunk > 0 else 8192)
        reserved = 512 + max(chunk, 2048) * 1.5 + tp / 8 * 1024 + decode_bs * 2 + len(prefill_sizes) * 8
        if gpu_mib > 60 * 1024:
            reserved = max(reserved, 10 * 1024)
        return round((gpu_mib - reserved) / gpu_mib, 3)

    def knobs(self, config: dict, on_gpu: bool = True) -> Knobs:
        c = settings(config)
        drafter = self.facts.drafter_families.get(c.get("speculative_algorithm"))
        steps, topk, verify = 0, 1, 1
        if drafter == "dflash":  # one parallel pass drafts a block; the target verifies the block
            steps, verify = 1, int(c.get("speculative_num_draft_tokens", DFLASH_DEFAULT_BLOCK))
        elif drafter:  # effective()'s rewrites: topk 1 runs steps+1 tokens; NGRAM's steps follow its tokens
            steps = int(c.get("speculative_num_steps", 3))
            topk = int(c.get("speculative_eagle_topk", 1))
            default_tokens = NGRAM_DEFAULT_DRAFT_TOKENS if drafter == "lookup" else steps + 1
            tokens = c.get("speculative_num_draft_tokens", default_tokens)
            verify = steps + 1 if topk == 1 and drafter != "lookup" else int(tokens)
            if drafter == "lookup":
                steps = verify - 1
        sizes = c.get("cuda_graph_bs_decode")
        graph_max = max(sizes) if sizes else c.get("cuda_graph_max_bs_decode")
        # CUDA graphs are on unless --disable-cuda-graph, which the space does not offer
        return make_knobs(self.name, c, on_gpu, tp=self.tp_size(c), drafter=drafter, draft_steps=steps, topk=topk,
                          verify_tokens=verify, cuda_graphs=True, graph_max_bs=graph_max or self.facts.graph_max_bs_default,
                          mem_fraction=c.get("mem_fraction_static"),
                          max_running=c.get("max_running_requests", SPEC_MAX_RUNNING if drafter else None),
                          max_batch_tokens=c.get("chunked_prefill_size"), block_size=c.get("page_size"),
                          # --ep-size (alias --expert-parallel-size): the MoE layers' expert-parallel group
                          # (schemas/sglang-0.5.23.json; default 1)
                          ep=int(c.get("ep_size", 1)))
