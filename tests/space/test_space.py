"""Search spaces: YAML loading, conditional parameters, user narrowing, hardware conditions."""
import dataclasses

import optuna
import pytest

from autotune.engines import get_adapter
from autotune.hardware import get_profile, planned
from autotune.predict import load_model
from autotune.space import SpaceError, load_space, parse_set_options, parse_space
from autotune.space.constraints import ModelShape, hardware_violations, restrict_space
from autotune.space.fit import fit_space

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
    space = fit_space(load_space("embedded"), None, 4)  # no machine facts: the CPU's seeds
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


# -- fitted to the machine and the load (issue 16 point 1) -----------------------------------------------
def test_cuda_space_follows_the_load_and_the_gpus_units():
    h200 = planned(get_profile("h200-sxm"))
    for concurrency, sizes in ((1, [1]), (4, [1, 2, 4]), (6, [1, 2, 4, 8]), (8, [1, 2, 4, 8])):
        space = fit_space(load_space("embedded"), h200, concurrency)
        assert space.params["cuda_graph_batch_sizes"].choices == [[], sizes]
        assert space.params["verify_slots"].high == max(concurrency, 4)  # the defaults (4 slots) stay in the space
        assert set(space.params["compile"].choices) >= {"none", "inductor"}
        assert space.params["threads"].fixed is None  # a CPU-only knob: torch's default on a GPU machine
        seeds = space.seed_configs()
        assert seeds[3] == space.defaults()  # after the fitted seeds (validation measures the defaults anyway)
        fast = [s for s in seeds if s["compile"] == "inductor"]
        assert fast == seeds[:3]
        assert [s["drafter"] for s in fast] == ["none", "ngram", "ngram"]  # graphs + inductor plain, then n-gram
        assert all(s["cuda_graph_batch_sizes"] == sizes and s["verify_slots"] == concurrency
                   and s["dtype"] == "bfloat16" for s in fast)
        assert all(s["quantization"] != "gguf" for s in seeds)  # the CPU kernel's seeds are not queued
    # A planned GPU whose sheet lists no bf16 Tensor Core peak is not offered bfloat16.
    old = planned(dataclasses.replace(get_profile("h200-sxm"), peak_tflops={"fp32": 14, "fp16": 28}))
    space = fit_space(load_space("embedded"), old, 4)
    assert space.params["dtype"].choices == ["float32", "float16"]
    assert all(s["dtype"] != "bfloat16" for s in space.seed_configs())  # outside the space: not queued


def test_cpu_space_keeps_threads_and_gguf_and_turns_gpu_knobs_off():
    from autotune.hardware import probe

    cpu = probe("cpu")
    space = fit_space(load_space("embedded"), cpu, 4)
    assert space.params["compile"].fixed == "none" and space.params["cuda_graph_batch_sizes"].fixed == []
    assert not space.params["threads"].pinned
    native_bf16 = bool({"avx512_bf16", "amx_bf16"} & set(cpu.cpu.isa_flags))  # what this machine's probe says
    assert ("bfloat16" in space.params["dtype"].choices) == native_bf16
    seeds = space.seed_configs()
    assert {"quantization": "gguf"}.items() <= seeds[3].items()
    assert all(s["compile"] == "none" and s["cuda_graph_batch_sizes"] == [] for s in seeds)


def test_user_narrowing_wins_over_machine_and_load_rules():
    h200 = planned(get_profile("h200-sxm"))
    narrowed = load_space("embedded").narrowed(parse_set_options(
        ["cuda_graph_batch_sizes=[[1],[1,2]]", "verify_slots=2..16", "compile=aot_eager"]))
    space = fit_space(narrowed, h200, 4)
    assert space.params["cuda_graph_batch_sizes"].choices == [[1], [1, 2]]
    assert (space.params["verify_slots"].low, space.params["verify_slots"].high) == (2, 16)
    assert all(s["compile"] == "aot_eager" and s["cuda_graph_batch_sizes"] in ([1], [1, 2])
               for s in space.seed_configs())
    # A pinned GPU knob on a CPU machine is left for the trial to reject, with its reason.
    assert fit_space(load_space("embedded").narrowed({"compile": "inductor"}), None, 4).params["compile"].fixed == "inductor"


def test_machine_and_load_keys_are_checked():
    for data, message in (
            ({"parameters": {"k": {"type": "int", "low": 1, "high": 4, "device": "tpu"}}}, "device must be"),
            ({"parameters": {"k": {"type": "float", "low": 1, "high": 4, "load": True}}}, "load: true"),
            ({"parameters": {"d": {"type": "categorical", "choices": ["a"], "units": {"b": "bf16"}}}}, "units"),
            ({"parameters": {"k": {"type": "int", "low": 1, "high": 4}}, "seeds": [{"k": "load"}]}, "does not follow"),
            ({"parameters": {"k": {"type": "int", "low": 1, "high": 4}}, "seeds": [{"device": "gpu"}]}, "device")):
        with pytest.raises(SpaceError, match=message):
            parse_space(data)


def test_the_measured_h200_fits_like_its_profile():
    """The real H200's probe output (tests/fixtures/hardware, the same files as the H200 runs) plans the
    same space as `--gpu h200-sxm`: the facts come from the machine, not from the name."""
    from pathlib import Path

    from autotune.hardware import classify_from_fixture

    measured = classify_from_fixture(Path(__file__).parents[1] / "fixtures" / "hardware" / "h200-sxm-1gpu")
    assert measured.profile.name == "h200-sxm"
    fitted = [fit_space(load_space("embedded"), hw, 4) for hw in (measured, planned(get_profile("h200-sxm")))]
    assert fitted[0].params == fitted[1].params and fitted[0].seed_configs() == fitted[1].seed_configs()
    assert fitted[0].params["cuda_graph_batch_sizes"].choices == [[], [1, 2, 4]]
