"""Search spaces: YAML loading, conditional parameters, user narrowing, hardware conditions."""
import dataclasses

import optuna
import pytest

from autotune.engines import get_adapter
from autotune.hardware import get_profile, planned
from autotune.predict import load_model
from autotune.space import SpaceError, load_space, parse_set_options, parse_space
from autotune.space.constraints import ModelShape, hardware_violations, restrict_space

optuna.logging.set_verbosity(optuna.logging.WARNING)


def sample(space, n=60, seed=0):
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=seed))
    configs = []
    for _ in range(n):
        trial = study.ask()
        configs.append((space.suggest(trial), trial))
        study.tell(trial, 0.0)
    return configs


def test_conditional_params_only_when_active():
    space = load_space("embedded")
    seen_drafters = set()
    for config, trial in sample(space):
        seen_drafters.add(config["drafter"])
        drafting = config["drafter"] != "none"
        assert ("draft_length" in config) == drafting
        assert ("draft_length" in trial.params) == drafting  # Optuna was never asked for an inactive one
        assert ("early_exit_layers" in config) == (config["drafter"] == "early_exit")
        assert ("ngram_max" in config) == (config["drafter"] == "ngram")
        if config["drafter"] == "ngram":
            assert config["ngram_min"] <= config["ngram_max"]
    assert {"none", "ngram", "early_exit"} <= seen_drafters


def test_pins_and_narrowing_apply():
    space = load_space("embedded").narrowed(parse_set_options(
        ["drafter=ngram", "draft_length=2..5", "verify_slots=2,8", "dtype=float32", "cuda_graph_batch_sizes=[1,2]"]))
    for config, trial in sample(space, 30):
        assert config["drafter"] == "ngram" and "drafter" not in trial.params  # pinned: not Optuna's to choose
        assert 2 <= config["draft_length"] <= 5
        assert config["verify_slots"] in (2, 8)
        assert config["cuda_graph_batch_sizes"] == [1, 2]
    # Seeds outside the narrowing are dropped; pins override what a seed says.
    assert all(c["drafter"] == "ngram" and c["verify_slots"] in (2, 8) for c in space.seed_configs())
    narrowed = load_space("embedded").narrowed({"prefill_ubatch": {"low": 64, "high": 128}, "quantization": ["int8"]})
    assert narrowed.params["quantization"].fixed == "int8" and narrowed.params["prefill_ubatch"].high == 128


@pytest.mark.parametrize("sets, message", [
    (["nope=1"], "unknown parameter 'nope'"),
    (["drafter=medusa"], "'medusa' is not one of"),
    (["verify_slots=8..2"], "empty range"),
    (["verify_slots=many"], "is not an int"),
    (["verify_slots"], "expected name=value"),
])
def test_bad_narrowing_is_one_clear_line(sets, message):
    with pytest.raises(SpaceError, match=message) as e:
        load_space("embedded").narrowed(parse_set_options(sets))
    assert "\n" not in str(e.value)


def test_bad_space_files_rejected():
    with pytest.raises(SpaceError, match="declared before"):
        parse_space({"parameters": {"k": {"type": "int", "low": 1, "high": 4, "when": {"algo": ["x"]}},
                                    "algo": {"type": "categorical", "choices": ["x"]}}})
    with pytest.raises(SpaceError, match="needs 'type'"):
        parse_space({"parameters": {"k": {"low": 1}}})
    with pytest.raises(SpaceError, match="outside"):
        parse_space({"parameters": {"k": {"type": "int", "low": 1, "high": 4, "default": 9}}})


def test_seeds_start_with_engine_defaults():
    space = load_space("embedded")
    seeds = space.seed_configs()
    assert seeds[0] == space.defaults() and seeds[0]["drafter"] == "none"
    assert any(s["drafter"] == "ngram" for s in seeds[1:])


def test_hardware_conditions():
    shape = ModelShape.of(load_model(None))  # the bundled SmolLM2: 9 attention heads
    sglang, vllm, embedded = get_adapter("sglang"), get_adapter("vllm"), get_adapter("embedded")
    a100, h100 = planned(get_profile("a100-80gb-sxm4")), planned(get_profile("h100-sxm5"))
    assert hardware_violations({"quantization": "fp8"}, h100, shape, adapter=sglang) == []
    assert "FP8" in hardware_violations({"quantization": "fp8"}, a100, shape, adapter=sglang)[0]
    # Marlin weight-only on Ampere
    assert hardware_violations({"quantization": "w8a16_fp8"}, a100, shape, adapter=sglang) == []
    eight = dataclasses.replace(h100, gpus=h100.gpus * 8)
    assert any("GPU count" in v for v in hardware_violations({"tp_size": 2}, h100, shape, adapter=sglang))
    assert any("attention heads" in v for v in hardware_violations({"tp_size": 2}, eight, shape, adapter=sglang))
    three = dataclasses.replace(h100, gpus=h100.gpus * 3)
    assert hardware_violations({"tp_size": 3}, three, shape, adapter=sglang) == []
    assert any("GPU count" in v for v in hardware_violations({"tensor_parallel_size": 2}, three, shape, adapter=vllm))
    assert hardware_violations({"tp_size": 2}, three, shape, adapter=vllm) == []  # not vLLM's TP key
    assert "CUDA" in hardware_violations({"cuda_graph_batch_sizes": [1, 2]}, None, shape, adapter=embedded)[0]
    assert "runs on the CPU" in hardware_violations({"quantization": "gguf"}, h100, shape, adapter=embedded)[0]
    assert hardware_violations({"quantization": "gguf"}, None, shape, adapter=embedded) == []
    assert "gguf" not in restrict_space(load_space("embedded"), h100, shape, None,
                                        adapter=embedded).params["quantization"].choices
    # On a CPU machine the space never offers what cannot run there.
    space = restrict_space(load_space("embedded"), None, shape, draft_model=None, adapter=embedded)
    assert "draft_model" not in space.params["drafter"].choices
    assert space.params["cuda_graph_batch_sizes"].fixed == []
    assert space.params["compile"].fixed == "none"
    assert "gguf" in space.params["quantization"].choices
