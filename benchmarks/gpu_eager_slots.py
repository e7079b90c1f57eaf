"""The eager CUDA engine with rows other than 0..B-1: six greedy n-gram requests over 8 slots, first one at a
time, then all at once (the short ones end first, so later steps batch scattered slots). Every request must
finish by length, without an error; whether its tokens match the one-at-a-time run is printed (bf16 numerics of
a wider batch may flip a near-tie). The check behind a4f4e67 (the step kernel read strided slots as contiguous).

    python3 benchmarks/gpu_eager_slots.py
"""
import threading
import time

from autotune.embedded.config import EngineConfig, GenerationRequest, SamplingParams
from autotune.embedded.scheduler import Engine

MAX_TOKENS = [8, 48, 24, 48, 16, 48]


def submit(engine: Engine, i: int, tokens: int, results: dict) -> threading.Event:
    done, got = threading.Event(), []

    def on_event(event):
        got.extend(event.new_token_ids)
        if event.finish_reason:
            results[i] = (event.finish_reason, event.error, got)
            done.set()

    prompt = list(range(100 + 7 * i, 160 + 29 * i))
    engine.submit(GenerationRequest(prompt, SamplingParams(max_tokens=tokens, ignore_eos=True, draft_length=4)),
                  on_event)
    return done


def main():
    engine = Engine(EngineConfig(drafter="ngram", dtype="bfloat16", verify_slots=8, device="cuda", max_seq_len=2048))
    engine.start()
    try:
        alone, together = {}, {}
        for i, tokens in enumerate(MAX_TOKENS):
            submit(engine, i, tokens, alone).wait()
        start = time.perf_counter()
        for done in [submit(engine, i, tokens, together) for i, tokens in enumerate(MAX_TOKENS)]:
            done.wait()
        print(f"together {time.perf_counter() - start:.1f} s; finish:", [together[i][:2] for i in range(len(MAX_TOKENS))])
        print("same tokens as alone:", [together[i][2] == alone[i][2] for i in range(len(MAX_TOKENS))])
    finally:
        engine.stop()


if __name__ == "__main__":
    main()
