"""Spaces and predictions that follow the checkpoints (issue 19): the draft checkpoint's kind read from its
config, drafters offered only where the checkpoints can run them, 4-bit weights, the engines' own KV-pool
accounting computed by hand, kernel-bound speed priors, and `autotune estimate --set/--space`."""
import json
import math
import struct
import subprocess
import sys

import pytest

from autotune.engines import get_adapter
from autotune.hardware import get_profile, planned
from autotune.predict import draft_kind, load_model, predict_memory, predict_speed, rank_configs, read_draft
from autotune.space import load_space
from autotune.space.constraints import ModelShape, hardware_violations, restrict_space

GIB, MIB = 2**30, 2**20
SGLANG, VLLM, EMBEDDED = get_adapter("sglang"), get_adapter("vllm"), get_adapter("embedded")
H100, H200, RTX3090 = get_profile("h100-sxm5"), get_profile("h200-sxm"), get_profile("rtx-3090")

LLAMA_8B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 32, "hidden_size": 4096,
            "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256}


def checkpoint(path, config: dict, tensors: dict | None = None):
    """A checkpoint directory: config.json and, if given, a safetensors file whose header names `tensors`
    (name -> shape; bf16 zeros, as a real file of that layout)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    if tensors:
        header, offset = {}, 0
        for name, shape in tensors.items():
            size = 2 * math.prod(shape)
            header[name] = {"dtype": "BF16", "shape": shape, "data_offsets": [offset, offset + size]}
            offset += size
        raw = json.dumps(header).encode()
        (path / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(offset))
    return path


def test_draft_kind_from_the_checkpoint(tmp_path):
    head = {"num_hidden_layers": 1, "hidden_size": 64, "num_attention_heads": 2, "intermediate_size": 128,
            "vocab_size": 100}
    # names as the engines read them: SGLang's LlamaForCausalLMEagle(3), vLLM's Eagle3 prefix, DFlash heads
    assert draft_kind(checkpoint(tmp_path / "e1", {**head, "architectures": ["LlamaForCausalLMEagle"]})) == "eagle"
    assert draft_kind(checkpoint(tmp_path / "e3", {**head, "architectures": ["LlamaForCausalLMEagle3"]})) == "eagle3"
    assert draft_kind(checkpoint(tmp_path / "df", {**head, "architectures": ["DFlashDraftModel"], "block_size": 16})) == "dflash"
    # the original EAGLE releases call themselves LlamaForCausalLM: the fc layer's input width tells
    # EAGLE-1 (2 x hidden: token embedding + feature) from EAGLE-3 (3 x hidden: three feature layers)
    plain = {**head, "architectures": ["LlamaForCausalLM"]}
    assert draft_kind(checkpoint(tmp_path / "y1", plain, {"fc.weight": [64, 128]})) == "eagle"
    assert draft_kind(checkpoint(tmp_path / "y3", plain, {"fc.weight": [64, 192]})) == "eagle3"
    assert draft_kind(checkpoint(tmp_path / "small", plain, {"model.embed_tokens.weight": [100, 64]})) == "standalone"
    assert draft_kind("yuhuili/EAGLE3-LLaMA3.1-Instruct-8B") is None  # a hub id: nothing on disk to read


def test_hybrid_and_mtp_target_config(tmp_path):
    # Qwen3.5-27B's text_config (https://huggingface.co/Qwen/Qwen3.5-27B/blob/main/config.json)
    text = {"num_hidden_layers": 64, "hidden_size": 5120, "num_attention_heads": 24, "num_key_value_heads": 4,
            "head_dim": 256, "intermediate_size": 17408, "vocab_size": 248320, "full_attention_interval": 4,
            "linear_num_key_heads": 16, "linear_num_value_heads": 48, "linear_key_head_dim": 128,
            "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "mamba_ssm_dtype": "float32",
            "mtp_num_hidden_layers": 1}
    m = load_model(checkpoint(tmp_path / "q", {"architectures": ["Qwen3_5ForConditionalGeneration"], "text_config": text}))
    assert (m.cache_layers, m.linear_layers, m.mtp_layers) == (16, 48, 1)
    # per Gated DeltaNet layer: state 48 x 128 x 128 fp32 = 3,145,728 B + conv window 3 x (2*16*128 + 48*128)
    # x 2 B = 61,440 B (sglang/srt/configs/mamba_utils.py: mamba_cache_per_req); x 48 layers
    assert m.state_bytes_per_sequence(1) == 48 * (3_145_728 + 61_440)
    assert m.state_bytes_per_sequence(2) == 48 * (3_145_728 // 2 + 61_440 // 2)  # heads shard over TP
    preset = load_model("qwen3.5-27b")
    assert preset.state_bytes_per_sequence(1) == m.state_bytes_per_sequence(1) and preset.mtp_layers == 1


def test_drafters_offered_per_checkpoint(tmp_path):
    h100 = planned(H100)
    eagle3 = checkpoint(tmp_path / "e3", {**LLAMA_8B, "num_hidden_layers": 1, "architectures": ["LlamaForCausalLMEagle3"]})
    llama = ModelShape.of(load_model("llama-3.1-8b"), read_draft(str(eagle3)))
    vllm = restrict_space(load_space("vllm"), h100, llama, str(eagle3), adapter=VLLM)
    # with an EAGLE-3 head: eagle3 (and the draft-free ngram); never eagle, dflash, draft_model, nor mtp
    assert vllm.params["speculative_method"].choices == ["none", "ngram", "eagle3"]
    sglang = restrict_space(load_space("sglang"), h100, llama, str(eagle3), adapter=SGLANG)
    assert sglang.params["speculative_algorithm"].choices == ["none", "EAGLE3", "NGRAM"]
    # without a draft model: only what needs none; MTP only for a target with MTP layers
    no_draft = restrict_space(load_space("vllm"), h100, ModelShape.of(load_model("llama-3.1-8b")), None, adapter=VLLM)
    assert no_draft.params["speculative_method"].choices == ["none", "ngram"]
    qwen35 = ModelShape.of(load_model("qwen3.5-27b"))
    assert "mtp" in restrict_space(load_space("vllm"), h100, qwen35, None, adapter=VLLM).params["speculative_method"].choices
    assert "NEXTN" in restrict_space(load_space("sglang"), h100, qwen35, None, adapter=SGLANG).params["speculative_algorithm"].choices
    # SGLang's draft worker loads the MTP layers from --speculative-draft-model-path: the target itself
    argv, _ = SGLANG.command({"speculative_algorithm": "NEXTN"}, model="/m/qwen", draft_model=None, host="127.0.0.1", port=1)
    assert argv[argv.index("--speculative-draft-model-path") + 1] == "/m/qwen"
    # a pinned mismatch is not dropped from the space: the trial is refused with its reason
    assert any("runs an eagle draft checkpoint; --draft-model is eagle3" in v for v in hardware_violations(
        {"speculative_method": "eagle", "num_speculative_tokens": 3}, h100, llama, adapter=VLLM))
    assert any("no" in v and "MTP" in v for v in hardware_violations(
        {"speculative_method": "mtp"}, h100, ModelShape.of(load_model("llama-3.1-8b")), adapter=VLLM))


def test_four_bit_weights_follow_the_checkpoint(tmp_path):
    h100 = planned(H100)
    awq = load_model(checkpoint(tmp_path / "awq", {**LLAMA_8B, "quantization_config": {"quant_method": "awq", "bits": 4,
                                                                                     "group_size": 128}}))
    bf16 = load_model(checkpoint(tmp_path / "bf16", LLAMA_8B))
    quant = lambda m: restrict_space(load_space("vllm"), h100, ModelShape.of(m), None, adapter=VLLM).params["quantization"].choices
    assert quant(awq) == ["none", "awq_marlin"]  # no re-quantizing 4-bit weights to FP8, no GPTQ kernels for AWQ
    assert quant(bf16) == ["none", "fp8", "w8a16_fp8"]  # AWQ/GPTQ need a checkpoint in that format
    assert "awq_marlin" in quant(load_model("llama-3.1-8b"))  # a preset stands for its published AWQ variants
    # bytes: 0.5 per weight + per group of 128 an fp16 scale and a packed 4-bit zero = 0.5 + 2.5/128;
    # the embedding and head stay 16-bit (2 x 128256 x 4096 x 2 B)
    linear = 8_030_261_248 - 2 * 128256 * 4096
    m = predict_memory(awq, {"tensor_parallel_size": 1}, H100, 1, engine=VLLM)  # unset: read as the checkpoint's AWQ
    assert m.weights_gb * 1e9 == pytest.approx(linear * (0.5 + 2.5 / 128) + 2 * 128256 * 4096 * 2, rel=1e-6)
    # both engines resolve an AWQ checkpoint to awq_marlin where Marlin runs: the launch line says so
    for engine in (SGLANG, VLLM):
        argv, _ = engine.command({engine.facts.tp_key: 1, "quantization": "awq_marlin"}, model=str(tmp_path / "awq"),
                                 draft_model=None, host="127.0.0.1", port=1)
        assert argv[argv.index("--quantization") + 1] == "awq_marlin"


def test_27b_fits_one_24gb_card_in_4_bit():
    for engine in (SGLANG, VLLM):
        ranked = rank_configs(load_space(engine.name), load_model("gemma-2-27b"), RTX3090, 1, top=5, engine=engine)
        assert ranked, engine.name
        assert all(c["quantization"] in ("awq_marlin", "gptq_marlin") for c, _ in ranked)
        assert all(p.memory.fits and p.memory.kv_tokens >= 4096 for _, p in ranked)


def test_sglang_kv_pool_by_hand():
    llama = load_model("llama-3.1-8b")
    # mem_fraction_static unset on an 80 GiB H100 (sglang 0.5.23 arg_groups/memory_hook.py,
    # handle_gpu_memory_settings): chunked_prefill_size 8192 and decode max_bs 256 for a GPU under 90 GiB;
    # reserved = 512 + 1.5 x 8192 + tp/8 x 1024 + 2 x 256 (reserve_for_graph_mb, decode) + 8 x 58
    # prefill-graph sizes up to 8192 (cuda_graph_hook.generate_prefill_cuda_graph_batch_sizes) = 13,904 MiB
    assert SGLANG.default_memory_fraction(1, 81920, {}) == round((81920 - 13904) / 81920, 3) == 0.83
    m = predict_memory(llama, {"tp_size": 1}, H100, 1, engine=SGLANG)
    # pool = free memory before the load (80 GiB - the 0.5 GB CUDA context) x 0.83 - weights
    # (mem_cache/kv_cache_configurator.py, _profile_available_bytes); 131,072 B per token (32 layers x
    # 8 KV heads x 128 x 2 x bf16)
    assert m.kv_tokens == int((0.83 * (80 * GIB - 0.5e9) - 16.06e9) // 131_072)
    # a hybrid model: the state pool takes 0.9/1.9 of the rest first (_handle_max_mamba_cache, ratio
    # mamba_full_memory_ratio = 0.9), one padding slot; the KV pool gets what is left
    qwen = load_model("qwen3.5-27b")
    h = predict_memory(qwen, {"tp_size": 1, "mem_fraction_static": 0.9}, H200, 1, engine=SGLANG)
    rest = 0.9 * (141 * GIB - 0.5e9) - 55.56e9
    per_req = 48 * (3_145_728 + 61_440)
    slots = int((rest * 0.9 / 1.9 - per_req) // per_req)
    assert h.state_sequences == slots
    assert h.kv_tokens == int((rest - (slots + 1) * per_req) // (2 * 16 * 4 * 256 * 2))
    assert h.max_sequences(4096) == min(h.kv_tokens // 4096, slots)


def test_vllm_kv_pool_by_hand():
    qwen = load_model("qwen3.5-27b")
    m = predict_memory(qwen, {"tensor_parallel_size": 1}, H200, 1, engine=VLLM)
    # gpu_memory_utilization 0.92 (its default in 0.32/0.33) of the total, less weights and the profiled
    # workspace (v1/worker/gpu_worker.py, determine_available_memory)
    pool = 0.92 * 141 * GIB - 55.56e9 - m.workspace_gb * 1e9
    # attention blocks grow to 16 x ceil(state page / (16 x 4096 B per token and layer)) = 784 tokens
    # (platforms/interface.py, update_block_size_for_backend); layers in groups of gcd(16, 48) = 16:
    # a 4096-token sequence takes ceil(4096/784) = 6 attention blocks + 3 state blocks of 784 x 4096 x 16 B
    page = 784 * 4096 * 16
    sequences = int(pool // page) // (6 + 3)
    assert m.state_sequences == sequences and m.kv_tokens == sequences * 4096
    plain = predict_memory(load_model("llama-3.1-8b"), {"tensor_parallel_size": 1, "block_size": 32}, H100, 1, engine=VLLM)
    assert plain.kv_tokens % 32 == 0  # whole blocks of --block-size


def test_small_model_is_kernel_bound_and_int8_stops_paying():
    smol, llama = load_model("smollm2-135m"), load_model("llama-3.1-8b")
    graphs = {"dtype": "bfloat16", "cuda_graph_batch_sizes": [1, 2, 4], "compile": "inductor"}
    bf16 = predict_speed(smol, graphs, H200, 1, engine=EMBEDDED, context_len=512)
    int8 = predict_speed(smol, {**graphs, "quantization": "int8"}, H200, 1, engine=EMBEDDED, context_len=512)
    # 135M reads 0.27 GB a token (0.06 ms at 4.8 TB/s) but launches ~364 kernels: their floor decides,
    # so int8's halved bytes buy nothing; without inductor its casts are kernels of their own and cost
    assert bf16.bound == "kernels" and int8.single_tok_s <= bf16.single_tok_s
    eager_graphs = {"dtype": "bfloat16", "cuda_graph_batch_sizes": [1, 2, 4]}
    assert predict_speed(smol, {**eager_graphs, "quantization": "int8"}, H200, 1, engine=EMBEDDED).single_tok_s < \
        predict_speed(smol, eager_graphs, H200, 1, engine=EMBEDDED).single_tok_s < bf16.single_tok_s
    # an 8B model stays byte-bound: FP8 weights still pay
    fp8 = predict_speed(llama, {"tensor_parallel_size": 1, "quantization": "fp8"}, H100, 1, engine=VLLM)
    plain = predict_speed(llama, {"tensor_parallel_size": 1}, H100, 1, engine=VLLM)
    assert plain.bound == "memory" and fp8.single_tok_s > 1.5 * plain.single_tok_s
    ranked = rank_configs(load_space("embedded"), smol, H200, 1, top=1000, engine=EMBEDDED)
    best = lambda int8: max(p.speed.single_tok_s for c, p in ranked if (c.get("quantization") == "int8") == int8)
    assert best(True) <= best(False)


def estimate(*args):
    cmd = [sys.executable, "-m", "autotune.cli", "estimate", *args]
    return subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=120)


def test_estimate_with_pins_and_a_space_file(tmp_path):
    out = estimate("--gpu", "rtx-a6000", "--num-gpus", "4", "--model", "qwen3-8b", "--draft-model", "z-lab/Qwen3-8B-DFlash-b16",
                   "--draft-kind", "dflash",
                   "--set", "quantization=w8a16_fp8", "--set", "tp_size=2", "--set", "speculative_algorithm=DFLASH",
                   "--set", "speculative_num_draft_tokens=8", "--json")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["pinned"] == {"tp_size": 2, "quantization": "w8a16_fp8", "speculative_algorithm": "DFLASH",
                                "speculative_num_draft_tokens": 8}
    assert report["configs"] and all(c["config"]["speculative_num_draft_tokens"] == 8 for c in report["configs"])
    # one parallel draft pass, 8 tokens verified: tokens per step from the block, not from EAGLE's steps
    assert all(1 < c["speed"]["tokens_per_step"] < 8 for c in report["configs"])
    assert "--speculative-algorithm DFLASH" in report["configs"][0]["launch"]
    # a pinned configuration the hardware refuses is shown with its reason, not dropped silently
    assert any("FP8 support" in r for row in report["refused"] for r in row["reasons"])
    narrowing = tmp_path / "narrow.yaml"
    narrowing.write_text("speculative_algorithm: [none, NGRAM]\ntp_size: 1\n")
    table = estimate("--gpu", "h100-sxm5", "--model", "llama-3.1-8b", "--space", str(narrowing), "--top", "3")
    assert table.returncode == 0, table.stderr
    assert "pinned: tp_size=1" in table.stdout and "EAGLE" not in table.stdout
    for bad in (["--set", "no_such_knob=1"], ["--set", "tp_size=3"], ["--set", "tp_size"], ["--space", str(tmp_path / "none.yaml")]):
        failed = estimate("--gpu", "h100-sxm5", "--model", "llama-3.1-8b", *bad)
        assert failed.returncode == 2 and failed.stderr.startswith("error: ") and len(failed.stderr.strip().splitlines()) == 1, bad
