"""The distillation's held-out-of-training prompts as a workload (JSONL of the shipped request bodies): the prompts
scripts/distill_draft_model.py left out of training (every VALIDATION_EVERY-th of its prompt list), which are also
outside the estimator's held-out `mixed` set, so a collection pass on them is clean for a distilled draft.

    PYTHONPATH=. python3 benchmarks/results/estimator-2026-12-02/inputs/held_out_of_training.py OUT.jsonl
"""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[4] / "scripts"))
import distill_draft_model as distill  # noqa: E402

from autotune.bench import load_workload  # noqa: E402
from autotune.estimator.live import requests_of  # noqa: E402

bodies = requests_of(list(distill.TRAINING_WORKLOADS), exclude=load_workload(distill.HELD_OUT).requests, max_tokens=1)
original = {json.dumps(r.get("messages") or r.get("prompt")): r for name in distill.TRAINING_WORKLOADS
            for r in load_workload(name).requests}
kept = [original[json.dumps(b.get("messages") or b.get("prompt"))] for b in bodies[:: distill.VALIDATION_EVERY]]
Path(sys.argv[1]).write_text("".join(json.dumps(r) + "\n" for r in kept))
print(f"{len(kept)} prompts -> {sys.argv[1]}")
