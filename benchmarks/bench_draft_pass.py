"""What a draft pass of --drafter draft_model costs, in plain target steps, on one in-process engine.

    python3 benchmarks/bench_draft_pass.py --draft-model PATH [--quantization none] [--k 4] [--rounds 8]
        [--threads 1] [--out FILE.json]

Per round, in alternating order, the same greedy prompt at k = 0 (plain steps: the target alone) and at k.
A draft pass is the draft seconds per proposed token at k (k passes a step; the first feeds two tokens, the
last accepted one and the newest); a plain step is the verify seconds per step at k = 0. Prints the median and
range of the per-round ratios, and the verify step at width k + 1 over a plain step beside it.
"""
import argparse
import json
import statistics
import threading
from pathlib import Path

from autotune.embedded.config import EngineConfig, GenerationRequest, SamplingParams
from autotune.embedded.scheduler import Engine

PROMPT = "def quicksort(items):\n    \"\"\"Sort a list of numbers.\"\"\"\n    "


def generate(engine: Engine, k: int):
    done, events = threading.Event(), []

    def on_event(event):
        events.append(event)
        if event.finish_reason:
            done.set()

    ids = engine.tokenizer.encode(PROMPT)
    engine.submit(GenerationRequest(ids, SamplingParams(max_tokens=32, ignore_eos=True, draft_length=k)), on_event)
    done.wait()
    return events[-1].spec


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draft-model", required=True)
    parser.add_argument("--quantization", default="none", choices=("none", "gguf"))
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", help="write the numbers here as JSON")
    args = parser.parse_args()
    engine = Engine(EngineConfig(drafter="draft_model", draft_model=args.draft_model, draft_length=args.k,
                                 quantization=args.quantization, threads=args.threads, device="cpu"))
    engine.start()
    try:
        generate(engine, args.k), generate(engine, 0)  # warm-up
        passes, verifies = [], []
        for r in range(args.rounds):
            runs = {}
            for k in (0, args.k)[:: 1 if r % 2 else -1]:
                runs[k] = generate(engine, k)
            plain = runs[0].verify_seconds / runs[0].verify_steps
            passes.append(runs[args.k].draft_seconds / runs[args.k].draft_tokens / plain)
            verifies.append(runs[args.k].verify_seconds / runs[args.k].verify_steps / plain)
    finally:
        engine.stop()
    doc = {"draft_model": args.draft_model, "quantization": args.quantization, "k": args.k, "threads": args.threads,
           "rounds": args.rounds, "draft_pass_over_plain_step": statistics.median(passes),
           "draft_pass_range": [min(passes), max(passes)], "verify_over_plain_step": statistics.median(verifies),
           "verify_range": [min(verifies), max(verifies)]}
    print(f"draft_model, quantization {args.quantization}, {args.threads} thread(s): a draft pass costs "
          f"{doc['draft_pass_over_plain_step']:.3f} plain steps (range {min(passes):.3f}..{max(passes):.3f}); a verify "
          f"step at width {args.k + 1} {doc['verify_over_plain_step']:.3f} (range {min(verifies):.3f}..{max(verifies):.3f}); "
          f"{args.rounds} alternated rounds")
    if args.out:
        Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
