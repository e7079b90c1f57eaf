"""The host-side levers of the embedded engine on CUDA, each against the engine without it, in one process.

1. Prefill attention without cuDNN (runner.PREFILL_ATTENTION). SDPA picks cuDNN for a masked call on
   Hopper, and cuDNN builds a plan for each new shape: every prompt length the process has not seen pays
   it. Measured as the time to the first token of prompts at unseen lengths, alternating the two variants
   (each variant gets its own lengths, so neither reuses the other's plans).
2. The greedy step on host arrays (ModelRunner.host_greedy): one copy in, the graph, one copy out, against
   the general path (the step's inputs built, padded and accepted with device ops). Measured as decode
   ms per token of one request (plain and n-gram), alternating the two, after the prompt is in.
3. A prompt chunk in one forward, the head only on its entropy positions, against the entropy positions
   fed as a chunk of their own first (the scheduler before 8a0247a: two eager forwards for every prompt past
   ENTROPY_POSITIONS). Measured as the time to the first token at unseen lengths, alternating the two.
4. Prefill chunks replaying a CUDA graph per width bucket (runner.prefill_buckets) against the eager prefill
   (`--prefill-graphs off`). Levers 1 and 3 run with the eager prefill, which is what they change. Measured as
   the time to the first token at unseen lengths, short prompts (within one chunk) and long ones, alternating
   the two, and the share of the first 32 greedy tokens the two give alike.

The engine is the bundled model in bf16 with inductor and a CUDA graph for batch 1, one slot, as
bench_embedded.py runs it against llama.cpp.

    python3 benchmarks/gpu_host_levers.py [--repeats 5] [--tokens 256] [--out levers.json] [--device cpu]
"""
import argparse
import contextlib
import json
import statistics

import numpy as np
import torch
from bench_embedded import timed  # one greedy request, timed, failing loudly if it does not end by length

from autotune import provenance
from autotune.embedded import runner as runner_module
from autotune.embedded import scheduler as scheduler_module
from autotune.embedded.config import EngineConfig
from autotune.embedded.generate import ENTROPY_POSITIONS, prefill_chunk
from autotune.embedded.scheduler import Engine


def entropy_chunk_first(target, drafter, input_ids, start, row, kv_len):
    """prefill_chunk as the scheduler fed it before 8a0247a: the entropy positions as a chunk of their own."""
    split = ENTROPY_POSITIONS - start
    if not 0 < split < input_ids.shape[1]:
        return prefill_chunk(target, drafter, input_ids, start, row, kv_len)
    entropy = prefill_chunk(target, drafter, input_ids[:, :split], start, row, kv_len)
    prefill_chunk(target, drafter, input_ids[:, split:], ENTROPY_POSITIONS, row, kv_len)
    return entropy


def first_token_table(runs_by_variant: dict) -> dict:
    return {name: {"lengths": [n for n, _ in runs], "ms": [round(s * 1e3, 1) for _, s in runs],
                   "median_ms": round(statistics.median(s for _, s in runs) * 1e3, 1)}
            for name, runs in runs_by_variant.items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--out", default=None)
    parser.add_argument("--device", default="cuda", help="cpu: a smoke run of this script (eager, no graphs)")
    args = parser.parse_args()
    cuda = args.device == "cuda"
    config = EngineConfig(drafter="ngram", dtype="bfloat16" if cuda else "float32", compile="inductor" if cuda else "none",
                          cuda_graph_batch_sizes=[1] if cuda else [], verify_slots=1, device=args.device,
                          max_seq_len=2048)
    engine = Engine(config)
    engine.start()
    rng = np.random.default_rng(0)
    general_path = lambda *inputs: None  # host_greedy declining: the caller's general path
    with_cudnn = lambda backends: contextlib.nullcontext()  # SDPA's own pick, cuDNN included
    result = {"engine_commit": provenance.commit(), "device": torch.cuda.get_device_name() if cuda else "cpu",
              "config": str(config), "torch": torch.__version__}
    try:
        timed(engine, rng.integers(100, 10000, 64).tolist(), 16, 0)  # allocator, first touch
        prefill_widths, engine.target.prefill_widths = engine.target.prefill_widths, ()  # levers 1, 3: eager

        # 1. prefill: unseen lengths, the variants alternating
        ttft = {"no_cudnn": [], "cudnn": []}
        lengths = iter(range(90, 2000, 23))
        for _ in range(args.repeats):
            for name, runs in ttft.items():
                runner_module.sdpa_kernel = with_cudnn if name == "cudnn" else torch.nn.attention.sdpa_kernel
                length = next(lengths)
                runs.append((length, timed(engine, rng.integers(100, 10000, length).tolist(), 1, 0)[0]))
        runner_module.sdpa_kernel = torch.nn.attention.sdpa_kernel
        result["first_token_ms_at_unseen_lengths"] = first_token_table(ttft)

        # 3. prefill: one forward a chunk vs the entropy positions first, at unseen lengths, alternating
        ttft = {"one_forward": [], "entropy_chunk_first": []}
        for _ in range(args.repeats):
            for name, runs in ttft.items():
                scheduler_module.prefill_chunk = entropy_chunk_first if name != "one_forward" else prefill_chunk
                length = next(lengths)
                runs.append((length, timed(engine, rng.integers(100, 10000, length).tolist(), 1, 0)[0]))
        scheduler_module.prefill_chunk = prefill_chunk
        result["first_token_ms_prefill_forwards"] = first_token_table(ttft)

        # 4. prefill: graphs per width bucket vs eager, at unseen lengths (short, then long), alternating
        for span, lengths_of_span in (("short", range(40, 250, 7)), ("long", range(300, 1500, 37))):
            ttft, agree = {"graphs": [], "eager": []}, []
            span_lengths = iter(lengths_of_span)
            for r in range(args.repeats):
                length = next(span_lengths)
                prompt = rng.integers(100, 10000, length).tolist()
                tokens = {}
                for name in (("graphs", "eager") if r % 2 == 0 else ("eager", "graphs")):
                    engine.target.prefill_widths = prefill_widths if name == "graphs" else ()
                    ttft[name].append((length, timed(engine, prompt, 1, 0)[0]))
                    tokens[name] = timed(engine, prompt, 32, 0)[1]
                agree.append(sum(a == b for a, b in zip(*tokens.values())) / len(tokens["graphs"]))
            result[f"first_token_ms_prefill_graphs_{span}"] = {
                **first_token_table(ttft), "prefill_widths": list(prefill_widths),
                "same_greedy_token_share": [round(a, 3) for a in agree]}
        engine.target.prefill_widths = prefill_widths

        # 2. decode: ms per token after the prompt is in, host path vs general path, plain and n-gram
        prompt = ("def area(width, height):\n    return width * height\n\n# Same function, with type hints:\n"
                  "def area(")
        ids = engine.tokenizer.encode(prompt * 3, add_special_tokens=True)
        decode = {}
        for k in (0, 6):
            runs, texts = {"host_greedy": [], "general": []}, {"host_greedy": set(), "general": set()}
            for _ in range(args.repeats):
                for name, times in runs.items():
                    if name == "general":
                        engine.target.host_greedy = general_path
                    first = timed(engine, ids, 1, k)[0]
                    whole, tokens, _ = timed(engine, ids, args.tokens, k)
                    texts[name].add(tuple(tokens))
                    engine.target.__dict__.pop("host_greedy", None)
                    times.append((whole - first) / (args.tokens - 1) * 1e3)
            decode[f"k={k}"] = {name: {"ms_per_token": [round(v, 3) for v in vs],
                                       "median_ms_per_token": round(statistics.median(vs), 3)}
                                for name, vs in runs.items()}
            # the same graphs either way: greedy tokens must not depend on the path
            decode[f"k={k}"]["same_tokens_both_paths"] = len(texts["host_greedy"] | texts["general"]) == 1
        result["decode_ms_per_token"] = decode
        result["prompt_tokens"] = len(ids)
        result["late_graph_captures"] = engine.stats()["late_graph_captures"]
    finally:
        engine.stop()
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
