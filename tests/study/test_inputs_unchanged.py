"""No function changes its inputs (issue 33 point 4): the plan, validation and the embedded engine work on
copies of what their caller passed."""
import copy

import pytest

from autotune.embedded.config import EngineConfig
from autotune.embedded.scheduler import Engine
from autotune.study import loop, plan
from autotune.study.storage import load_study
from autotune.validate.run import validate
from autotune.validate.settings import ValidationSettings

ONE_SERVER = ["drafter=ngram", "draft_policy=fixed", "ngram_min=1", "ngram_max=4", "prefill_ubatch=256",
              "dtype=float32", "quantization=none", "compile=none", "threads=1"]


def test_plan_build_resolves_parallel_in_its_own_options(tmp_path):
    opts = plan.RunOptions(trials=1, study="inputs", sets=ONE_SERVER, parallel="auto", studies_root=str(tmp_path))
    before = copy.deepcopy(opts)
    p = plan.build(opts)
    assert isinstance(p.opts.parallel, int) and p.opts.parallel >= 1  # "auto" resolved in the plan...
    assert opts == before  # ...and the caller's options still say "auto"


def test_update_runtime_leaves_the_callers_config_alone():
    config = EngineConfig(drafter="ngram", draft_length=4, ngram_min=1, ngram_max=4, verify_slots=2, max_seq_len=64,
                          threads=1)
    before = copy.deepcopy(config)
    engine = Engine(config)
    assert engine.update_runtime(ngram_min=2, ngram_max=3)["ngram_max"] == 3
    assert (engine.config.ngram_min, engine.config.ngram_max) == (2, 3)
    assert config == before


@pytest.mark.slow
def test_validate_measures_its_own_load_and_leaves_the_studys_alone(tmp_path):
    """validate(load=...) overrides the study's load for its own measurements; the context the caller passed
    (which export and the schedule read next) keeps the study's load."""
    opts = plan.RunOptions(trials=1, study="validated", sets=ONE_SERVER, studies_root=str(tmp_path), workload="chat",
                           concurrency=2, quick_requests=1, live=False, num_requests=2, max_tokens=8, min_measure_s=0)
    loop.run_study(plan.build(opts))
    ctx = load_study(tmp_path / "validated")
    before = copy.deepcopy(ctx.load)
    one_round = ValidationSettings(top=1, repeats=1, max_repeats=1, quality_prompts=1, quality_tokens=4)  # no race
    doc = validate(ctx, settings=one_round, load={"max_tokens": 4}, progress=False)
    assert before["max_tokens"] == 8 and doc.settings["max_tokens"] == 4  # measured with the override...
    assert ctx.load == before  # ...which stayed out of the caller's context
