"""The SGLang adapter against the version installed: the schema captured from SGLang 0.5.17's own parser (the
release that pins the H200's torch 2.11.0) beside 0.5.23's (the data's), the one the adapter picks, flags renamed
between them, and what the search space emits passing each version's parser as captured. Parser-level: no GPU."""
import json

import pytest

from autotune.engines import get_adapter
from autotune.engines.base import SCHEMA_DIR, config_args, load_schema, schema_errors
from autotune.engines.hf_model import bundled_hf_dir
from autotune.engines.sglang import NEVER_IMPORTED, SCHEMA_VERSIONS, schema_version
from autotune.space import load_space


def adapter_at(version: str | None):
    adapter = get_adapter("sglang")
    adapter.found_version = version  # what the entry's Python reports as installed
    return adapter


def test_the_installed_versions_schema_or_the_newest_not_newer():
    assert SCHEMA_VERSIONS == ("0.5.17", "0.5.23")
    assert schema_version(None) == "0.5.23"  # none here: the data's pin
    assert schema_version("0.5.17") == "0.5.17" and schema_version("0.5.23") == "0.5.23"
    assert schema_version("0.5.19") == "0.5.17"  # flags 0.5.23 added are not offered to 0.5.19
    assert schema_version("0.6.1") == "0.5.23"
    assert schema_version("0.5.10") == "0.5.17"  # older than any captured: the oldest
    assert adapter_at("0.5.17").version == "0.5.17" and adapter_at(None).version == "0.5.23"


def test_both_schemas_were_captured_from_the_parsers():
    for version, options in (("0.5.17", 474), ("0.5.23", 531)):
        schema = json.loads((SCHEMA_DIR / f"sglang-{version}.json").read_text())
        assert schema["version"] == version and len(schema["options"]) == options
        assert schema["captured_from"].startswith("sglang.srt.server_args.ServerArgs.add_cli_args")
    old, new = load_schema("sglang", "0.5.17")["by_flag"], load_schema("sglang", "0.5.23")["by_flag"]
    assert "--attn-dp-size" in new and "--attn-dp-size" not in old  # added after 0.5.17
    assert old["--cuda-graph-max-bs"]["deprecated"] and "--cuda-graph-max-bs" not in new
    assert "tc_piecewise" in old["--cuda-graph-backend-prefill"]["choices"]
    assert "tc_piecewise" not in new["--cuda-graph-backend-prefill"]["choices"]


@pytest.mark.parametrize("version", SCHEMA_VERSIONS)
def test_each_rename_names_an_old_flag_gone_or_deprecated_and_replacements_that_take_its_value(version):
    """What scripts/capture_engine_schema.py checks against the live parser, here against what it captured."""
    schema = load_schema("sglang", version)
    assert len(schema["renames"]) == 12
    for rename in schema["renames"]:
        old = schema["by_flag"].get(rename["old"])
        assert old is None or old["deprecated"], rename["old"]
        for flag in rename["new"]:
            option = schema["by_flag"][flag]
            assert not option["deprecated"]
            if "value" in rename:
                assert rename["value"] in option["choices"], (flag, rename["value"])


def test_renamed_flags_are_translated_for_either_version():
    line = ["--model-path", "/m", "--cuda-graph-max-bs", "16", "--disable-piecewise-cuda-graph", "--stream-output"]
    for version in SCHEMA_VERSIONS:
        adapter = adapter_at(version)
        args, notes = adapter.translate_renamed(line)
        assert args == ["--model-path", "/m", "--cuda-graph-max-bs-decode", "16", "--cuda-graph-backend-prefill",
                        "disabled", "--incremental-streaming-output"]
        assert len(notes) == 3 and schema_errors(args, load_schema("sglang", version)) == []
    # untranslated, 0.5.23 refuses the 0.5.17 aliases and names why
    errors = schema_errors(line, load_schema("sglang", "0.5.23"))
    assert errors[0].startswith("--cuda-graph-max-bs does not exist in sglang 0.5.23")
    assert errors[1].startswith("--disable-piecewise-cuda-graph does not exist in sglang 0.5.23")


def _one_change_configs(space) -> list[dict]:
    """The space's defaults changed one parameter at a time (every choice, both ends of a range), and its seeds."""
    configs = [space.complete(seed) for seed in space.seeds]
    for name, param in space.params.items():
        values = param.choices if param.choices is not None else [param.low, param.high]
        for value in values:
            config = space.complete({name: value})
            if space.active(param, config):
                configs.append(config)
    return configs


@pytest.mark.parametrize("version", SCHEMA_VERSIONS)
def test_every_choice_of_the_space_emits_flags_the_version_takes(version):
    adapter, space = adapter_at(version), load_space("sglang")
    configs = _one_change_configs(space)
    assert len(configs) > 40
    for config in configs:
        argv, _ = adapter.command(config, model="/models/target", draft_model="/models/draft", host="127.0.0.1",
                                  port=30000)
        assert schema_errors(adapter.engine_args(argv), load_schema("sglang", version)) == [], config
    # the current spelling of a dest, never its deprecated alias (0.5.17 has both --cuda-graph-max-bs-decode and
    # --cuda-graph-max-bs)
    argv, _ = adapter.command({"cuda_graph_max_bs_decode": 32}, model="/m", draft_model=None, host="h", port=1)
    assert argv[-2:] == ["--cuda-graph-max-bs-decode", "32"]


def test_a_flag_the_installed_version_lacks_is_refused_in_one_line():
    with pytest.raises(ValueError, match="attn_dp_size is not a sglang 0.5.17 option"):
        config_args({"attn_dp_size": 2}, load_schema("sglang", "0.5.17"))
    assert config_args({"attn_dp_size": 2}, load_schema("sglang", "0.5.23")) == ["--attn-dp-size", "2"]


def test_a_local_checkpoint_launches_offline(tmp_path):
    adapter = adapter_at("0.5.17")
    _, env = adapter.command({}, model=str(tmp_path), draft_model=None, host="127.0.0.1", port=1)
    assert env == {"HF_HUB_OFFLINE": "1"}
    _, env = adapter.command({"quantization": "w8a16_fp8"}, model="org/hub-model", draft_model=None, host="h", port=1)
    assert env == {"SGLANG_FORCE_FP8_MARLIN": "1"}


def test_with_no_model_given_the_bundled_models_checked_hf_copy_is_served():
    """`autotune run --engine sglang` with no --model (on the H200 SGLang was launched without --model-path, so
    every trial crashed) serves the bundled model's copy, as vLLM does, and reads its tokenizer."""
    adapter = adapter_at("0.5.17")
    adapter.installed = lambda: True  # SGLang runs only on a GPU: what is tested is the command built for it
    argv, env = adapter.command({}, model=None, draft_model=None, host="127.0.0.1", port=1)
    copy = str(bundled_hf_dir(adapter.python))
    assert argv[argv.index("--model-path") + 1] == copy and env == {"HF_HUB_OFFLINE": "1"}
    assert adapter.preset_model("smollm2-135m", "HuggingFaceTB/SmolLM2-135M-Instruct", "smollm2-135m") == copy
    assert adapter.tokenizer(None).encode("The capital of France is") == adapter.tokenizer(copy).encode(
        "The capital of France is") != []


def test_readiness_acceptance_and_bundle_drops():
    adapter = adapter_at("0.5.17")
    # 503 while the server starts, then one generated token (http_server.py health_generate)
    assert adapter.health_url("http://127.0.0.1:30000/") == "http://127.0.0.1:30000/health_generate"
    assert adapter.facts.spec_gauges == ("sglang:spec_accept_length", "sglang:spec_accept_rate")
    assert "--enable-metrics" in adapter.command({}, model="/m", draft_model=None, host="h", port=1)[0]
    # the CUDA 12 flavor of cutlass-dsl is left out only for a CUDA 13 target
    assert "nvidia-cutlass-dsl-libs-cu12" in adapter.bundle_drops(13)
    assert "nvidia-cutlass-dsl-libs-cu12" not in adapter.bundle_drops(12)
    assert set(NEVER_IMPORTED) <= set(adapter.bundle_drops(12)) and all(NEVER_IMPORTED.values())
