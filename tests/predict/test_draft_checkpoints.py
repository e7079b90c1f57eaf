"""Draft checkpoints by what they are (issue 31 points 2 and 6): tiny real checkpoints (config.json and a
safetensors header, or a GGUF header) decide which drafters each engine is offered, as each engine's own code
maps them; a hub id is offered only as its cached config (or --draft-kind) says; SGLang's NGRAM page rule;
llama.cpp's draft types; one ranked row per launch line."""
import json
import subprocess
import sys

import gguf
import pytest
from conftest import write_gguf

from autotune.engines import get_adapter
from autotune.hardware import get_profile, planned, probe
from autotune.predict import DraftCheckpoint, load_model, rank_configs, read_draft
from autotune.predict.rank import launch_command
from autotune.space import load_space
from autotune.space.constraints import ModelShape, restrict_space
from tests.space.test_model_aware_space import LLAMA_8B, checkpoint

SGLANG, VLLM, LLAMACPP = get_adapter("sglang"), get_adapter("vllm"), get_adapter("llamacpp")
H100 = get_profile("h100-sxm5")
HEAD = {**LLAMA_8B, "num_hidden_layers": 1}
FC_EAGLE1 = {"fc.weight": [4096, 8192]}  # EAGLE-1: fc over 2 x hidden (token embedding + feature)


def drafts(tmp_path) -> dict:
    """One directory per kind of draft checkpoint people publish, laid out as they are released."""
    return {
        # yuhuili/EAGLE-LLaMA3-Instruct-8B: the authors' EAGLE-1 release names itself LlamaForCausalLM
        "eagle1-authors": checkpoint(tmp_path / "authors-head", {**HEAD, "architectures": ["LlamaForCausalLM"]}, FC_EAGLE1),
        # lmsys/sglang-EAGLE-LLaMA3-Instruct-8B: the same head as SGLang names it
        "eagle1-sglang": checkpoint(tmp_path / "sglang-head", {**HEAD, "architectures": ["LlamaForCausalLMEagle"]},
                                    FC_EAGLE1),
        "eagle3": checkpoint(tmp_path / "e3-head", {**HEAD, "architectures": ["LlamaForCausalLMEagle3"],
                                                    "draft_vocab_size": 32000}),
        "dflash": checkpoint(tmp_path / "df-head", {**HEAD, "num_hidden_layers": 5, "architectures": ["DFlashDraftModel"],
                                                    "block_size": 16, "dflash_config": {"target_layer_ids": [1, 8, 15]}}),
        "standalone": checkpoint(tmp_path / "small", {**LLAMA_8B, "num_hidden_layers": 16, "hidden_size": 2048}),
        # a standalone model whose directory name says eagle3: vLLM re-detects draft_model as eagle3 by name
        "standalone-named-eagle3": checkpoint(tmp_path / "llama-eagle3-distilled", {**LLAMA_8B, "num_hidden_layers": 16,
                                                                                     "hidden_size": 2048}),
    }


def offered(adapter, draft, hw=None, shape_model="llama-3.1-8b") -> list:
    key = adapter.facts.draft_keys[0]
    checkpoint = read_draft(str(draft)) if draft else None
    shape = ModelShape.of(load_model(shape_model), checkpoint)
    space = restrict_space(load_space(adapter.name), hw if hw is not None else planned(H100), shape,
                           str(draft) if draft else None, adapter=adapter)
    return space.params[key].choices


def test_each_engine_offers_what_its_code_runs_the_checkpoint_as(tmp_path):
    d = drafts(tmp_path)
    vllm = {name: offered(VLLM, path) for name, path in d.items()}
    # vLLM 0.32: method eagle prefixes "Eagle" (EagleLlamaForCausalLM: registered); an SGLang-named head becomes
    # EagleLlamaForCausalLMEagle, which is not; draft_model is re-detected by name, so a standalone model named
    # *eagle3* would run as eagle3: not offered
    assert vllm == {"eagle1-authors": ["none", "ngram", "eagle"], "eagle1-sglang": ["none", "ngram"],
                    "eagle3": ["none", "ngram", "eagle3"], "dflash": ["none", "ngram", "dflash"],
                    "standalone": ["none", "ngram", "draft_model"], "standalone-named-eagle3": ["none", "ngram"]}
    sglang = {name: offered(SGLANG, path) for name, path in d.items()}
    # SGLang loads the draft's own architecture: the authors' LlamaForCausalLM would load as a whole Llama
    assert sglang == {"eagle1-authors": ["none", "NGRAM"], "eagle1-sglang": ["none", "EAGLE", "NGRAM"],
                      "eagle3": ["none", "EAGLE3", "NGRAM"], "dflash": ["none", "NGRAM", "DFLASH"],
                      "standalone": ["none", "STANDALONE", "NGRAM"], "standalone-named-eagle3": ["none", "STANDALONE", "NGRAM"]}
    # NEXTN drafts with the target's own MTP layers, whatever --draft-model is given beside it
    argv, _ = SGLANG.command({"speculative_algorithm": "NEXTN"}, model="/m/target", draft_model=str(d["eagle3"]),
                             host="127.0.0.1", port=1)
    assert argv[argv.index("--speculative-draft-model-path") + 1] == "/m/target"
    # the refusals name the engine's own reason
    # a DFlash config under an EAGLE-3 name: vLLM's own words for it
    assert "['DFlashLlamaForCausalLMEagle3'], which are not supported" in VLLM.draft_problem(
        {"speculative_method": "dflash"}, DraftCheckpoint("x", "dflash", ("LlamaForCausalLMEagle3",)))
    assert "as eagle3" in VLLM.draft_problem({"speculative_method": "draft_model"}, read_draft(str(d["standalone-named-eagle3"])))


def gguf_file(path, arch: str, file_type: bool = True):
    """A GGUF header of `arch` with one tensor, as convert_hf_to_gguf.py writes (general.file_type F16), or
    without a file type, as scripts/distill_draft_model.py writes its draft."""
    return write_gguf(path, arch, gguf.LlamaFileType.MOSTLY_F16 if file_type else None)


def test_llamacpp_draft_types_follow_the_draft_gguf(tmp_path):
    cpu = probe("cpu")
    draft_types = {"draft-simple", "draft-eagle3", "draft-dflash", "draft-mtp"}
    plain = offered(LLAMACPP, None, cpu, "smollm2-135m")
    # no draft: the n-gram types of build 11434 (ngram-map-k4v and ngram-cache too), none that needs a model;
    # draft-mtp needs NextN layers the bundled model has not
    assert plain == ["none", "ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-cache"]
    for arch, wanted in (("dflash", "draft-dflash"), ("eagle3", "draft-eagle3"), ("llama", "draft-simple")):
        choices = offered(LLAMACPP, gguf_file(tmp_path / f"{arch}.gguf", arch), cpu, "smollm2-135m")
        assert set(choices) & draft_types == {wanted}, arch
    distilled = gguf_file(tmp_path / "draft.gguf", "llama", file_type=False)
    assert read_draft(str(distilled)).kind == "standalone"
    # -md loads a GGUF file: an HF directory is no draft for llama-server
    hf = checkpoint(tmp_path / "df-head", {**HEAD, "architectures": ["DFlashDraftModel"]})
    assert not set(offered(LLAMACPP, hf, cpu, "smollm2-135m")) & draft_types
    # draft-mtp for a target with MTP layers; its draft length is a knob; the launch line carries no -md
    assert "draft-mtp" in offered(LLAMACPP, None, planned(H100), "qwen3.5-27b")
    argv, _ = LLAMACPP.command({"spec_type": "draft-dflash", "spec_draft_n_max": 8}, model=None,
                               draft_model=str(tmp_path / "dflash.gguf"), host="127.0.0.1", port=1)
    assert argv[argv.index("--spec-draft-model") + 1] == str(tmp_path / "dflash.gguf")
    knobs = LLAMACPP.knobs({"spec_type": "draft-dflash", "spec_draft_n_max": 8})
    assert (knobs.drafter, knobs.draft_steps, knobs.verify_tokens) == ("dflash", 1, 9)  # one pass drafts the block


def test_a_hub_id_is_offered_only_as_its_config_says(tmp_path, monkeypatch):
    hub = "z-lab/Qwen3-8B-DFlash-b16"
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(ValueError, match="--draft-kind"):
        read_draft(hub)  # nothing cached: the user is asked, never every family
    assert read_draft(hub, "dflash").kind == "dflash"
    # once its config is fetched (huggingface_hub's cache layout), it is read like a directory
    repo = tmp_path / "hub" / "models--z-lab--Qwen3-8B-DFlash-b16"
    checkpoint(repo / "snapshots" / "abc123", {**HEAD, "architectures": ["DFlashDraftModel"], "block_size": 16})
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    found = read_draft(hub)
    assert (found.kind, found.architectures, found.files) == ("dflash", ("DFlashDraftModel",),
                                                               str(repo / "snapshots" / "abc123"))
    with pytest.raises(ValueError, match="says it is dflash"):
        read_draft(hub, "eagle3")


def estimate(*args, env=None):
    cmd = [sys.executable, "-m", "autotune.cli", "estimate", "--gpu", "h100-sxm5", "--model", "qwen3-8b", *args]
    return subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=180, env=env)


def test_estimate_with_a_hub_draft(tmp_path):
    import os

    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path)}
    asked = estimate("--draft-model", "z-lab/Qwen3-8B-DFlash-b16", env=env)
    assert asked.returncode == 2 and len(asked.stderr.strip().splitlines()) == 1 and "--draft-kind" in asked.stderr
    out = estimate("--draft-model", "z-lab/Qwen3-8B-DFlash-b16", "--draft-kind", "dflash", "--engine", "vllm",
                   "--top", "40", "--json", env=env)
    assert out.returncode == 0, out.stderr
    methods = {r["config"].get("speculative_method") for r in json.loads(out.stdout)["configs"]}
    assert "dflash" in methods and methods <= {"none", "ngram", "dflash"}  # never eagle, eagle3 nor draft_model


def test_sglang_ngram_tree_with_pages_needs_flashinfer():
    ngram = {"speculative_algorithm": "NGRAM", "page_size": 16}
    for backend in ("fa3", "triton", None):
        assert any("flashinfer" in p for p in SGLANG.check({**ngram, "attention_backend": backend})), backend
    assert not SGLANG.check({**ngram, "attention_backend": "flashinfer"})
    assert not SGLANG.check({**ngram, "page_size": 1, "attention_backend": "fa3"})
    assert not SGLANG.check({**ngram, "attention_backend": "fa3", "speculative_ngram_max_bfs_breadth": 1})  # a chain


def test_ranked_rows_are_distinct_launch_lines():
    # on a GPU with FP8 units vLLM runs --quantization fp8 for both fp8 and weight-only w8a16_fp8: two configs the
    # rules accept and effective() tells apart, one launch line
    both = [{"tensor_parallel_size": 1, "quantization": q} for q in ("fp8", "w8a16_fp8")]
    assert len({launch_command(VLLM, c, "M") for c in both}) == 1
    assert VLLM.effective(both[0]) != VLLM.effective(both[1])
    ranked = rank_configs(load_space("vllm"), load_model("llama-3.1-8b"), H100, 1, top=200, engine=VLLM)
    lines = [launch_command(VLLM, c, "M") for c, _ in ranked]
    assert len(ranked) > 10 and len(lines) == len(set(lines))
