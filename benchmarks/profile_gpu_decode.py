"""Where a CUDA decode step of the embedded model spends its time (random SmolLM2-shaped weights).

Plain bs-1 decode through ModelRunner (the engine's own graph runner) for several compile modes,
each timed as the engine runs it (graph replay + argmax + one host sync per token), and a kernel
table of one compiled forward without graphs. Random weights: speed does not depend on values.

    python3 benchmarks/profile_gpu_decode.py [--tokens 256] [--modes none,inductor,max-autotune-no-cudagraphs]
"""
import argparse
import time

import torch

from autotune.embedded.model import KVCache, ModelArgs, Transformer
from autotune.embedded.runner import ModelRunner

SMOLLM2_135M = ModelArgs(dim=576, n_layers=30, n_heads=9, n_kv_heads=3, intermediate_size=1536, vocab_size=49152,
                         norm_eps=1e-5, rope_base=100000.0, max_seq_len=1041, tie_embeddings=True)


def decode_tok_s(runner: ModelRunner, tokens: int) -> float:
    token = torch.zeros((1, 1), dtype=torch.long, device="cuda")
    for warm in (True, False):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for pos in range(16 if warm else tokens):
            logits = runner(token, torch.tensor([[pos]], device="cuda"), None, 1024)
            token = logits[:, -1:].argmax(-1)
            token.tolist()  # the engine's one host sync per step
    return tokens / (time.perf_counter() - start)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--modes", default="none,inductor,max-autotune-no-cudagraphs")
    args = parser.parse_args()
    torch.manual_seed(0)
    model = Transformer(SMOLLM2_135M).to("cuda", torch.bfloat16).eval().requires_grad_(False)
    for mode in args.modes.split(","):
        cache = KVCache(SMOLLM2_135M, 2, 1041, torch.bfloat16, "cuda")
        runner = ModelRunner(model, cache, "none", graph_batch_sizes=[1], scratch_slot=1)
        if mode != "none":
            options = {} if mode == "inductor" else {"mode": mode}
            runner.forward = torch.compile(model.forward, backend="inductor", **options)
        start = time.perf_counter()
        tok_s = decode_tok_s(runner, args.tokens)
        print(f"{mode:>28}: {tok_s:7.1f} tok/s ({1e3 / tok_s:.2f} ms/token; setup+run {time.perf_counter() - start:.0f} s)",
              flush=True)

    compiled = torch.compile(model.forward, backend="inductor")
    cache = KVCache(SMOLLM2_135M, 2, 1041, torch.bfloat16, "cuda")
    ids, pos = torch.zeros((1, 1), dtype=torch.long, device="cuda"), torch.zeros((1, 1), dtype=torch.long, device="cuda")
    for _ in range(3):
        compiled(ids, pos, cache, kv_len=1024)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        compiled(ids, pos, cache, kv_len=1024)
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    print(f"kernels in one compiled forward: {sum(e.count for e in events)}, "
          f"GPU time {sum(e.device_time_total for e in events) / 1e3:.2f} ms")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15))


if __name__ == "__main__":
    main()
