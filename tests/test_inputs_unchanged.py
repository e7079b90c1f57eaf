"""No function changes its inputs (issue 33 point 4): the plan and the embedded engine work on copies
of what their caller passed."""
import copy

from autotune.embedded.config import EngineConfig
from autotune.embedded.scheduler import Engine
from autotune.study import plan

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
