"""What the draft-length schedule costs a step of the embedded engine (issue 34 point 3: under 1%).

    python3 benchmarks/bench_schedule_cost.py [--batch 4] [--max-tokens 48] [--lookups 200000]

Starts the engine in-process (bundled model, float32, eager, n-gram drafter, a schedule), runs `--batch`
concurrent requests and reads its mean step time from its own counters (draft + verify seconds per decode
step: the forward passes only, so the ratio below errs high). Then times the per-step schedule work on
sequences of that batch: the schedule's length for the batch with each row's own k and max_tokens
(Engine._draft_lengths, what _decode calls), and the adaptive policy's next k per row. Prints both per step
and their ratio.
"""
import argparse
import tempfile
import threading
import time
from pathlib import Path

from autotune.embedded.config import EngineConfig, GenerationRequest, SamplingParams
from autotune.embedded.draft_policy import DraftPolicy
from autotune.embedded.draft_schedule import DraftSchedule
from autotune.embedded.scheduler import Engine, Sequence

SCHEDULE = {"drafter": "ngram", "rows": [{"max_batch": 1, "draft_length": 6}, {"max_batch": 2, "draft_length": 4},
                                         {"max_batch": 8, "draft_length": 0}]}
PROMPT = "values = [1, 2, 3, 4]\nvalues = [1, 2, 3, 4]\nvalues = [1, 2,"


def mean_step_seconds(engine: Engine, batch: int, max_tokens: int) -> tuple[float, int]:
    """(mean seconds of a decode step, steps counted) over `batch` concurrent requests."""
    ids = engine.tokenizer.encode(PROMPT)
    done = [threading.Event() for _ in range(batch)]
    for event in done:
        engine.submit(GenerationRequest(ids, SamplingParams(max_tokens=max_tokens, ignore_eos=True)),
                      lambda e, event=event: e.finish_reason and event.set())
    for event in done:
        assert event.wait(600), "a request did not finish"
    stats = engine.stats()
    steps = sum(stats["steps_by_batch"].values())
    return (stats["draft_seconds_total"] + stats["verify_seconds_total"]) / steps, steps


def schedule_ns_per_step(engine: Engine, batch: int, lookups: int) -> float:
    ids = engine.tokenizer.encode(PROMPT)
    rows = [Sequence(i, GenerationRequest(ids, SamplingParams(max_tokens=64)), None, i, frozenset(), None)
            for i in range(batch)]
    for seq in rows:
        seq.k = 6
    policy = DraftPolicy("adaptive", 6)
    start = time.perf_counter_ns()
    for _ in range(lookups):
        ks = engine._draft_lengths(rows)
        for seq, k in zip(rows, ks):
            policy.next_k(seq.k, k, k)
    return (time.perf_counter_ns() - start) / lookups


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--lookups", type=int, default=200_000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = DraftSchedule.model_validate(SCHEDULE).dump(Path(tmp) / "schedule.yaml")
        engine = Engine(EngineConfig(drafter="ngram", draft_length=6, verify_slots=args.batch, max_seq_len=256,
                                     draft_schedule=str(path)))
    engine.start()
    try:
        step_s, steps = mean_step_seconds(engine, args.batch, args.max_tokens)
    finally:
        engine.stop()
    cost_ns = schedule_ns_per_step(engine, args.batch, args.lookups)
    print(f"engine step (draft + verify, mean of {steps} steps, batch up to {args.batch}): {step_s * 1e3:.2f} ms")
    print(f"schedule + policy per step ({args.lookups} steps of {args.batch} rows): {cost_ns / 1e3:.2f} us")
    print(f"ratio: {cost_ns / (step_s * 1e9):.5%} of a step")


if __name__ == "__main__":
    main()
