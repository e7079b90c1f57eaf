"""What the draft stop rule costs per step (issue 17 point 1: under 1 % of a step), two ways.

    python3 benchmarks/bench_stop_rule_cost.py [--drafter quantized_self] [--k 4] [--rounds 8] [--threads 1]

1. Directly: the rule's own work per draft pass (softmax entropy and top-1 of the draft logits, the risk
   compared with the threshold, and the host read that ends the loop) timed on the model's real vocabulary,
   over the seconds of one measured verify step at k.
2. End to end, on one in-process engine: the same greedy prompt at fixed k with the rule on (an estimator
   whose threshold is never reached, so every pass evaluates it and none stops) and off (draft_length in the
   request turns it off), alternated per round; (draft + verify seconds) per step of each, and the median
   and range of the per-round on/off ratios (on a shared machine this is the noisier of the two).

A model drafter runs the rule once per draft pass (k a step); the n-gram drafter once a step, on the
target's law at the last accepted token.
"""
import argparse
import json
import statistics
import tempfile
import threading
import time
from pathlib import Path

import torch

from autotune.embedded.config import EngineConfig, GenerationRequest, SamplingParams
from autotune.embedded.drafters import NgramDrafter
from autotune.embedded.generate import risk_of, signals_of
from autotune.embedded.scheduler import Engine

PROMPT = "def quicksort(items):\n    \"\"\"Sort a list of numbers.\"\"\"\n    "
NEVER = 1e9  # a threshold no risk reaches: the rule runs on every pass and never stops


def generate(engine: Engine, **params) -> tuple[float, int]:
    done, events = threading.Event(), []

    def on_event(event):
        events.append(event)
        if event.finish_reason:
            done.set()

    ids = engine.tokenizer.encode(PROMPT)
    engine.submit(GenerationRequest(ids, SamplingParams(max_tokens=32, ignore_eos=True, **params)), on_event)
    done.wait()
    spec = events[-1].spec
    return spec.draft_seconds + spec.verify_seconds, spec.verify_steps


def rule_seconds(vocab: int, device: str, repeats: int = 200) -> float:
    logits, above = torch.randn(1, vocab, device=device), torch.tensor([NEVER], device=device)
    proposed = torch.tensor([4], device=device)
    for _ in range(10):
        bool((proposed > 0).any())
    start = time.perf_counter()
    for j in range(repeats):
        stopping = (proposed > j) & (risk_of(signals_of(logits), "entropy") > above)
        proposed = torch.where(stopping, j, proposed)
        bool((proposed > j).any())  # the loop's host read
    return (time.perf_counter() - start) / repeats


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--drafter", default="quantized_self")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--out", help="write the numbers here as JSON")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        estimator = Path(tmp, "never-stops.json")
        estimator.write_text(json.dumps({
            "feature": "prompt_tokens", "thresholds": [], "temperature_edges": [], "k_table": [[args.k]],
            "stop_rule": {"signal": "entropy", "temperature_edges": [], "thresholds": [NEVER]}}))
        engine = Engine(EngineConfig(drafter=args.drafter, draft_length=args.k, draft_policy="estimator",
                                     draft_estimator=str(estimator), threads=args.threads, device=args.device))
        engine.start()
        try:
            generate(engine)  # warm-up
            on, off = [], []
            for r in range(args.rounds):
                for rule, runs in ((True, on), (False, off))[:: 1 if r % 2 else -1]:
                    seconds, steps = generate(engine, **({} if rule else {"draft_length": args.k}))
                    runs.append(seconds / steps)
            per_pass = rule_seconds(engine.vocab_size, str(engine.device))
            passes = 1 if isinstance(engine.drafter, NgramDrafter) else args.k
        finally:
            engine.stop()
    step = statistics.median(off)
    ratios = sorted(a / b for a, b in zip(on, off))
    doc = {"drafter": args.drafter, "k": args.k, "device": str(engine.device), "threads": args.threads,
           "rounds": args.rounds, "step_seconds_rule_off": step, "step_seconds_rule_on": statistics.median(on),
           "end_to_end_ratio_median": statistics.median(ratios), "end_to_end_ratio_range": [ratios[0], ratios[-1]],
           "rule_seconds_per_pass": per_pass, "rule_passes_per_step": passes, "rule_share_of_step": passes * per_pass / step}
    print(f"{args.drafter} k={args.k} on {doc['device']}: a step {step * 1e3:.2f} ms with the rule off, "
          f"{doc['step_seconds_rule_on'] * 1e3:.2f} ms on (per-round on/off ratio median {statistics.median(ratios):.4f}, "
          f"range {ratios[0]:.3f}..{ratios[-1]:.3f}, {args.rounds} alternated rounds); the rule itself "
          f"{per_pass * 1e6:.1f} us a pass, {passes} a step = {doc['rule_share_of_step']:.3%} of a step")
    if args.out:
        Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
