"""The memory and speed model (autotune/predict/): arithmetic checked by hand, calibration on a measured
grid, the ranked `autotune estimate` CLI."""
import json
import os
import statistics
import subprocess
import sys

import pytest

from autotune import PROJECT_ROOT
from autotune.engines import get_adapter
from autotune.hardware import get_profile, planned
from autotune.predict import (
    Calibration,
    estimate_memory,
    expected_tokens,
    load_model,
    predict_memory,
    predict_speed,
    predict_trial,
    presets,
    rank_configs,
)
from autotune.predict.acceptance import alpha_from_accept_length
from autotune.predict.calibration import grid_trials
from autotune.predict.speed import (
    HEAD_KERNELS,
    HEAVY_LAYER_KERNELS,
    KERNELS_PER_LAYER,
    NVLINK_LATENCY_S,
    Coefficients,
    all_reduce_s,
    target_pass,
)
from autotune.space import load_space
from autotune.space.constraints import ModelShape

GIB = 2**30
H100, RTX3090 = get_profile("h100-sxm5"), get_profile("rtx-3090")
SGLANG, VLLM, EMBEDDED = get_adapter("sglang"), get_adapter("vllm"), get_adapter("embedded")


def test_llama_3_1_8b_by_hand():
    llama = load_model("llama-3.1-8b")
    # config.json: 32 layers, hidden 4096, 32 heads, 8 KV heads x 128, MLP 14336, vocab 128256, untied.
    # per layer q,o 2*4096^2 + k,v 2*4096*1024 + MLP 3*4096*14336 + 2 norms = 218,112,000;
    # x32 + embedding and head 2*128256*4096 + final norm = 8,030,261,248 parameters.
    assert llama.computed_params() == 8_030_261_248
    m = predict_memory(llama, {"tp_size": 1, "mem_fraction_static": 0.9}, H100, 1, engine=SGLANG)
    assert m.weights_gb == pytest.approx(16.06, abs=0.005)  # 8.03e9 x 2 bytes (bf16)
    # KV per token: 2 (K, V) x 32 layers x 8 heads x 128 x 2 bytes = 131,072 B = 128 KiB
    assert m.kv_gb_per_1k_tokens == pytest.approx(1000 * 131_072 / 1e9)
    # SGLang: the pool is mem_fraction_static x the memory free before the weights load (80 GiB less the
    # 0.5 GB CUDA context), less the weights (kv_cache_configurator.py, _profile_available_bytes)
    assert m.fits and m.kv_tokens == int((0.9 * (80 * GIB - 0.5e9) - 16.06e9) // 131_072)
    assert m.max_sequences(4096) == m.kv_tokens // 4096
    tp2 = predict_memory(llama, {"tp_size": 2, "mem_fraction_static": 0.9}, H100, 2, engine=SGLANG)
    assert tp2.weights_gb == pytest.approx(m.weights_gb / 2)  # sharded linear layers and vocab-parallel embedding
    assert tp2.kv_gb_per_1k_tokens == pytest.approx(m.kv_gb_per_1k_tokens / 2)  # 4 of the 8 KV heads per GPU
    fp8_kv = predict_memory(llama, {"tp_size": 1, "kv_cache_dtype": "fp8_e4m3", "mem_fraction_static": 0.9}, H100, 1,
                            engine=SGLANG)
    assert fp8_kv.kv_gb_per_1k_tokens == pytest.approx(m.kv_gb_per_1k_tokens / 2)
    assert fp8_kv.kv_tokens == int((0.9 * (80 * GIB - 0.5e9) - 16.06e9) // 65_536)


def test_qwen2_5_7b_by_hand():
    qwen = load_model("qwen2.5-7b")
    # config.json: 28 layers, hidden 3584, 4 KV heads x 128, vocab 152064, untied.
    m = predict_memory(qwen, {"tensor_parallel_size": 1}, H100, 1, engine=VLLM)
    assert m.weights_gb == pytest.approx(15.24, abs=0.005)  # 7.62e9 x 2 bytes
    assert m.kv_gb_per_1k_tokens == pytest.approx(1000 * 2 * 28 * 4 * 128 * 2 / 1e9)  # 57,344 B = 56 KiB per token
    # FP8 weights: the 6.53e9 linear-layer parameters at 1 byte; embedding + head (2 x 152064 x 3584 =
    # 1,089,994,752) stay bf16: 7.62e9 - 1.09e9 + 2 x 1.09e9 = 8.71 GB.
    fp8 = predict_memory(qwen, {"tensor_parallel_size": 1, "quantization": "fp8"}, H100, 1, engine=VLLM)
    assert fp8.weights_gb == pytest.approx((7.62e9 - 1_089_994_752 + 2 * 1_089_994_752) / 1e9)
    # TP 8 with 4 KV heads: each GPU keeps one head (replicated), not half of one.
    tp8 = predict_memory(qwen, {"tensor_parallel_size": 8}, H100, 8, engine=VLLM)
    assert tp8.kv_gb_per_1k_tokens == pytest.approx(1000 * 2 * 28 * 1 * 128 * 2 / 1e9)
    # vLLM: 0.92 of the GPU for everything (its default in 0.32/0.33); the KV cache gets what weights and workspace
    # leave, in blocks of 16.
    assert m.kv_tokens == 16 * int((0.92 * 80 * GIB - 15.24e9 - m.workspace_gb * 1e9) // (16 * 57_344))


def test_27b_bf16_refused_on_one_rtx_3090_with_the_numbers():
    gemma = load_model("gemma-2-27b")
    m = predict_memory(gemma, {"tp_size": 1}, RTX3090, 1, engine=SGLANG)
    assert not m.fits and m.kv_tokens == 0
    assert m.weights_gb == pytest.approx(54.4)  # 27.2e9 x 2 bytes
    assert m.reason.startswith("does not fit") and "54.40 GB" in m.reason and "25.77 GB" in m.reason  # 24 GiB
    halves = predict_memory(gemma, {"tp_size": 4, "quantization": "w8a16_fp8"}, RTX3090, 4, engine=SGLANG)
    assert halves.fits, halves.reason


@pytest.mark.slow  # parses the bundled GGUF header (seconds on a busy machine; cached for the later tests)
def test_presets_agree_with_their_shapes_and_sources():
    for name, spec in presets().items():
        assert spec.source.startswith("https://huggingface.co/") and spec.source.endswith("config.json")
        if spec.kv_layers is None:  # hybrid models carry layers these shapes do not describe
            assert spec.computed_params() == pytest.approx(spec.params, rel=0.01), name
    bundled = load_model(None)  # GGUF metadata of the bundled SmolLM2-135M
    smol = presets()["smollm2-135m"]
    assert (bundled.layers, bundled.hidden, bundled.kv_heads, bundled.head_dim, bundled.vocab, bundled.tied_embeddings) == (
        smol.layers, smol.hidden, smol.kv_heads, smol.head_dim, smol.vocab, smol.tied_embeddings)


def test_hf_config_directory(tmp_path):
    config = {"num_hidden_layers": 4, "hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
              "intermediate_size": 512, "vocab_size": 1000, "tie_word_embeddings": True}
    (tmp_path / "config.json").write_text(json.dumps(config))
    m = load_model(tmp_path)
    assert (m.head_dim, m.kv_heads) == (64, 2)
    # 4 x (2*256*256 + 2*256*128 + 3*256*512 + 2*256) + 1000*256 + 256
    assert m.params == 4 * (131072 + 65536 + 393216 + 512) + 256000 + 256
    with pytest.raises(ValueError, match="unknown model"):
        load_model(tmp_path / "missing")


def test_drop_in_for_the_constraints_estimate():
    smol = load_model(None)
    shape = ModelShape.of(smol)  # what the driver holds
    fit = estimate_memory({"verify_slots": 4096, "dtype": "float32"}, planned(H100), shape, engine=EMBEDDED)
    # a slot holds max_seq_len 2048 + the longest draft (16) + 1 positions
    assert not fit.fits and "4096 x 2065-token slot cache" in fit.reason
    small = estimate_memory({"verify_slots": 4, "dtype": "float32"}, planned(H100), shape, engine=EMBEDDED)
    assert small.fits and small.record()["weights_gb"] == pytest.approx(134_515_008 * 4 / 1e9, abs=1e-3)
    assert estimate_memory({}, None, None, engine=EMBEDDED) is None


def test_speculative_arithmetic():
    k = VLLM.knobs({"speculative_method": "eagle", "num_speculative_tokens": 3})
    assert expected_tokens(0.8, k) == pytest.approx((1 - 0.8**4) / 0.2)  # 2.952
    assert expected_tokens(0.0, k) == 1.0
    assert alpha_from_accept_length(2.952, k) == pytest.approx(0.8, abs=1e-3)
    # SGLang runs steps+1 tokens when topk is 1, whatever --speculative-num-draft-tokens says
    sg = SGLANG.knobs({"speculative_algorithm": "EAGLE", "speculative_num_steps": 3, "speculative_eagle_topk": 1,
                       "speculative_num_draft_tokens": 16})
    assert sg.verify_tokens == 4


def step_s(model, config, profile, num_gpus=1, **kw) -> float:
    """Seconds per decode step of one stream (vLLM)."""
    return 1 / predict_speed(model, config, profile, num_gpus, engine=VLLM, **kw).single_tok_s


def test_the_embedded_engine_run_op_by_op_launches_each_op_as_a_kernel():
    """On a GPU without inductor every op of an embedded decoder layer is a kernel of its own (the count its adapter
    declares, int8's casts and scaling on top); compiled, and on a CPU, a layer is the speed model's fused count."""
    from autotune.engines.embedded import INT8_UNFUSED_KERNELS, UNFUSED_LAYER_KERNELS
    from autotune.predict.speed import target_pass

    model, h200 = load_model("smollm2-135m"), get_profile("h200-sxm")

    def kernels(config, on_gpu=True):
        return target_pass(model, EMBEDDED.knobs(config, on_gpu), h200, 1, 1, 512.0, eager=True).kernels

    fused = kernels({"compile": "inductor"})
    assert fused == model.layers * KERNELS_PER_LAYER + HEAD_KERNELS
    assert kernels({"compile": "none"}) == model.layers * UNFUSED_LAYER_KERNELS + HEAD_KERNELS
    assert kernels({"compile": "none", "quantization": "int8"}) - kernels({"compile": "none"}) == \
        model.layers * INT8_UNFUSED_KERNELS
    assert kernels({"compile": "inductor", "quantization": "int8"}) == fused
    assert kernels({"compile": "none"}, on_gpu=False) == fused


def test_speed_terms():
    # Claims about the model's structure, true for any values of its coefficients (which calibration
    # refits per machine), not the coefficients restated.
    llama, qwen, h200 = load_model("llama-3.1-8b"), load_model("qwen2.5-7b"), get_profile("h200-sxm")
    plain, eager = {"tensor_parallel_size": 1}, {"tensor_parallel_size": 1, "enforce_eager": True}
    # Eager passes launch every layer's kernels, where a CUDA-graph pass pays only its light kernels' floors after
    # the bytes: the cost over a CUDA-graph step, those floors added back, is the same per kernel whatever the
    # model (32 layers, 28 layers).
    # (the kernels of a pass: KERNELS_PER_LAYER per layer and HEAD_KERNELS, autotune/predict/speed.py)
    extra_llama = step_s(llama, eager, H100) - step_s(llama, plain, H100)
    extra_qwen = step_s(qwen, eager, H100) - step_s(qwen, plain, H100)
    kernels = lambda m: m.layers * KERNELS_PER_LAYER + HEAD_KERNELS
    floors = lambda m: H100.kernel_us["graph"] * 1e-6 * m.layers * (KERNELS_PER_LAYER - HEAVY_LAYER_KERNELS) + \
        H100.kernel_us["graph"] * 1e-6 * (HEAD_KERNELS - 1)
    assert extra_llama > 0 and (extra_llama + floors(llama)) / kernels(llama) == pytest.approx(
        (extra_qwen + floors(qwen)) / kernels(qwen))
    # Batch 1 is memory-bound: no step beats reading the weights and the cached KV (128 KiB per token,
    # by hand above) once at the spec sheet's bandwidth. More context costs its bytes at the same
    # effective bandwidth, so 3072 more cached tokens take longer on the H100 than on the H200 by the
    # ratio of their bandwidths.
    graphs = predict_speed(llama, plain, H100, 1, engine=VLLM)
    kv = 131_072
    assert graphs.bound == "memory" and 1 / graphs.single_tok_s > (16.06e9 + 1024 * kv) / (H100.memory_bandwidth_gbps * 1e9)
    longer = {p.name: step_s(llama, plain, p, context_len=4096) - step_s(llama, plain, p, context_len=1024)
              for p in (H100, h200)}
    assert longer["h100-sxm5"] >= 3072 * kv / (H100.memory_bandwidth_gbps * 1e9)
    assert longer["h100-sxm5"] / longer["h200-sxm"] == pytest.approx(h200.memory_bandwidth_gbps / H100.memory_bandwidth_gbps)
    batched = predict_speed(llama, plain, H100, 1, engine=VLLM, concurrency=16)
    assert batched.concurrent_tok_s > 10 * graphs.single_tok_s and batched.per_stream_tok_s < graphs.single_tok_s
    eagle = {"tensor_parallel_size": 1, "speculative_method": "eagle", "num_speculative_tokens": 3}
    spec = predict_speed(llama, eagle, H100, 1, engine=VLLM, alpha=0.8)
    assert spec.tokens_per_step == pytest.approx(expected_tokens(0.8, VLLM.knobs(eagle)))  # the formula, by hand above
    assert spec.single_tok_s > graphs.single_tok_s  # 2.95 tokens per step for one draft layer's cost
    tp2 = predict_speed(llama, {"tensor_parallel_size": 2}, H100, 2, engine=VLLM)
    assert graphs.single_tok_s < tp2.single_tok_s < 2 * graphs.single_tok_s  # all-reduces eat part of the gain


def test_light_kernels_add_their_floor_after_the_bytes_under_a_cuda_graph():
    """Under a CUDA graph a layer's norms, rope, activation and the head's sampling run one after another with its
    GEMMs, each for a kernel's floor: their floors come on top of the bytes' time, not hidden under it. Llama-3.1-8B
    at TP 8 on H100s reads 2 GB a GPU (0.75 ms at 80 % of 3.35 TB/s): its 227 light kernels add 0.57 ms, where the
    larger of the bytes' time and all 388 floors was 0.97 ms. Eager, the launches already serialize every kernel;
    on a CPU the per-op cost is calibration's."""
    llama = load_model("llama-3.1-8b")
    k = VLLM.knobs({"tensor_parallel_size": 8})
    graph = target_pass(llama, k, H100, 1, 1, 512.0, eager=False)
    light = 32 * (KERNELS_PER_LAYER - HEAVY_LAYER_KERNELS) + HEAD_KERNELS - 1
    assert graph.light_kernels == light == 227
    floor = H100.kernel_us["graph"] * 1e-6
    coef = Coefficients(kernel_s=floor)
    bytes_s = coef.mem_scale * graph.mem_s
    assert bytes_s > floor * (graph.kernels - light)  # memory-bound: the heavy kernels' floors hide under the bytes
    assert graph.seconds(coef) == pytest.approx(bytes_s + floor * light + graph.comm_s + coef.step_overhead_s)
    assert graph.seconds(coef) > max(bytes_s, floor * graph.kernels) + graph.comm_s + coef.step_overhead_s + 0.3e-3
    assert target_pass(llama, k, H100, 1, 1, 512.0, eager=True).light_kernels == 0
    assert target_pass(llama, VLLM.knobs({}, False), get_profile("cpu"), 1, 1, 512.0, eager=False).light_kernels == 0


def test_a_speculative_step_pays_its_engines_host_time():
    """SGLang's facts give the host time its speculative step costs beyond the passes (spec_step_host_s, from public
    runs): its EAGLE-3 step is that much slower than the same passes at the engine-neutral prior, which vLLM (no such
    fact) keeps; a plain step pays none; a CPU keeps its own coefficients."""
    from autotune.predict.speed import CPU_COEFFICIENTS, decode_step, default_coefficients

    llama = load_model("llama-3.1-8b")
    eagle3 = {"tp_size": 1, "speculative_algorithm": "EAGLE3", "speculative_num_steps": 3,
              "speculative_eagle_topk": 1, "speculative_num_draft_tokens": 4}
    host = SGLANG.facts.spec_step_host_s
    assert host is not None and host > Coefficients().spec_step_s and VLLM.facts.spec_step_host_s is None
    assert default_coefficients(H100, SGLANG).spec_step_s == host
    assert default_coefficients(H100, VLLM) == default_coefficients(H100)
    assert default_coefficients(get_profile("cpu"), SGLANG) == CPU_COEFFICIENTS
    passes = decode_step(llama, SGLANG.knobs(eagle3), H100, 1, 512.0)
    neutral = sum(p.seconds(default_coefficients(H100)) for p in passes)
    step = predict_speed(llama, eagle3, H100, 1, engine=SGLANG, context_len=512, alpha=0.7).step_ms * 1e-3
    assert step - neutral == pytest.approx(host - Coefficients().spec_step_s)
    plain = predict_speed(llama, {"tp_size": 1}, H100, 1, engine=SGLANG, context_len=512).step_ms * 1e-3
    assert plain == pytest.approx(sum(p.seconds(default_coefficients(H100))
                                      for p in decode_step(llama, SGLANG.knobs({"tp_size": 1}), H100, 1, 512.0)))


def test_tp_all_reduce_takes_the_published_custom_all_reduce_times():
    # On an NVSwitch board an all-reduce takes the custom kernel's published time (sgl-project/sglang PR #2688 on
    # A100s, #2904 on H100s: speed.CUSTOM_ALL_REDUCE_US), not the ring formula's 8 us + 2(n-1)/n of the message over
    # the link. Llama-2-7B at TP 8 on A100s: a decode token's 8 KB lies between the 2 KB and 16 KB timings (14.0 and
    # 14.2 us), two all-reduces a layer, 32 layers; the ring formula would give about 8.05 us each.
    a100 = get_profile("a100-80gb-sxm4")
    verify = target_pass(load_model("llama-2-7b"), VLLM.knobs({"tensor_parallel_size": 8}), a100, 1, 1, 512, False)
    assert 64 * 14.0e-6 <= verify.comm_s <= 64 * 14.2e-6
    # A 1 MB message (a 64-token tree of a 70B model) on 8 H100s: the published 24.1 us, twice the ring's; past the
    # largest timing (4 MB: 45.0 us) the rest goes at the ring's rate.
    link = 900e9 / 2
    ring = 2 * 7 / 8 / link
    assert all_reduce_s(2**20, 8, H100, link, NVLINK_LATENCY_S) == pytest.approx(24.1e-6)
    assert 24.1e-6 > 1.9 * (NVLINK_LATENCY_S + 2**20 * ring)
    assert all_reduce_s(2**23, 8, H100, link, NVLINK_LATENCY_S) == pytest.approx(45.0e-6 + 2**22 * ring)
    # A bridged pair (no NVSwitch): the ring formula, 2(n-1)/n = 1 of the message over the bridge
    bridge = RTX3090.interconnect["nvlink"]["bandwidth_gbps"] * 1e9 / 2
    assert all_reduce_s(8192, 2, RTX3090, bridge, NVLINK_LATENCY_S) == pytest.approx(NVLINK_LATENCY_S + 8192 / bridge)


def _grid_trials():
    """The embedded engine's measured grid on this CPU (benchmarks/bench_sample_efficiency.py)."""
    return grid_trials(PROJECT_ROOT / "benchmarks" / "data" / "grid_embedded_code.csv",
                       concurrency=4, num_requests=4, output_tokens=32, prompt_tokens=200)


def launch_group(trial: dict) -> tuple:
    """The grid's launches: draft_length changes on a running server, everything else is a launch."""
    return tuple(sorted((k, v) for k, v in trial["config"].items() if k != "draft_length"))


def test_calibration_predicts_launches_it_has_not_seen(monkeypatch):
    # In-sample error can only fall (the fit's search grid contains the priors). The claim is about
    # held-out data: fitted on all the grid's other launches, the calibration predicts each launch's
    # trials better than the priors do, and better than guessing the other launches' mean speed.
    # The CPU roofline counts this machine's cores: pinned to the 2 cores the grid was measured on.
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    trials = _grid_trials()
    groups = sorted({launch_group(t) for t in trials})
    assert len(trials) >= 20 and len(groups) >= 10
    smol, cpu = load_model(None), get_profile("cpu")
    held_out, priors, peer = [], [], []
    for group in groups:
        train = [t for t in trials if launch_group(t) != group]
        cal = Calibration.fit(train, smol, cpu, engine=EMBEDDED)
        others = statistics.mean(t["output_tok_s"] for t in train)
        for t in (t for t in trials if launch_group(t) == group):
            measured = t["output_tok_s"]
            held_out.append(abs(predict_trial(t, smol, cpu, engine=EMBEDDED, calibration=cal) / measured - 1))
            priors.append(abs(predict_trial(t, smol, cpu, engine=EMBEDDED) / measured - 1))
            peer.append(abs(others / measured - 1))
    error = {name: statistics.median(e) for name, e in (("held_out", held_out), ("priors", priors), ("peer", peer))}
    assert error["held_out"] < error["priors"] and error["held_out"] < error["peer"], error
    assert Calibration.fit(trials, smol, cpu, engine=EMBEDDED).coefficients != Calibration.fit(
        trials[:1], smol, cpu, engine=EMBEDDED).coefficients  # the data moves the fit


def test_rank_configs_respects_hardware_and_memory():
    space, qwen = load_space("sglang"), load_model("qwen3-32b")
    # 32.8 GB even in FP8 weights: on one 24 GiB card only 4-bit weights fit (19.3 GB in AWQ/GPTQ)
    one = rank_configs(space, qwen, RTX3090, 1, top=50, engine=SGLANG)
    assert one and all(c["quantization"] in ("awq_marlin", "gptq_marlin") for c, _ in one)
    ranked = rank_configs(space, qwen, RTX3090, 2, top=50, engine=SGLANG)
    assert ranked and all(c["tp_size"] == 2 or c["quantization"] in ("awq_marlin", "gptq_marlin") for c, _ in ranked)
    assert all(c["quantization"] != "fp8" for c, _ in ranked)  # no W8A8 on Ampere: Marlin
    assert all(c["speculative_algorithm"] in ("none", "NGRAM") for c, _ in ranked)  # no draft model given
    speeds = [p.speed.single_tok_s for _, p in ranked]
    assert speeds == sorted(speeds, reverse=True)


def test_estimate_cli(tmp_path):
    run = [sys.executable, "-m", "autotune.cli", "estimate", "--gpu", "h200-sxm", "--num-gpus", "2", "--model", "llama-3.1-8b"]
    out = subprocess.run([*run, "--top", "3", "--concurrency", "8", "--json"], check=False, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["predicted"] and len(report["configs"]) == 3
    rates = [c["speed"]["concurrent_tok_s"] for c in report["configs"]]
    assert rates == sorted(rates, reverse=True) and "sglang.launch_server" in report["configs"][0]["launch"]
    table = subprocess.run([*run, "--top", "2", "--engine", "vllm"], check=False, capture_output=True, text=True, timeout=60)
    assert table.returncode == 0 and "PREDICTED" in table.stdout and " ".join(get_adapter("vllm").for_target(True).entry[1:]) in table.stdout
    bad = subprocess.run([*run[:-1], "no-such-model"], check=False, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and bad.stderr.startswith("error: unknown model") and len(bad.stderr.splitlines()) == 1
