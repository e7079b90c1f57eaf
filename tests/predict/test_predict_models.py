"""Model shapes for MoE and MLA (autotune/predict/models.py): config.json of each family read as its keys
say, presets recomputed against their cards, total bytes held vs the bytes a decode step reads, MLA's
KV cache, expert parallelism."""
import itertools
import json

import pytest

from autotune.engines import get_adapter
from autotune.engines.base import config_args, load_schema
from autotune.hardware import get_profile
from autotune.predict import load_model, predict_memory, predict_speed, presets
from autotune.predict.memory import kv_bytes_per_token, weights_bytes, weights_read_bytes
from autotune.predict.models import _expected_max_binomial
from autotune.predict.speed import (
    KERNELS_PER_LAYER,
    MOE_BANDWIDTH_SHARE,
    MOE_EXTRA_KERNELS,
    MOE_FIXED_S,
    WEIGHT_ONLY_BANDWIDTH_SHARE,
    Coefficients,
    draft_passes,
    target_pass,
)

GIB = 2**30
SGLANG, VLLM = get_adapter("sglang"), get_adapter("vllm")
H100, H200, RTX3090 = get_profile("h100-sxm5"), get_profile("h200-sxm"), get_profile("rtx-3090")

# The published config.json files, the keys the reader uses (values as on Hugging Face).
QWEN3_30B_A3B = {"architectures": ["Qwen3MoeForCausalLM"], "decoder_sparse_step": 1, "head_dim": 128,
                 "hidden_size": 2048, "intermediate_size": 6144, "mlp_only_layers": [], "moe_intermediate_size": 768,
                 "num_attention_heads": 32, "num_experts": 128, "num_experts_per_tok": 8, "num_hidden_layers": 48,
                 "num_key_value_heads": 4, "tie_word_embeddings": False, "vocab_size": 151936}
DEEPSEEK_V3 = {"architectures": ["DeepseekV3ForCausalLM"], "first_k_dense_replace": 3, "hidden_size": 7168,
               "intermediate_size": 18432, "kv_lora_rank": 512, "moe_intermediate_size": 2048, "moe_layer_freq": 1,
               "n_routed_experts": 256, "n_shared_experts": 1, "num_attention_heads": 128, "num_experts_per_tok": 8,
               "num_hidden_layers": 61, "num_key_value_heads": 128, "num_nextn_predict_layers": 1, "q_lora_rank": 1536,
               "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "tie_word_embeddings": False,
               "vocab_size": 129280, "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3",
                                                             "quant_method": "fp8", "weight_block_size": [128, 128]}}
GLM_4_5 = {"architectures": ["Glm4MoeForCausalLM"], "first_k_dense_replace": 3, "head_dim": 128, "hidden_size": 5120,
           "intermediate_size": 12288, "moe_intermediate_size": 1536, "n_routed_experts": 160, "n_shared_experts": 1,
           "num_attention_heads": 96, "num_experts_per_tok": 8, "num_hidden_layers": 92, "num_key_value_heads": 8,
           "num_nextn_predict_layers": 1, "tie_word_embeddings": False, "vocab_size": 151552}
GPT_OSS_20B = {"architectures": ["GptOssForCausalLM"], "experts_per_token": 4, "head_dim": 64, "hidden_size": 2880,
               "intermediate_size": 2880, "layer_types": ["sliding_attention", "full_attention"] * 12,
               "num_attention_heads": 64, "num_experts_per_tok": 4, "num_hidden_layers": 24, "num_key_value_heads": 8,
               "num_local_experts": 32, "tie_word_embeddings": False, "vocab_size": 201088, "sliding_window": 128,
               "quantization_config": {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                                  "model.embed_tokens", "lm_head"], "quant_method": "mxfp4"}}
MIXTRAL_8X7B = {"architectures": ["MixtralForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
                "num_attention_heads": 32, "num_experts_per_tok": 2, "num_hidden_layers": 32, "num_key_value_heads": 8,
                "num_local_experts": 8, "tie_word_embeddings": False, "vocab_size": 32000}
SHAPE = ("layers", "hidden", "heads", "kv_heads", "head_dim", "vocab", "tied_embeddings", "experts", "experts_per_token",
         "shared_experts", "moe_intermediate", "dense_layers", "kv_lora_rank", "qk_rope_dim", "q_lora_rank", "v_head_dim",
         "mtp_layers", "cache_layers", "checkpoint_quant", "architecture")


def from_config(tmp_path, config: dict, name: str = "model"):
    (tmp_path / name).mkdir()
    (tmp_path / name / "config.json").write_text(json.dumps(config))
    return load_model(tmp_path / name)


@pytest.mark.parametrize("preset,config", [("qwen3-30b-a3b", QWEN3_30B_A3B), ("deepseek-v3", DEEPSEEK_V3),
                                           ("glm-4.5", GLM_4_5), ("gpt-oss-20b", GPT_OSS_20B),
                                           ("mixtral-8x7b", MIXTRAL_8X7B)])
def test_configs_read_as_their_presets(tmp_path, preset, config):
    """Each family's own keys (num_experts / n_routed_experts / num_local_experts, experts_per_token,
    first_k_dense_replace, kv_lora_rank ...) give the preset's shapes; params from the shapes agree with the card."""
    read, bundled = from_config(tmp_path, config), presets()[preset]
    assert {f: getattr(read, f) for f in SHAPE} == {f: getattr(bundled, f) for f in SHAPE}
    assert read.params == pytest.approx(bundled.params, rel=0.01)


def test_presets_recompute_their_cards():
    """Total parameters from the shapes within 1% of the card (MoE, MLA and dense alike); active parameters
    per token as the cards count them: DeepSeek-V3 36.6B with the 0.9B head (README_WEIGHTS.md), gpt-oss
    3.61B / 5.13B (arXiv:2508.10925, Table 1), Qwen3-30B-A3B 3.3B, Mixtral 12.9B, each plus the input embedding
    where the card leaves it out."""
    for name, spec in presets().items():
        if spec.linear_layers == 0:  # hybrid linear-attention models carry layers these shapes do not describe
            assert spec.computed_params() == pytest.approx(spec.params, rel=0.01), name
        assert spec.active_params <= spec.params
    p = presets()
    embedding = {n: p[n].vocab * p[n].hidden for n in p}
    assert p["qwen3-30b-a3b"].active_params == pytest.approx(3.3e9, rel=0.02)
    assert p["mixtral-8x7b"].active_params == pytest.approx(12.9e9, rel=0.01)
    assert p["deepseek-v3"].active_params == pytest.approx(36.6e9 + embedding["deepseek-v3"], rel=0.01)
    assert p["gpt-oss-20b"].active_params == pytest.approx(3.61e9 + embedding["gpt-oss-20b"], rel=0.01)
    assert p["gpt-oss-120b"].active_params == pytest.approx(5.13e9 + embedding["gpt-oss-120b"], rel=0.01)
    assert p["qwen3-235b-a22b"].active_params == pytest.approx(22e9, rel=0.02)
    # DeepSeek-V3's MTP module: "11.5B unique parameters" beside the shared embedding and head
    assert p["deepseek-v3"].mtp_params == pytest.approx(11.5e9, rel=0.02)
    dense = p["llama-3.1-8b"]
    assert dense.active_params == dense.params and dense.mtp_params == 0


def test_qwen3_30b_a3b_bf16_holds_61_gb_and_is_refused_on_a_3090():
    """The issue's bug: it was read as a 3.34B dense model (6.7 GB) and fitted on one RTX 3090."""
    qwen = load_model("qwen3-30b-a3b")
    for engine, config in ((SGLANG, {"tp_size": 1}), (VLLM, {"tensor_parallel_size": 1})):
        m = predict_memory(qwen, config, RTX3090, 1, engine=engine)
        assert m.weights_gb == pytest.approx(61.0, rel=0.05)
        assert not m.fits and m.kv_tokens == 0 and "weights alone take 61.00 GB" in m.reason
    fits = predict_memory(qwen, {"tp_size": 1}, H100, 1, engine=SGLANG)
    assert fits.fits and fits.weights_gb == pytest.approx(61.0, rel=0.05)
    tp4 = predict_memory(qwen, {"tp_size": 4, "quantization": "w8a16_fp8"}, RTX3090, 4, engine=SGLANG)
    assert tp4.fits and tp4.weights_gb == pytest.approx(61.0 / 2 / 4, rel=0.05)  # FP8 experts sliced over 4 GPUs


def test_moe_decode_reads_the_experts_its_tokens_touch():
    qwen = load_model("qwen3-30b-a3b")
    k = SGLANG.knobs({"tp_size": 1})
    held = weights_bytes(qwen, k)
    one = weights_read_bytes(qwen, k, 1)
    assert one == pytest.approx(2 * 3.3e9, rel=0.02)  # 8 of 128 experts per layer: the active 3.3B, not 30.5B
    assert one == pytest.approx(2 * qwen.active_params)
    # batch 64: 128 (1 - (1 - 8/128)^64) = 125.9 distinct experts per layer on average
    expert_bytes = 3 * 2048 * 768 * 2
    touched = 128 * (1 - (1 - 8 / 128) ** 64)
    assert weights_read_bytes(qwen, k, 64) - one == pytest.approx(48 * (touched - 8) * expert_bytes)
    reads = [weights_read_bytes(qwen, k, t) for t in (1, 2, 8, 64, 4096)]
    assert reads == sorted(reads) and reads[-1] == pytest.approx(held)
    # the step time follows: one stream of the MoE reads a ninth of what a dense 32B reads
    moe_pass = target_pass(qwen, k, H100, seqs=1, tokens=1, context=0, eager=False)
    dense_pass = target_pass(load_model("qwen3-32b"), k, H100, seqs=1, tokens=1, context=0, eager=False)
    # the 8 touched experts (48 x 8 x expert_bytes) stream at the fused-MoE kernel's share of the bandwidth, not a
    # dense GEMV's, and each MoE layer adds the kernel's fixed time
    routed = 48 * 8 * expert_bytes
    slower = routed * (1 / Coefficients.mem_scale / MOE_BANDWIDTH_SHARE - 1)
    assert moe_pass.mem_s == pytest.approx((one + slower) / (H100.memory_bandwidth_gbps * 1e9))
    assert moe_pass.fixed_s == pytest.approx(48 * MOE_FIXED_S) and dense_pass.fixed_s == 0
    assert weights_read_bytes(load_model("qwen3-32b"), k, 1) > 9 * one  # a ninth of the bytes
    assert dense_pass.mem_s > 7 * moe_pass.mem_s  # less, as the experts stream slower than dense GEMVs
    assert moe_pass.compute_s == pytest.approx(2 * qwen.active_params / (H100.peak_tflops["bf16"] * 1e12))
    # router, top-k, align, two expert GEMMs, activation, sum: 4 kernels a layer beyond a dense MLP's 3
    assert moe_pass.kernels - dense_pass.kernels == 48 * (KERNELS_PER_LAYER + MOE_EXTRA_KERNELS) - 64 * KERNELS_PER_LAYER
    speed = predict_speed(qwen, {"tp_size": 1}, H100, 1, engine=SGLANG, concurrency=64)
    assert speed.single_tok_s > speed.per_stream_tok_s  # 64 streams read 15x the expert bytes of one


def test_weight_only_int8_experts_pay_the_fused_moe_and_the_dequantizing_shares():
    """Mixtral's int8 weight-only experts (gpt-fast's ConditionalFeedForwardBit8) stream at the fused-MoE kernel's
    share times an int8 GEMV's (torchao's 0.79), not at the MoE share alone; the attention layers at the int8 share
    alone; 16-bit experts at the MoE share alone."""
    mixtral, a100 = load_model("mixtral-8x7b"), get_profile("a100-80gb-sxm4")
    k = VLLM.knobs({"tensor_parallel_size": 1, "quantization": "int8"})
    one_pass = target_pass(mixtral, k, a100, seqs=1, tokens=1, context=0, eager=False)
    routed = 32 * 2 * 3 * 4096 * 14336  # 2 of 8 experts a layer, int8: a byte a weight
    read = weights_read_bytes(mixtral, k, 1)
    linear = 32 * mixtral.layer_params - mixtral.routed_params  # attention (and the router) at int8 too
    dense = 1 / Coefficients.mem_scale
    expected = (read + linear * (1 / WEIGHT_ONLY_BANDWIDTH_SHARE["int8"] - 1)
                + routed * (dense / (MOE_BANDWIDTH_SHARE * WEIGHT_ONLY_BANDWIDTH_SHARE["int8"]) - 1))
    assert one_pass.mem_s == pytest.approx(expected / (a100.memory_bandwidth_gbps * 1e9), rel=1e-6)
    moe_share_alone = (read + linear * (1 / WEIGHT_ONLY_BANDWIDTH_SHARE["int8"] - 1)
                       + routed * (dense / MOE_BANDWIDTH_SHARE - 1)) / (a100.memory_bandwidth_gbps * 1e9)
    assert one_pass.mem_s > 1.2 * moe_share_alone
    # bf16 experts keep the MoE share alone
    plain = VLLM.knobs({"tensor_parallel_size": 1})
    bf16 = target_pass(mixtral, plain, a100, seqs=1, tokens=1, context=0, eager=False)
    assert bf16.mem_s * a100.memory_bandwidth_gbps * 1e9 == pytest.approx(
        weights_read_bytes(mixtral, plain, 1) + 2 * routed * (dense / MOE_BANDWIDTH_SHARE - 1), rel=1e-6)


def test_a_moe_models_mtp_draft_reads_the_experts_its_tokens_touch():
    """DeepSeek-V3's MTP module is a MoE layer (11.6B parameters, nearly all experts): a batch-1 draft pass reads
    the 8 routed experts a token goes to, not the module; a wider batch reads more of them. An EAGLE head on a
    MoE target is a dense layer of the target's width."""
    ds = load_model("deepseek-v3")
    k = SGLANG.knobs({"tp_size": 8, "speculative_algorithm": "NEXTN", "speculative_num_steps": 1,
                      "speculative_eagle_topk": 1, "speculative_num_draft_tokens": 2})

    def mem(seqs):
        return draft_passes(ds, k, H100, seqs=seqs, context=0, eager=False, draft=None)[0].mem_s
    module_s = (ds.mtp_params / 8 * 2 + ds.vocab * ds.hidden / 8 * 2) / (H100.memory_bandwidth_gbps * 1e9)
    assert mem(1) < module_s / 4 and mem(1) < mem(8) < mem(64) < module_s
    qwen = load_model("qwen3-30b-a3b")
    eagle = SGLANG.knobs({"tp_size": 1, "speculative_algorithm": "EAGLE3", "speculative_num_steps": 1,
                          "speculative_eagle_topk": 1, "speculative_num_draft_tokens": 2})
    dense_layer = qwen.attention_params() + 3 * qwen.hidden * qwen.intermediate
    [draft, _] = draft_passes(qwen, eagle, H100, seqs=1, context=0, eager=False, draft=None)
    assert draft.compute_s * H100.peak_tflops["bf16"] * 1e12 / 2 < 1.2 * (dense_layer + 32000 * qwen.hidden)


def test_dense_models_unchanged():
    llama = load_model("llama-3.1-8b")
    k = SGLANG.knobs({"tp_size": 2})
    assert weights_read_bytes(llama, k, 1) == weights_read_bytes(llama, k, 512) == weights_bytes(llama, k)
    assert kv_bytes_per_token(llama, k) == 2 * 32 * 4 * 128 * 2
    assert llama.attention_width == 32 * 128 and llama.kv_width == 2 * 8 * 128


def test_deepseek_v3_mla_kv_cache_and_fp8_weights():
    ds = load_model("deepseek-v3")
    # MLA: 512 latent + 64 rope key per token and layer, 61 layers; the same on every GPU of the TP group
    for tp in (1, 8):
        assert kv_bytes_per_token(ds, SGLANG.knobs({"tp_size": tp})) == 576 * 61 * 2
    assert kv_bytes_per_token(ds, SGLANG.knobs({"tp_size": 8, "kv_cache_dtype": "fp8_e4m3"})) == 576 * 61
    m = predict_memory(ds, {"tp_size": 8}, H200, 8, engine=SGLANG)
    assert m.kv_gb_per_1k_tokens == pytest.approx(1000 * 576 * 61 * 2 / 1e9)
    # the published FP8 weights: 1 byte per linear weight, embedding and head in BF16, over 8 GPUs
    table = 129280 * 7168
    assert m.weights_gb == pytest.approx(((671e9 - 2 * table) + 2 * table * 2) / 8 / 1e9)
    assert m.fits
    assert not predict_memory(ds, {"tp_size": 8}, H100, 8, engine=SGLANG).fits  # 84 GB a GPU > 80 GiB x fraction
    # MLA's absorbed decode attends over the latent: (2 x 512 + 64) / 2 per head, not the 192 of head_dim
    assert ds.attention_width == 128 * (2 * 512 + 64) / 2


def test_gpt_oss_mxfp4_experts_and_bf16_rest():
    """gpt-oss's checkpoints: 60.8 GiB and 12.8 GiB (arXiv:2508.10925, section 2): MXFP4 experts (4.25 bits),
    attention, router, embedding and head in BF16."""
    k = VLLM.knobs({"tensor_parallel_size": 1})
    assert weights_bytes(load_model("gpt-oss-120b"), k) == pytest.approx(60.8 * GIB, rel=0.02)
    assert weights_bytes(load_model("gpt-oss-20b"), k) == pytest.approx(12.8 * GIB, rel=0.02)
    assert predict_memory(load_model("gpt-oss-120b"), {"tensor_parallel_size": 1}, H100, 1, engine=VLLM).fits


def test_expert_parallelism(tmp_path):
    # the engines' flags, as their schemas name them
    assert config_args({"ep_size": 8}, load_schema("sglang", SGLANG.version)) == ["--ep-size", "8"]
    assert config_args({"enable_expert_parallel": True}, load_schema("vllm", VLLM.version)) == ["--enable-expert-parallel"]
    assert SGLANG.knobs({"tp_size": 8, "ep_size": 8}).ep == 8 and SGLANG.knobs({"tp_size": 8}).ep == 1
    assert VLLM.knobs({"tensor_parallel_size": 4, "enable_expert_parallel": True}).ep == 4
    ds = load_model("deepseek-v3")
    tp, ep = SGLANG.knobs({"tp_size": 8}), SGLANG.knobs({"tp_size": 8, "ep_size": 8})
    assert weights_bytes(ds, ep) == weights_bytes(ds, tp)  # whole experts or slices: the same bytes a GPU
    # one token's 8 experts land unevenly on 8 GPUs of 32 experts each: the busiest GPU reads more than
    # the 1/8 of every touched expert that TP slicing reads; a large batch touches nearly all of them anyway
    assert weights_read_bytes(ds, ep, 1) > 1.5 * weights_read_bytes(ds, tp, 1)
    assert weights_read_bytes(ds, ep, 512) == pytest.approx(weights_read_bytes(ds, tp, 512), rel=0.01)
    # the expected maximum, against enumerating every outcome of 3 groups of 4 experts
    n, p, groups = 4, 0.3, 3
    expected = 0.0
    for counts in itertools.product(range(n + 1), repeat=groups):
        prob = 1.0
        for c in counts:
            prob *= [1, 4, 6, 4, 1][c] * p**c * (1 - p) ** (n - c)
        expected += prob * max(counts)
    assert _expected_max_binomial(n, p, groups) == pytest.approx(expected)


def test_dense_and_sparse_layers_as_each_family_says(tmp_path):
    # Qwen3-MoE: mlp_only_layers dense, and only every decoder_sparse_step-th layer sparse
    qwen = from_config(tmp_path, {**QWEN3_30B_A3B, "mlp_only_layers": [1], "decoder_sparse_step": 2}, "q")
    assert qwen.moe_layers == 23 and qwen.dense_layers == 25  # layers 3, 5, ..., 47 (1 is dense only)
    # DeepSeek: the first first_k_dense_replace layers dense, then every moe_layer_freq-th
    ds = from_config(tmp_path, {**DEEPSEEK_V3, "moe_layer_freq": 2}, "d")
    assert ds.moe_layers == len(range(4, 61, 2))
    # a quantized checkpoint's safetensors index counts bytes, not parameters: the shapes decide
    (tmp_path / "d" / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": 688e9}}))
    assert load_model(tmp_path / "d").params == pytest.approx(ds.computed_params())
    # Qwen3-Next: one shared expert of shared_expert_intermediate_size, linear-attention layers kept
    nxt = from_config(tmp_path, {**QWEN3_30B_A3B, "num_experts": 512, "num_experts_per_tok": 10,
                                 "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
                                 "full_attention_interval": 4, "linear_num_value_heads": 32, "linear_num_key_heads": 16,
                                 "linear_key_head_dim": 128, "linear_value_head_dim": 128}, "n")
    assert (nxt.shared_experts, nxt.shared_intermediate, nxt.cache_layers, nxt.linear_layers) == (1, 512, 12, 36)


def test_moe_gguf_metadata(tmp_path):
    """The MoE keys llama.cpp writes into a GGUF ({arch}.expert_count, expert_used_count,
    expert_feed_forward_length) read into the same fields."""
    import gguf
    import numpy as np

    path = tmp_path / "tiny-moe.gguf"
    writer = gguf.GGUFWriter(str(path), "qwen3moe")
    writer.add_block_count(2)
    writer.add_embedding_length(64)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_key_length(16)
    writer.add_expert_count(8)
    writer.add_expert_used_count(2)
    writer.add_expert_feed_forward_length(32)
    writer.add_vocab_size(100)
    writer.add_tensor("token_embd.weight", np.zeros((100, 64), dtype=np.float32))
    writer.add_tensor("blk.0.ffn_gate_exps.weight", np.zeros((8, 32, 64), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    m = load_model(path)
    assert (m.experts, m.experts_per_token, m.moe_intermediate, m.intermediate, m.moe_layers) == (8, 2, 32, 32, 2)
    assert m.params == 100 * 64 + 8 * 32 * 64
