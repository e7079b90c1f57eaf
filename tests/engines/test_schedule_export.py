"""A draft-length schedule exported to every engine (issue 34 point 4): each adapter's schedule_args renders it to a
command its own parser accepts, the values it carries are the schedule's, and it says what the engine cannot
express exactly when the engine loses something.

vLLM: the installed vLLM's parser and config checks (EngineArgs.create_engine_config) take the command, and vLLM's
own per-batch lookup (build_dynamic_sd_schedule_lookup, what its scheduler runs) gives every batch size the
schedule's length; live, the CPU build drafts the schedule's length at each batch size (/metrics). SGLang: both
captured schemas (0.5.17 and 0.5.23) take the command, and the tier file read as
SGLang reads it (the largest key at or below the batch padded to a CUDA-graph size) gives the schedule's lengths.
llama.cpp: its captured schema. The embedded engine: its flag schema, and the file it is pointed at loads back as
the schedule.
"""
import json
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from autotune.bench import server_metrics
from autotune.embedded.draft_schedule import DraftSchedule
from autotune.engines import get_adapter
from autotune.engines.base import flag_groups, load_schema, schema_errors
from autotune.engines.hf_model import bundled_hf_dir
from autotune.engines.launcher import launch
from autotune.engines.sglang import SCHEMA_VERSIONS as SGLANG_VERSIONS

# fitted-looking: long drafts single-stream, shorter under load, off at 9 streams and beyond
RAMP = DraftSchedule(drafter="ngram", rows=[{"max_batch": 1, "draft_length": 8}, {"max_batch": 4, "draft_length": 4},
                                            {"max_batch": 8, "draft_length": 2}, {"max_batch": 16, "draft_length": 0}])
ADDRESS = {"host": "127.0.0.1", "port": 8000}


def flag_value(argv: list[str], name: str) -> str | None:
    return next((values[0] for _, flag, values in flag_groups(argv) if flag == name and values), None)


# -- vLLM --------------------------------------------------------------------------------------------
VLLM = get_adapter("vllm")
NGRAM = {"speculative_method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4,
         "max_num_seqs": 32, "enforce_eager": True}
LOOKUP = """import json, sys
from vllm.v1.spec_decode.dynamic.utils import build_dynamic_sd_schedule_lookup
spec, seqs = json.loads(sys.argv[1]), int(sys.argv[2])
print(json.dumps(build_dynamic_sd_schedule_lookup(spec["num_speculative_tokens_per_batch_size"], seqs,
                                                  spec["num_speculative_tokens"])))"""


@pytest.mark.skipif(not VLLM.installed(), reason="vLLM not installed: bash setup.sh vllm")
def test_vllm_runs_the_schedule_as_its_per_batch_size_speculative_config(tmp_path):
    argv, _, rendering = VLLM.scheduled_command(NGRAM, RAMP, model=str(bundled_hf_dir(VLLM.python)), draft_model=None,
                                                directory=tmp_path, **ADDRESS)
    assert VLLM.validate_flags(argv) == []  # the schema, then vLLM's own parser and create_engine_config()
    spec = json.loads(flag_value(argv, "--speculative-config"))
    assert spec["num_speculative_tokens_per_batch_size"] == [[1, 1, 8], [2, 4, 4], [5, 8, 2], [9, 16, 0]]
    assert spec["num_speculative_tokens"] == 8 and spec["method"] == "ngram"
    assert rendering.cannot_express == ()
    # vLLM's own expansion, the lookup its scheduler indexes by the step's batch size, up to max_num_seqs
    done = subprocess.run([VLLM.python, "-c", LOOKUP, json.dumps(spec), str(NGRAM["max_num_seqs"])],
                          capture_output=True, text=True, timeout=300, check=True)
    lookup = json.loads(done.stdout.strip().splitlines()[-1])
    assert lookup[1:] == [RAMP.length_for(b) for b in range(1, NGRAM["max_num_seqs"] + 1)]


@pytest.mark.slow
@pytest.mark.skipif(not VLLM.installed(), reason="vLLM not installed: bash setup.sh vllm")
def test_vllm_drafts_the_schedules_length_at_each_batch_size_live(tmp_path):
    """The CPU build serving a schedule: a draft model that is the target itself (float32, greedy) drafts every step,
    so /metrics' drafted tokens per draft are the length the step ran. One request alone runs batch 1's 2 tokens,
    where num_speculative_tokens is the schedule's 5 (a vLLM that ignored the schedule would draft 5); four at once
    also run steps of 2-4 requests, which draft 5."""
    schedule = DraftSchedule(drafter="draft_model", rows=[{"max_batch": 1, "draft_length": 2},
                                                          {"max_batch": 4, "draft_length": 5}])
    config = {"speculative_method": "draft_model", "num_speculative_tokens": 3, "enforce_eager": True,
              "dtype": "float32", "threads": 1, "cpu_kvcache_space": 1, "max_num_seqs": 4}
    rendering = VLLM.schedule_args(config, schedule)
    draft = str(bundled_hf_dir(VLLM.python))
    server = launch(VLLM, {**config, **rendering.config}, draft_model=draft, log_path=tmp_path / "server.log",
                    timeout_s=300)
    try:
        spec = json.loads(server.argv[server.argv.index("--speculative-config") + 1])
        assert spec["num_speculative_tokens_per_batch_size"] == [[1, 1, 2], [2, 4, 5]]
        model = httpx.get(server.base_url + "/v1/models", timeout=10).json()["data"][0]["id"]

        def drafted_per_step(prompts: list[str]) -> float:
            before = server_metrics.scrape(server.base_url)
            with ThreadPoolExecutor(len(prompts)) as pool:
                replies = list(pool.map(lambda p: httpx.post(
                    server.base_url + "/v1/completions", timeout=300,
                    json={"model": model, "prompt": p, "max_tokens": 24, "temperature": 0}), prompts))
            assert all(r.status_code == 200 for r in replies), [r.text for r in replies]
            after = server_metrics.scrape(server.base_url)
            steps, drafted, _ = (after[n] - before.get(n, 0.0) for n in VLLM.facts.spec_counters)
            return drafted / steps

        assert drafted_per_step(["def add(a, b):"]) == 2
        together = drafted_per_step(["def add(a, b):", "class Stack:", "import os\n", "for i in range(10):"])
        assert 2 < together <= 5
    finally:
        server.stop()


def test_vllm_says_data_parallelism_turns_the_schedule_off():
    rendering = VLLM.schedule_args({**NGRAM, "data_parallel_size": 2}, RAMP)
    assert len(rendering.cannot_express) == 1 and "data_parallel_size 2" in rendering.cannot_express[0]
    argv, _, _ = VLLM.scheduled_command({**NGRAM, "data_parallel_size": 2}, RAMP, model=None, draft_model=None,
                                        **ADDRESS)
    assert schema_errors(VLLM.engine_args(argv), load_schema("vllm", VLLM.version)) == []


def test_a_schedule_that_never_drafts_turns_speculation_off_everywhere():
    never = DraftSchedule(drafter="ngram", rows=[{"max_batch": 1, "draft_length": 0}])
    argv, _, rendering = VLLM.scheduled_command(NGRAM, never, model=None, draft_model=None, **ADDRESS)
    assert flag_value(argv, "--speculative-config") is None and rendering.cannot_express == ()
    for engine, config in (("llamacpp", {"spec_type": "draft-simple"}), ("sglang", {"speculative_algorithm": "EAGLE"}),
                           ("embedded", {"drafter": "ngram"})):
        adapter = get_adapter(engine)
        rendering = adapter.schedule_args(config, never)
        assert rendering.cannot_express == ()
        merged = {**config, **rendering.config}
        assert merged.get(adapter.facts.draft_keys[0]) in (None, "none") or merged.get("draft_schedule")


def test_a_configuration_without_a_drafter_is_refused_in_one_line():
    with pytest.raises(ValueError, match="needs a drafter") as e:
        VLLM.schedule_args({"max_num_seqs": 8}, RAMP)
    assert "\n" not in str(e.value)


# -- SGLang ------------------------------------------------------------------------------------------
SGLANG = get_adapter("sglang")


def sglang_tier_length(tiers: dict, graph_sizes: list[int], batch: int) -> int:
    """What SGLang's AdaptiveSpeculativeParams routes a decode batch to: padded up to the next graph size, then the
    tier of the largest key at or below it (its one candidate)."""
    padded = next((s for s in sorted(graph_sizes) if s >= batch), batch)
    keys = sorted(int(k) for k in tiers)
    key = max([k for k in keys if k <= padded] or keys[:1])
    (steps,) = tiers[str(key)]["candidate_steps"]
    return steps


@pytest.mark.parametrize("version", SGLANG_VERSIONS)
def test_sglang_runs_eagle_with_one_adaptive_tier_per_row(tmp_path, version):
    graphs = [1, 2, 4, 8, 16, 24, 32]  # every row ends on a captured size: nothing moves
    config = {"speculative_algorithm": "EAGLE3", "speculative_num_steps": 3, "speculative_eagle_topk": 1,
              "speculative_num_draft_tokens": 4, "cuda_graph_bs_decode": graphs, "max_running_requests": 32}
    argv, _, rendering = SGLANG.scheduled_command(config, RAMP, model="/models/target", draft_model="/models/eagle3",
                                                  directory=tmp_path, **ADDRESS)
    assert schema_errors(SGLANG.engine_args(argv), load_schema("sglang", version)) == []
    assert SGLANG.validate_flags(argv) == []  # the installed SGLang's schema (and parser, where it is importable)
    assert SGLANG.check({**config, **rendering.config}, has_draft_model=True) == []
    assert "--speculative-adaptive" in argv and flag_value(argv, "--speculative-num-steps") == "8"
    assert flag_value(argv, "--speculative-num-draft-tokens") == "9"
    rendering.write_files()
    tiers = json.loads(Path(flag_value(argv, "--speculative-adaptive-config")).read_text())
    # speculative_num_steps must be one of the candidates (SGLang's _init_adaptive_speculative_params)
    assert 8 in {s for t in tiers.values() for s in t["candidate_steps"]}
    assert [sglang_tier_length(tiers, graphs, b) for b in range(1, 33)] == [RAMP.length_for(b) for b in range(1, 33)]
    assert rendering.cannot_express == ()


def test_sglang_says_which_batches_its_cuda_graph_padding_moves(tmp_path):
    config = {"speculative_algorithm": "EAGLE", "cuda_graph_bs_decode": [1, 2, 8, 16], "max_running_requests": 16}
    rendering = SGLANG.schedule_args(config, RAMP, directory=tmp_path)
    # batch 3 and 4 pad to 8 and run its tier's 2, not 4; batches 5-8 and 9-16 stay in their rows
    (sentence,) = rendering.cannot_express
    assert "batch 3 runs 2 (batch 8's), not 4" in sentence and "batch 4 runs 2" in sentence
    tiers = json.loads(rendering.files[rendering.config["speculative_adaptive_config"]])
    moved = [b for b in range(1, 17) if sglang_tier_length(tiers, [1, 2, 8, 16], b) != RAMP.length_for(b)]
    assert moved == [3, 4]


@pytest.mark.parametrize("config", [{"speculative_algorithm": "NGRAM", "max_running_requests": 4},
                                    {"speculative_algorithm": "EAGLE", "speculative_num_steps": 3,
                                     "speculative_eagle_topk": 4, "speculative_num_draft_tokens": 16,
                                     "max_running_requests": 4},
                                    {"speculative_algorithm": "EAGLE", "enable_dp_attention": True,
                                     "max_running_requests": 4}])
def test_sglang_without_adaptive_tiers_drafts_the_length_at_its_running_requests(config):
    argv, _, rendering = SGLANG.scheduled_command(config, RAMP, model="/models/target", draft_model="/models/eagle",
                                                  **ADDRESS)
    for version in SGLANG_VERSIONS:
        assert schema_errors(SGLANG.engine_args(argv), load_schema("sglang", version)) == []
    assert "--speculative-adaptive" not in argv
    merged = {**config, **rendering.config}
    assert SGLANG.check(merged, has_draft_model=True) == []
    k = RAMP.length_for(4)
    if config["speculative_algorithm"] == "NGRAM":
        assert merged["speculative_num_draft_tokens"] == k + 1
    else:
        assert merged["speculative_num_steps"] == k
    (sentence,) = rendering.cannot_express
    assert "batch 1: 8" in sentence and "4 running requests" in sentence


# -- llama.cpp ---------------------------------------------------------------------------------------
LLAMACPP = get_adapter("llamacpp")


@pytest.mark.parametrize("slots, lost", [(1, False), (4, True), (16, True)])
def test_llamacpp_drafts_the_length_at_its_slots(slots, lost):
    config = {"spec_type": "draft-simple", "parallel": slots, "spec_draft_n_min": 6, "spec_draft_p_min": 0.5}
    argv, _, rendering = LLAMACPP.scheduled_command(config, RAMP, model="/models/target.gguf",
                                                    draft_model="/models/draft.gguf", **ADDRESS)
    assert LLAMACPP.validate_flags(argv) == []  # build 11434's captured --help
    merged = {**config, **rendering.config}
    assert LLAMACPP.check(merged, has_draft_model=True) == []
    k = RAMP.length_for(slots)
    if k:
        assert flag_value(argv, "--spec-draft-n-max") == str(k)
        assert int(flag_value(argv, "--spec-draft-n-min")) <= k
    else:
        assert flag_value(argv, "--spec-type") is None  # spec_type none: the flag left out, llama-server's default
    assert bool(rendering.cannot_express) == lost
    if lost:
        assert "every batch size" in rendering.cannot_express[0]


def test_llamacpp_auto_slots_are_four_and_ngram_types_read_no_length():
    rendering = LLAMACPP.schedule_args({"spec_type": "draft-simple"}, RAMP)
    assert rendering.config == {"spec_draft_n_max": RAMP.length_for(4)} and "4 slots" in rendering.cannot_express[0]
    ngram = LLAMACPP.schedule_args({"spec_type": "ngram-simple", "parallel": 2}, RAMP)
    assert ngram.config == {} and "reads no draft length" in ngram.cannot_express[0]


# -- the embedded engine -----------------------------------------------------------------------------
def test_the_embedded_engine_is_pointed_at_the_schedule_file(tmp_path):
    embedded = get_adapter("embedded")
    argv, _, rendering = embedded.scheduled_command({"drafter": "ngram", "draft_length": 8}, RAMP, model=None,
                                                    draft_model=None, directory=tmp_path, **ADDRESS)
    assert embedded.validate_flags(argv) == [] and rendering.cannot_express == ()
    assert rendering.write_files() == [tmp_path / "draft_schedule.yaml"]
    assert DraftSchedule.load(flag_value(argv, "--draft-schedule")) == RAMP


def test_the_draft_length_reads_and_writes_in_each_engines_own_terms():
    """What the schedule's sweep and the report call k: SGLang's EAGLE family drafts a token per step (its
    num_steps; the draft tokens are the verified tree), NGRAM and DFLASH all but one of the tokens they verify."""
    from autotune.engines import ENGINES
    from autotune.space import load_space

    sglang = get_adapter("sglang")
    chain = {"speculative_algorithm": "EAGLE", "speculative_num_steps": 3, "speculative_eagle_topk": 1,
             "speculative_num_draft_tokens": 4}
    assert sglang.draft_length(chain) == 3
    assert sglang.with_draft_length(chain, 5) == {**chain, "speculative_num_steps": 5, "speculative_num_draft_tokens": 6}
    tree = {**chain, "speculative_eagle_topk": 4, "speculative_num_draft_tokens": 16}
    assert sglang.draft_length(tree) == 3 and sglang.with_draft_length(tree, 2)["speculative_num_draft_tokens"] == 16
    ngram = {"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": 12}
    assert sglang.draft_length(ngram) == 11 and sglang.with_draft_length(ngram, 4)["speculative_num_draft_tokens"] == 5
    assert sglang.draft_length({"speculative_algorithm": None, "speculative_num_draft_tokens": 12}) == 0
    for name in ENGINES:  # every drafting seed: a length written reads back, and the engine's rules accept it
        adapter = get_adapter(name)
        for seed in load_space(name).seed_configs():
            if adapter.draft_length(seed) > 0:
                longer = adapter.with_draft_length(seed, 2)
                assert adapter.draft_length(longer) == 2, (name, seed)
                assert adapter.check(longer, has_draft_model=True) == [], (name, longer)
