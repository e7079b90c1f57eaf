"""Memory per engine, quantized checkpoints named per row, and profiles per interconnect (issue 31, points 4-5).

Pure Python: the engines' own numbers these are checked against live are asserted where the live tests already
launch them (tests/engines/test_llamacpp.py, tests/engines/test_vllm.py)."""
import dataclasses
import json
import shlex

import pytest

from autotune.engines import get_adapter
from autotune.hardware import get_profile
from autotune.predict import load_model, predict_memory, predict_speed
from autotune.predict.checkpoints import checkpoint_for
from autotune.predict.memory import draft_bytes
from autotune.predict.report import estimate_report

SGLANG, VLLM, LLAMACPP = get_adapter("sglang"), get_adapter("vllm"), get_adapter("llamacpp")


def estimate(engine) -> dict:
    return json.loads(estimate_report(model="qwen3-8b", gpu="rtx-3090", num_gpus=1, engine=engine, draft_model=None,
                                      alpha=None, concurrency=1, context_len=None, top=30, as_json=True))


def test_quantized_rows_name_their_checkpoint_and_flag():
    for engine in (SGLANG, VLLM):
        rows = estimate(engine=engine)["configs"]
        by_format = {}
        for row in rows:
            by_format.setdefault(str(row["config"].get("quantization")), row)
        awq, gptq = by_format["awq_marlin"], by_format["gptq_marlin"]
        # Qwen publishes an AWQ checkpoint of Qwen3-8B, no GPTQ one: that row's checkpoint is the user's
        assert "--model-path Qwen/Qwen3-8B-AWQ" in awq["launch"] or "--model Qwen/Qwen3-8B-AWQ" in awq["launch"]
        assert "--quantization awq_marlin" in awq["launch"] and not awq["user_supplies_checkpoint"]
        assert "qwen3-8b-GPTQ" in gptq["launch"] and "--quantization gptq_marlin" in gptq["launch"]
        assert gptq["user_supplies_checkpoint"] and gptq["checkpoint"] == "a GPTQ checkpoint of qwen3-8b you supply"
        for row in rows:  # 16-bit and FP8 (quantized at load time) rows load the 16-bit repository
            if row["config"].get("quantization") in (None, "none", "fp8", "w8a16_fp8"):
                assert "Qwen/Qwen3-8B " in row["launch"] and row["checkpoint"] is None
    table = estimate_report(model="qwen3-8b", gpu="rtx-3090", num_gpus=1, engine=VLLM, draft_model=None, alpha=None,
                            concurrency=1, context_len=None, top=30, as_json=False)
    assert "you supply" in table and "load a GPTQ checkpoint of qwen3-8b you supply" in table
    assert "load AWQ checkpoint Qwen/Qwen3-8B-AWQ (https://huggingface.co/Qwen/Qwen3-8B-AWQ)" in table


def test_gguf_rows_of_a_preset_name_the_published_file():
    k = LLAMACPP.knobs({"gguf_type": "Q4_K_M"}, on_gpu=True)
    need = checkpoint_for("qwen3-8b", k, "qwen3-8b")
    assert need.describe() == ("a Q4_K_M GGUF file of qwen3-8b (GGUF files of it: Qwen/Qwen3-8B-GGUF "
                               "(https://huggingface.co/Qwen/Qwen3-8B-GGUF))")
    assert need.load_as is None  # llama.cpp's adapter names the file itself: qwen3-8b-Q4_K_M.gguf
    unknown = checkpoint_for("qwen3.5-27b", k, "qwen3.5-27b")
    assert unknown.user_supplied and unknown.describe() == "a Q4_K_M GGUF file of qwen3.5-27b (you supply)"
    # the bundled model (a Q4_1 file here) serves its own type; a row of another type needs a file of that type
    bundled = LLAMACPP.default_model()
    assert checkpoint_for("smollm2-135m", LLAMACPP.knobs({"gguf_type": "Q4_1"}, on_gpu=True), bundled) is None
    assert checkpoint_for("smollm2-135m", k, bundled).describe() == "a Q4_K_M GGUF file of smollm2-135m (you supply)"


def test_estimate_names_a_gguf_file_of_each_rows_own_type_never_the_bundled_file_of_another():
    def ranked(gpu, top):
        return json.loads(estimate_report(model="smollm2-135m", gpu=gpu, num_gpus=1, engine=LLAMACPP, draft_model=None,
                                          alpha=None, concurrency=1, context_len=None, top=top, as_json=True))["configs"]

    rows = ranked("auto", 40)  # this machine: the bundled Q4_1 file is here
    by_type = {r["config"]["gguf_type"]: r for r in rows}
    assert {"Q4_1", "Q2_K"} <= set(by_type)
    assert by_type["Q4_1"]["checkpoint"] is None and f"--model {LLAMACPP.default_model()} " in by_type["Q4_1"]["launch"]
    assert by_type["Q2_K"]["user_supplies_checkpoint"] and "--model smollm2-135m-Q2_K.gguf " in by_type["Q2_K"]["launch"]
    # for another machine no path of this one: every row names the file it needs
    assert all(f"--model smollm2-135m-{r['config']['gguf_type']}.gguf " in r["launch"] for r in ranked("h200-sxm", 5))


def test_vllm_memory_utilization_default_per_version():
    # vllm/config/cache.py in both pinned versions: gpu_memory_utilization = Field(default=0.92, ...)
    # (the captured parsers, autotune/engines/schemas/vllm-0.32.0.json and vllm-0.33.0.json)
    assert VLLM.default_memory_fraction(1, 81559) == 0.92
    llama, h100 = load_model("llama-3.1-8b"), get_profile("h100-sxm5")
    unset = predict_memory(llama, {"tensor_parallel_size": 1}, h100, 1, engine=VLLM)
    pinned = predict_memory(llama, {"tensor_parallel_size": 1, "gpu_memory_utilization": 0.92}, h100, 1, engine=VLLM)
    assert unset.kv_tokens == pinned.kv_tokens and unset.budget_gb == pytest.approx(0.92 * 80 * 2**30 / 1e9)
    # max_num_batched_tokens by GPU memory (engine/arg_utils.py, get_batch_defaults): 2048 under 70 GiB
    assert [VLLM.default_batch_tokens(mib, 1) for mib in (24576, 81559, 196608)] == [2048, 8192, 16384]


def test_tp4_over_pcie_is_slower_than_over_an_nvlink_bridge():
    bridged, pcie = get_profile("rtx-a6000"), get_profile("rtx-a6000:pcie")
    assert bridged.interconnect["nvlink"]["via"] == "bridge" and pcie.interconnect["nvlink"] is None
    assert pcie.interconnect["pcie"] == bridged.interconnect["pcie"] and pcie.name == "rtx-a6000:pcie"
    qwen = load_model("qwen3-32b")
    for engine, config in ((VLLM, {"tensor_parallel_size": 4}), (SGLANG, {"tp_size": 4})):
        over = {p.name: predict_speed(qwen, config, p, 4, engine=engine).single_tok_s for p in (bridged, pcie)}
        assert over["rtx-a6000:pcie"] < 0.95 * over["rtx-a6000"], over
        one = {p.name: predict_speed(qwen, {**config, engine.facts.tp_key: 1}, p, 1, engine=engine).single_tok_s
               for p in (bridged, pcie)}
        assert one["rtx-a6000"] == one["rtx-a6000:pcie"]  # one GPU: no all-reduce, nothing differs
    with pytest.raises(ValueError, match="l40s has no nvlink"):
        get_profile("l40s:nvlink")
    with pytest.raises(ValueError, match="interconnect 'infiniband' is not one of nvlink, pcie"):
        get_profile("rtx-a6000:infiniband")


# What the engines reported on this machine for the bundled SmolLM2-135M (30 layers, 3 KV heads of 64; n_ctx_train
# 8192): llama-server build 11434's log at -lv 4 ("llama_kv_cache: size = 360.00 MiB (8192 cells, 30 layers, 2/2
# seqs), K (f16): 180.00 MiB, V (f16): 180.00 MiB"), and vLLM 0.32.0 CPU's ("CPU KV cache size: 23,296 tokens" with
# VLLM_CPU_KVCACHE_SPACE=1, benchmarks/results/cpu-2026-12-03b-engines/vllm-plain-float32-eager-kv-cache.txt).
# The live tests assert the same against the servers they launch (tests/engines/test_llamacpp.py, tests/engines/test_vllm.py).
LLAMA_SERVER_REPORTED = [  # config, KV cells, KV MiB
    ({"parallel": 2}, 16384, 360.00),  # no --ctx-size: each slot the training context
    ({"parallel": 3, "ctx_size": 5000}, 5376, 118.12),  # 5000 / 3 padded to 256 cells a slot
    ({"parallel": 1, "cache_type_k": "q8_0", "cache_type_v": "q4_0", "flash_attn": "on"}, 8192, 73.12),
    ({"ctx_size": 3000}, 3072, 67.50),  # slots auto: one unified cache
]


@pytest.mark.parametrize("config, cells, mib", LLAMA_SERVER_REPORTED)
def test_llama_server_kv_cache_as_the_server_allocates_it(config, cells, mib):
    m = predict_memory(load_model(None), config, get_profile("cpu"), engine=LLAMACPP)
    assert m.kv_tokens == cells
    assert m.detail["kv cache"] * 1e9 / 2**20 == pytest.approx(mib, abs=0.01)  # the log's two decimals


def test_vllm_cpu_pool_is_the_kv_cache_space_it_is_given():
    from autotune.engines.hf_model import bundled_hf_dir

    hf = load_model(str(bundled_hf_dir(VLLM.python)))
    cpu = get_profile("cpu")
    for dtype, tokens in (("float32", 23_296), ("bfloat16", 46_592)):  # 1 GiB / (30 x 2 x 192 x 4 or 2 B), 16s
        m = predict_memory(hf, {"dtype": dtype, "cpu_kvcache_space": 1, "enforce_eager": True}, cpu, engine=VLLM)
        assert m.kv_tokens == tokens and m.fits
    # a draft model's layers share the pool: half as many tokens
    both = predict_memory(hf, {"dtype": "float32", "cpu_kvcache_space": 1, "speculative_method": "draft_model",
                               "num_speculative_tokens": 3}, cpu, engine=VLLM, draft=hf)
    assert both.kv_tokens == 11_648
    # on a GPU the same setting is vLLM's kv_cache_memory_bytes, which replaces gpu_memory_utilization
    h100 = get_profile("h100-sxm5")
    llama = load_model("llama-3.1-8b")
    m = predict_memory(llama, {"tensor_parallel_size": 1, "kv_cache_memory_bytes": 8 * 2**30}, h100, 1, engine=VLLM)
    assert m.kv_tokens == 8 * 2**30 // (16 * 131_072) * 16


def test_embedded_slot_cache_is_the_engines_allocation():
    """The embedded engine, in process: its KV tensors' bytes are the memory model's slot cache."""
    from autotune.embedded.config import EngineConfig
    from autotune.embedded.scheduler import Engine

    config = {"drafter": "ngram", "draft_length": 4, "verify_slots": 2, "max_seq_len": 192, "threads": 1}
    engine = Engine(EngineConfig(**config))
    cache = engine.target.cache
    allocated = sum(t.numel() * t.element_size() for t in cache.k + cache.v)
    m = predict_memory(load_model(None), config, get_profile("cpu"), engine=get_adapter("embedded"))
    assert m.detail["kv cache"] * 1e9 == pytest.approx(allocated, rel=1e-9)
    assert m.kv_tokens == 2 * (192 + 17)  # max_seq_len + the longest draft + 1 a slot


def test_draft_weights_are_counted_for_dflash_and_a_moe_models_mtp_module():
    """A DFlash drafter holds its own layers (none were counted before); its checkpoint's layer count decides.
    A MoE model's MTP module is held whole, every expert (DeepSeek-V3 README_WEIGHTS.md: 11.5B parameters)."""
    qwen = load_model("qwen3-8b")
    k = SGLANG.knobs({"tp_size": 1, "speculative_algorithm": "DFLASH", "speculative_num_draft_tokens": 16})
    layer = qwen.layer_params * 2
    assumed, kv, said = draft_bytes(qwen, k, None)
    assert assumed == pytest.approx(5 * layer) and kv > 0 and "assumed" in said
    assert draft_bytes(qwen, k, dataclasses.replace(qwen, layers=3, name="dflash-head"))[0] == pytest.approx(3 * layer)
    ds = load_model("deepseek-v3")
    nextn = SGLANG.knobs({"tp_size": 8, "speculative_algorithm": "NEXTN", "speculative_num_steps": 1,
                          "speculative_eagle_topk": 1, "speculative_num_draft_tokens": 2})
    mtp_gb = draft_bytes(ds, nextn, None)[0] * 8 / 1e9
    assert mtp_gb == pytest.approx(ds.mtp_params * 2 / 1e9) and 11.0 * 2 < mtp_gb < 12.5 * 2


def test_gpu_launch_lines_whatever_build_this_machine_has():
    """Estimated for a GPU box from a machine with vLLM's CPU build (CI's): the lines are for the GPU's vLLM
    (its own python3, `serve`, no CPU-backend environment, no CPU-only knobs), and a CPU estimate keeps the build's."""
    for row in estimate(VLLM)["configs"]:
        argv = shlex.split(row["launch"])
        assert argv[:4] == ["python3", "-m", "vllm.entrypoints.cli.main", "serve"], row["launch"]
        assert not any(a.startswith("VLLM_CPU_") for a in argv) and "--threads" not in argv
    on_cpu = VLLM.for_target(False)
    assert on_cpu.cpu_build and on_cpu.entry[-1] == "vllm.entrypoints.openai.api_server"
    assert "VLLM_CPU_KVCACHE_SPACE" in on_cpu.environment({"cpu_kvcache_space": 4}, None)
