"""llama.cpp's gguf_type: the weight format of the GGUF file llama-server loads. Its bytes per weight (ggml's
block sizes, llama.cpp's published sizes for the K-quant mixes) priced by the memory and speed model; a
real second GGUF (the bundled Q4_1 model requantized to Q8_0 with the gguf package) next to the bundled
file: the types read from their headers, the space offering exactly those, and a real llama-server the
adapter launched for gguf_type=Q8_0 serving from the Q8_0 file. The token embedding and output head as
llama.cpp holds them (build 11434, the one setup.sh builds): the embedding in host memory, the head on the GPU
at the type llama-quantize gave it."""
import json
import os
import re
import subprocess
import sys

import gguf
import httpx
import numpy as np
import pytest
import yaml
from conftest import write_gguf

from autotune.embedded.bundled import bundled_gguf_path
from autotune.engines.launcher import launch
from autotune.engines.llamacpp import LlamaCppAdapter, binary_version, find_binary
from autotune.hardware import get_profile
from autotune.predict import load_model, predict_memory, predict_speed
from autotune.predict.gguf_types import (
    TYPES_FILE,
    block_bytes,
    bytes_per_weight,
    embedding_type,
    head_type,
    published_bytes,
    read_header,
    stored_bytes,
)
from autotune.predict.speed import CPU_BANDWIDTH_GBPS, default_coefficients, target_pass
from autotune.study import plan

ADAPTER = LlamaCppAdapter()
RTX3090 = get_profile("rtx-3090")
BINARY = find_binary()
needs_server = pytest.mark.skipif(not BINARY or binary_version(BINARY) is None,
                                  reason="llama-server not built: bash setup.sh llamacpp")


def autotune(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "autotune.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, check=False)


# -- the table ------------------------------------------------------------------------------------------
def test_block_sizes_are_ggmls_and_every_type_is_a_llama_file_type():
    # gguf-py's GGML_QUANT_SIZES (weights, bytes per block) mirrors ggml-common.h: an independent copy
    blocks = yaml.safe_load(TYPES_FILE.read_text())["blocks"]
    for name, (size, weights) in blocks.items():
        assert gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[name]] == (weights, size), name
    assert block_bytes("Q4_0") == 18 / 32 and block_bytes("Q8_0") == 34 / 32 and block_bytes("Q4_K") == 144 / 256
    file_types = {t.name.removeprefix("MOSTLY_").removeprefix("ALL_") for t in gguf.LlamaFileType}
    assert set(bytes_per_weight()) <= file_types  # every name is one general.file_type can say


def test_published_sizes_give_the_pure_types_blocks_back_and_the_mixes_their_rules():
    # The derivation (Llama-3-8B's file size less embedding and Q6_K head, over its linear weights) read on the
    # pure types returns their block sizes: the published sizes and the reference model's counts agree.
    for name in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q6_K", "Q8_0"):
        assert published_bytes(name) == pytest.approx(bytes_per_weight()[name], rel=0.003), name
    # Q4_K_M by llama-quant.cpp's rules on Llama-3-8B: attn_v and ffn_down at Q6_K in the layers use_more_bits
    # picks (i < 4, i >= 28, (i - 4) % 3 == 2: 16 of 32), the rest Q4_K. Per layer attn_v 4096 x 1024 and
    # ffn_down 14336 x 4096 = 62,914,560 weights; 16 of them over 6,979,321,856 linear weights = 14.42%.
    more = sum(i < 4 or i >= 28 or (i - 4) % 3 == 2 for i in range(32))
    share = more * (4096 * 1024 + 14336 * 4096) / 6_979_321_856
    by_rules = (1 - share) * 144 / 256 + share * 210 / 256
    assert more == 16 and bytes_per_weight()["Q4_K_M"] == pytest.approx(by_rules, rel=0.005)
    w = bytes_per_weight()
    assert w["Q4_0"] < w["Q4_K_S"] < w["Q4_K_M"] < w["Q5_K_S"] < w["Q5_K_M"] < w["Q6_K"] < w["Q8_0"] < w["F16"]


# -- the memory and speed model -------------------------------------------------------------------------
def test_memory_and_speed_of_two_types_by_hand():
    llama = load_model("llama-3.1-8b")  # 8.03e9 parameters; embedding and head untied: 128256 x 4096 each
    table = 128256 * 4096
    linear = 8.03e9 - 2 * table
    q4 = predict_memory(llama, {"gguf_type": "Q4_0", "parallel": 1}, RTX3090, 1, engine=ADAPTER, context_len=4096)
    q8 = predict_memory(llama, {"gguf_type": "Q8_0", "parallel": 1, "cache_type_k": "q8_0", "cache_type_v": "q8_0"},
                        RTX3090, 1, engine=ADAPTER, context_len=4096)
    # On the GPU: linear layers at the block's bytes (Q4_0 18 B / 32 weights, Q8_0 34 B / 32) and output.weight
    # at the type llama-quant.cpp gives it (Q6_K, 210 B / 256, for Q4_0; Q8_0 stays Q8_0); token_embd stays on
    # the host (src/llama-model.cpp load_tensors: "always keep it on the CPU").
    assert q4.weights_gb == pytest.approx((linear * 18 / 32 + table * 210 / 256) / 1e9, rel=1e-9)  # 4.36 GB
    assert q8.weights_gb == pytest.approx((linear * 34 / 32 + table * 34 / 32) / 1e9, rel=1e-9)  # 7.97 GB
    # KV: 2 (K, V) x 32 layers x 8 KV heads x 128 x bytes; an f16 cache 2 B, q8_0 a ggml block (34 B / 32)
    assert q4.kv_gb_per_1k_tokens == pytest.approx(2 * 32 * 8 * 128 * 2 * 1000 / 1e9)
    assert q8.kv_gb_per_1k_tokens == pytest.approx(2 * 32 * 8 * 128 * 34 / 32 * 1000 / 1e9)
    # One stream is memory-bound on a 3090: the step grows by the extra bytes of the linear layers and the head
    # over the bandwidth (the embedding gives one row a token: nothing to the step).
    fast, slow = (predict_speed(llama, {"gguf_type": t, "parallel": 1}, RTX3090, 1, engine=ADAPTER)
                  for t in ("Q4_0", "Q8_0"))
    assert fast.bound == slow.bound == "memory" and fast.single_tok_s > slow.single_tok_s
    extra = linear * (34 - 18) / 32 + table * (34 / 32 - 210 / 256)
    extra_s = default_coefficients(RTX3090).mem_scale * extra / (936 * 1e9)
    assert slow.step_ms - fast.step_ms == pytest.approx(extra_s * 1e3, rel=1e-6)


def test_head_and_embedding_types_follow_llama_quant_rules():
    # src/llama-quant.cpp llama_tensor_get_type_impl: output.weight -> Q6_K unless the type is Q8_0; Q5_K for
    # the IQ1/IQ2/IQ3_XXS types; rows that do not fill the base type's blocks -> Q8_0 ("nx % qk_k != 0"); then
    # tensor_type_fallback (Q6_K -> Q8_0 where 256 does not divide the row). F16 files are not requantized.
    assert [head_type(t, 5120) for t in ("Q4_K_M", "Q5_K_M", "Q4_1", "Q8_0", "IQ2_XS", "F16")] == \
        ["Q6_K", "Q6_K", "Q6_K", "Q8_0", "Q5_K", "F16"]
    assert head_type("Q4_K_M", 576) == head_type("Q4_1", 576) == "Q8_0"  # SmolLM2's 576 = 2.25 blocks of 256
    # an untied token_embd keeps the base type (Q2_K for IQ2_XS); a tied one is the head and gets its type
    assert embedding_type("Q5_K_M", 5120, tied=False) == "Q5_K"
    assert embedding_type("IQ2_XS", 5120, tied=False) == "Q2_K"
    assert embedding_type("Q5_K_M", 5120, tied=True) == "Q6_K"
    # the bundled file (llama-quantize's Q4_1 of the tied SmolLM2) says the same in its header
    smol = load_model(None)
    tensors = {t.name: t.tensor_type.name for t in gguf.GGUFReader(bundled_gguf_path()).tensors}
    assert smol.tied_embeddings and "output.weight" not in tensors
    assert tensors["token_embd.weight"] == embedding_type("Q4_1", smol.hidden, tied=True) == "Q8_0"


def test_a_files_own_tensor_types_beat_the_rules(tmp_path):
    # A Q4_K_M file whose tied embedding was kept at F16 (llama-quantize --token-embedding-type f16): its
    # header's sizes price it, not the rules' Q6_K; a type no file of the model has: the rules.
    file = tmp_path / "tiny-Q4_K_M.gguf"
    write_gguf(file, "llama", gguf.LlamaFileType.MOSTLY_Q4_K_M, (64, 256))
    assert stored_bytes(str(file), "Q4_K_M", 256, tied=True) == (2.0, 2.0)
    assert stored_bytes(str(file), "Q8_0", 256, tied=True) == (34 / 32, 34 / 32)
    assert stored_bytes("https://huggingface.co/x/config.json", "Q4_K_M", 256, tied=False) == (144 / 256, 210 / 256)


def test_qwen35_27b_at_q5_k_m_and_q6_k_fits_a_24gb_card_f16_does_not():
    # Qwen3.5-27B (model_presets.yaml): 27.78e9 parameters, vocab 248320 x hidden 5120, untied. On the GPU the
    # linear layers at the type's bytes and output.weight at Q6_K (1.04 GB); token_embd (Q5_K in a Q5_K_M file,
    # 0.87 GB) in host memory. Priced before as two 16-bit tables (5.08 GB), Q5_K_M's 22.92 GB did not fit.
    qwen = load_model("qwen3.5-27b")
    table = 248320 * 5120
    linear = 27.78e9 - 2 * table
    est = {t: predict_memory(qwen, {"gguf_type": t, "parallel": 1}, RTX3090, 1, engine=ADAPTER)
           for t in ("Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0", "F16")}
    q5 = est["Q5_K_M"]
    assert q5.weights_gb == pytest.approx((linear * bytes_per_weight()["Q5_K_M"] + table * 210 / 256) / 1e9)  # 18.87
    assert est["Q6_K"].weights_gb == pytest.approx((linear + table) * 210 / 256 / 1e9)  # 21.75
    assert est["F16"].weights_gb == pytest.approx((linear + table) * 2 / 1e9)  # 53.02: an F16 file's head is F16
    assert "token embedding 0.87 GB in host memory" in q5.reason
    # what must fit: the weights, the workspace and one 2048-token slot with its recurrent state, in 24 GiB x
    # the adapter's share of the GPU
    need = sum(q5.detail.values())
    assert q5.budget_gb == pytest.approx(24 * 2**30 / 1e9 * ADAPTER.default_memory_fraction(1, 24 * 1024))
    assert need < q5.budget_gb < need + 4.04  # 4.04 GB: the 16-bit tables less the Q6_K head
    assert {t: e.fits for t, e in est.items()} == {"Q4_K_M": True, "Q5_K_M": True, "Q6_K": True, "Q8_0": False,
                                                  "F16": False}


def test_the_bundled_model_on_a_cpu_reads_its_linear_weights_and_head_per_token():
    # SmolLM2-135M Q4_1, tied: on a CPU the bytes a decode pass reads are the file's linear weights plus its head
    # (token_embd.weight at Q8_0, which the output layer uses: TENSOR_DUPLICATED finds it in the same CPU
    # buffer, src/llama-model-loader.cpp create_tensor), from the header; not a float32 embedding of
    # 49152 x 576 (113 MB, more than the whole file).
    smol, cpu = load_model(None), get_profile("cpu")
    tensors = gguf.GGUFReader(bundled_gguf_path()).tensors
    head = next(int(t.n_bytes) for t in tensors if t.name == "token_embd.weight")
    linear = sum(int(t.n_bytes) for t in tensors if t.name.startswith("blk.") and len(t.shape) == 2)
    k = ADAPTER.knobs({"gguf_type": "Q4_1", "parallel": 1}, on_gpu=False)
    read = target_pass(smol, k, cpu, seqs=1, tokens=1, context=0, eager=True).mem_s * CPU_BANDWIDTH_GBPS * 1e9
    assert read == pytest.approx(linear + head, rel=2e-3)  # 96.5 MB (the norms are priced as linear weights)
    assert read < 0.6 * (linear + smol.vocab * smol.hidden * 4)
    # in RAM the same: the head is the embedding, held once
    assert predict_memory(smol, {"gguf_type": "Q4_1"}, cpu, engine=ADAPTER).weights_gb * 1e9 == pytest.approx(read)
    # on a GPU the head is a copy of it there; the embedding itself stays on the host
    on_gpu = predict_memory(smol, {"gguf_type": "Q4_1"}, RTX3090, 1, engine=ADAPTER)
    assert on_gpu.weights_gb * 1e9 == pytest.approx(read) and "token embedding 0.03 GB in host memory" in on_gpu.reason


def test_estimate_fits_qwen35_27b_at_q5_k_m_on_a_3090_and_its_help_names_llamacpp():
    done = autotune("estimate", "--engine", "llamacpp", "--model", "qwen3.5-27b", "--gpu", "rtx-3090",
                    "--set", "gguf_type=Q5_K_M", "--top", "3", "--json")
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["configs"] and all(r["memory"]["fits"] and r["config"]["gguf_type"] == "Q5_K_M" for r in out["configs"])
    assert out["configs"][0]["memory"]["weights_gb"] == pytest.approx(18.87, abs=0.01)
    assert "--model qwen3.5-27b-Q5_K_M.gguf" in out["configs"][0]["launch"]
    shown = autotune("estimate", "--help")
    assert shown.returncode == 0 and "llamacpp" in shown.stdout


def test_estimate_set_gguf_type_changes_memory_speed_and_the_file_named():
    rows = {}
    for t in ("Q4_K_M", "Q8_0"):
        done = autotune("estimate", "--engine", "llamacpp", "--model", "qwen3-32b", "--gpu", "h100-sxm5",
                        "--top", "1", "--set", f"gguf_type={t}", "--set", "spec_type=none", "--json")
        assert done.returncode == 0, done.stderr
        row = json.loads(done.stdout)["configs"][0]
        assert row["config"]["gguf_type"] == t and f"--model qwen3-32b-{t}.gguf" in row["launch"]
        rows[t] = row
    assert rows["Q8_0"]["memory"]["weights_gb"] > rows["Q4_K_M"]["memory"]["weights_gb"] * 1.5
    assert rows["Q8_0"]["speed"]["single_tok_s"] < rows["Q4_K_M"]["speed"]["single_tok_s"]


# -- a real second GGUF ---------------------------------------------------------------------------------
def write_q8_0(source, target):
    """The GGUF at `source` with every quantized tensor dequantized and requantized to Q8_0 (gguf.quants),
    metadata and tokenizer copied, general.file_type saying Q8_0."""
    reader = gguf.GGUFReader(source)
    writer = gguf.GGUFWriter(target, reader.fields["general.architecture"].contents())
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key in ("general.architecture", "general.file_type"):
            continue  # the writer adds its own header, architecture and (below) the new type
        kind = field.types[0]
        items = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), kind, sub_type=items)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    q8 = gguf.GGMLQuantizationType.Q8_0
    for tensor in reader.tensors:
        kind, data = tensor.tensor_type, tensor.data
        if kind not in (gguf.GGMLQuantizationType.F32, q8):
            kind, data = q8, gguf.quants.quantize(gguf.quants.dequantize(data, tensor.tensor_type), q8)
        writer.add_tensor(tensor.name, np.asarray(data), raw_shape=data.shape, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def two_types(tmp_path_factory):
    """A directory of the bundled model twice: its Q4_1 file (a symlink) and a Q8_0 copy (about 5 s)."""
    directory = tmp_path_factory.mktemp("smollm2-gguf")
    (directory / "SmolLM2-135M-Instruct-Q4_1.gguf").symlink_to(bundled_gguf_path())
    write_q8_0(bundled_gguf_path(), directory / "SmolLM2-135M-Instruct-Q8_0.gguf")
    return directory


def test_types_come_from_the_headers_and_the_space_offers_exactly_those(two_types):
    q8 = two_types / "SmolLM2-135M-Instruct-Q8_0.gguf"
    assert read_header(q8)[:2] == ("llama", "Q8_0") and read_header(bundled_gguf_path())[:2] == ("llama", "Q4_1")
    assert {t.tensor_type.name for t in gguf.GGUFReader(q8).tensors} == {"Q8_0", "F32"}  # the blocks really changed
    space = plan.user_space(ADAPTER, None, [], str(two_types))
    param = space.params["gguf_type"]
    assert param.choices == ["Q4_1", "Q8_0"] and param.default == "Q8_0"  # the most precise file is the baseline
    assert space.defaults()["gguf_type"] == "Q8_0" and len(space.seed_configs()) >= 1
    # one file: its own type, nothing else (the bundled model, run without --model)
    for model in (None, str(bundled_gguf_path())):
        assert plan.user_space(ADAPTER, None, [], model).params["gguf_type"].choices == ["Q4_1"]
    # the model the predictions read: a directory of GGUF files has their shapes
    assert load_model(str(two_types)).layers == load_model(None).layers == 30
    # each type is priced at its own bytes: Q8_0's linear weights 34/32 against Q4_1's 20/32
    smol = load_model(str(two_types))
    a, b = (predict_memory(smol, {"gguf_type": t}, get_profile("cpu"), engine=ADAPTER).weights_gb
            for t in ("Q4_1", "Q8_0"))
    assert (b - a) * 1e9 == pytest.approx(smol.layers * smol.layer_params * (34 - 20) / 32)


def test_a_pinned_type_with_no_file_is_one_line_exit_2(two_types):
    done = autotune("estimate", "--engine", "llamacpp", "--model", two_types, "--gpu", "cpu",
                    "--set", "gguf_type=Q6_K")
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.strip() == (f"error: gguf_type Q6_K: no GGUF file of that type in {two_types} "
                                   "(its files are Q4_1, Q8_0)")


def test_a_header_without_a_file_type_is_refused_by_name(tmp_path):
    bare = tmp_path / "bare.gguf"
    writer = gguf.GGUFWriter(bare, "llama")
    writer.add_tensor("x.weight", np.zeros((4, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="no general.file_type"):
        read_header(bare)


@needs_server
def test_run_refuses_a_pinned_type_with_no_file_before_any_launch(two_types, tmp_path):
    run = [sys.executable, "-m", "autotune.cli", "run", "--engine", "llamacpp", "--model", str(two_types),
           "--set", "gguf_type=F16", "--trials", "1"]
    done = subprocess.run(run, capture_output=True, text=True, timeout=300, check=False,
                          env={**os.environ, "AUTOTUNE_STUDIES_DIR": str(tmp_path)})
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "gguf_type F16: no GGUF file of that type" in done.stderr and not list(tmp_path.iterdir())


@needs_server
def test_llama_server_launched_for_q8_0_serves_the_q8_0_file(two_types, tmp_path):
    q8 = two_types / "SmolLM2-135M-Instruct-Q8_0.gguf"
    server = launch(ADAPTER, {"gguf_type": "Q8_0", "threads": 1, "parallel": 1}, model=str(two_types),
                    log_path=tmp_path / "q8.log", timeout_s=120)
    try:
        assert server.argv[server.argv.index("--model") + 1] == str(q8)
        props = httpx.get(server.base_url + "/props", timeout=10).json()
        assert props["model_path"] == str(q8) and props["model_ftype"] == "Q8_0"
        r = httpx.post(server.base_url + "/v1/completions", timeout=120,
                       json={"prompt": "def add(a, b):", "max_tokens": 8, "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 8 and r.json()["choices"][0]["text"]
    finally:
        server.stop()
    assert "Q8_0" in (tmp_path / "q8.log").read_text()  # the server's own load log names the type


@needs_server
def test_llama_server_maps_the_weights_the_model_predicts_for_a_cpu(tmp_path):
    # llama-server's load log says what it holds (at verbosity 4, "trace"): run on the CPU (gpu_layers 0), one
    # mapped buffer of the file's tensors, the tied head not a second time (TENSOR_DUPLICATED finds the
    # embedding in the same CPU buffer)
    server = launch(ADAPTER, {"gguf_type": "Q4_1", "threads": 1, "parallel": 1, "gpu_layers": 0, "verbosity": 4},
                    log_path=tmp_path / "q4_1.log", timeout_s=120)
    server.stop()
    buffers = re.findall(r"(\S+) model buffer size = +([\d.]+) MiB", (tmp_path / "q4_1.log").read_text())
    predicted = predict_memory(load_model(None), {"gguf_type": "Q4_1"}, get_profile("cpu"), engine=ADAPTER)
    assert [name for name, _ in buffers] == ["CPU_Mapped"]
    assert float(buffers[0][1]) * 2**20 == pytest.approx(predicted.weights_gb * 1e9, rel=5e-3)  # 92.10 MiB
