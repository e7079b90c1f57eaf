"""Where a CPU decode step and a verify step of the embedded engine spend their time (`--quantization gguf`).

The bundled GGUF on its own blocks, bound to its KV cache and run through the engine's own speculative_step
(plain decode: width 1; verify: width k + 1), after a prefill of a real prompt. Three views:

1. wall time per step as the engine runs it (no profiler);
2. the same steps under torch.profiler, time grouped by op class: quantized matmuls (the C kernel),
   attention (the fused C call, or SDPA + KV-cache writes + rope on an unfused path), norm, other aten ops,
   sampling (argmax and acceptance), and host time (what the profiler attributes to no op: Python, dispatch);
3. the C kernel alone on the step's matmul shapes, in a tight loop (its floor for one step).

    python3 benchmarks/profile_cpu_decode.py [--threads 1] [--steps 64] [--verify-width 4] [--context 256]

Compare with llama.cpp on the same file and threads: `llama-bench -m FILE -t 1 -p 0 -n 64 -r 3` (tg tok/s).
"""
import argparse
import time
from collections import defaultdict

import numpy as np
import torch

from autotune.embedded import model as model_module
from autotune.embedded import quantize
from autotune.embedded.drafters import NoDrafter
from autotune.embedded.generate import StepInput, speculative_step
from autotune.embedded.model import KVCache
from autotune.embedded.runner import ModelRunner
from autotune.embedded.sampling import SamplingBatch
from autotune.embedded.weights import load_model

CLASSES = {  # a profiler range or aten op -> the class of everything run inside it
    "gguf_linear_c": "quantized matmuls (C kernel)", "attention_c": "attention (C kernel: RoPE, KV write, attention)",
    "aten::scaled_dot_product_attention": "attention (SDPA)", "aten::index_put_": "attention (KV-cache write)",
    "rms_norm": "norm (RMSNorm)", "rope": "rope", "aten::argmax": "sampling (argmax, acceptance)",
    "aten::cumprod": "sampling (argmax, acceptance)",
}


def op_class(event) -> str:
    while event is not None:
        if event.name in CLASSES:
            return CLASSES[event.name]
        event = event.cpu_parent
    return "other aten ops (embedding, SwiGLU, residual adds, views, copies)"


class LabelledKernel:
    """The C kernel's entry points inside profiler ranges (ctypes calls are invisible to the profiler)."""

    def __init__(self, lib):
        self.lib = lib

    def gguf_linear(self, *args):
        with torch.profiler.record_function("gguf_linear_c"):
            return self.lib.gguf_linear(*args)

    def attention(self, *args):
        with torch.profiler.record_function("attention_c"):
            return self.lib.attention(*args)


class FixedDrafter(NoDrafter):
    """Proposes k copies of token 0: a verify step of width k + 1 whatever gets accepted."""

    def __init__(self, k: int):
        self.k = k

    def host_proposals(self, step):
        return np.zeros((1, self.k), dtype=np.int64), [self.k]


def greedy_sampling() -> SamplingBatch:
    one = torch.ones(1)
    return SamplingBatch(temperature=one * 0, top_k=torch.zeros(1, dtype=torch.long), top_p=one,
                         repetition_penalty=one, presence=None, generators=[None], any_sampled=False,
                         any_filtered=False)


def labelled(fn, label):
    def wrapped(*args, **kwargs):
        with torch.profiler.record_function(label):
            return fn(*args, **kwargs)
    return wrapped


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--verify-width", type=int, default=4, help="tokens a verify step feeds (k + 1)")
    parser.add_argument("--context", type=int, default=256, help="prompt tokens prefilled before the steps")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    loaded = load_model(max_seq_len=2048)
    quantize.quantize_gguf(loaded.model, loaded.gguf_blocks, torch.device("cpu"), torch.float32)
    cache = KVCache(loaded.args, 1, 2048, torch.float32)
    runner = ModelRunner(loaded.model, cache)
    prompt = torch.from_numpy(np.arange(args.context) % 1000 + 100)[None]
    print(f"{loaded.name}, {args.threads} thread(s), context {args.context}, {args.steps} steps per mode")

    def steps(drafter, n, position=args.context):
        token = int(prompt[0, -1])
        for i in range(n):
            pos = position + i * (drafter.k + 1 if isinstance(drafter, FixedDrafter) else 1)
            step = StepInput(host=np.array([[token, pos, 0]]), histories=[prompt[0].numpy()],
                             draft_lengths=[getattr(drafter, "k", 0)], kv_len=pos + 8, sampling=greedy_sampling())
            out = speculative_step(runner, drafter, step)
            token = out.tokens[0][-1]

    with torch.inference_mode():
        runner(prompt, torch.arange(args.context)[None], None, args.context)
        modes = {"decode (width 1)": NoDrafter(), f"verify (width {args.verify_width})": FixedDrafter(args.verify_width - 1)}
        wall = {}
        for name, drafter in modes.items():
            steps(drafter, 8)  # warm
            start, cpu_start = time.perf_counter(), time.process_time()
            steps(drafter, args.steps)
            wall[name] = (time.perf_counter() - start) / args.steps * 1e3
            cpu = (time.process_time() - cpu_start) / args.steps * 1e3
            print(f"{name}: {wall[name]:.2f} ms a step as the engine runs it ({1e3 / wall[name]:.1f} steps/s), "
                  f"{cpu:.2f} ms of CPU time (the same on a shared machine, where wall time waits for a core)")

        # 2. by op class, under the profiler (which adds its own cost: shares, not absolute times)
        lib = quantize._kernel()
        quantize._kernel = lambda: LabelledKernel(lib)
        model_module.RMSNorm.forward = labelled(model_module.RMSNorm.forward, "rms_norm")
        model_module.apply_rope = labelled(model_module.apply_rope, "rope")
        for name, drafter in modes.items():
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                start = time.perf_counter()
                steps(drafter, args.steps)
                profiled = (time.perf_counter() - start) / args.steps * 1e3
            totals = defaultdict(float)
            for event in prof.events():  # each op's own time, charged to the class of its nearest classed ancestor
                totals[op_class(event)] += event.self_cpu_time_total / args.steps / 1e3
            print(f"\n{name} under the profiler: {profiled:.2f} ms a step")
            for label, ms in sorted(totals.items(), key=lambda kv: -kv[1]):
                print(f"  {label:62s} {ms:7.3f} ms  {ms / profiled:6.1%}")
            host = profiled - sum(totals.values())
            print(f"  {'host: Python between ops, dispatch, the profiler itself':62s} {host:7.3f} ms  {host / profiled:6.1%}")
        quantize._kernel = lambda: lib

        # 3. the kernel alone on one step's matmuls
        linears = [m for m in loaded.model.modules() if isinstance(m, quantize.GGUFLinear)]
        for width in (1, args.verify_width):
            xs = [torch.randn(1, width, m.in_features * (2 if m.gated else 1)) for m in linears]
            for m, x in zip(linears, xs):
                m(x)
            start = time.process_time()
            for _ in range(8):
                for m, x in zip(linears, xs):
                    m(x)
            ms = (time.process_time() - start) / 8 * 1e3
            by_type = defaultdict(int)
            for m in linears:
                for ggml_type, _, rows in m.parts:
                    by_type[quantize.GGML_BLOCKS[ggml_type][0]] += rows * m.in_features
            print(f"\nkernel alone, width {width}: {len(linears)} matmuls, {ms:.2f} ms of CPU time a step "
                  f"(weights by type, millions: {', '.join(f'{t} {n / 1e6:.1f}' for t, n in by_type.items())})")


if __name__ == "__main__":
    main()
