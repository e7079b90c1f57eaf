"""Where a CUDA decode or verify step of the embedded model spends its time (random SmolLM2-shaped weights).

Runners built as the engine builds them (ModelRunner, bf16, 8 slots + a scratch slot, the engine's
default cache length): eager; eager + CUDA graphs; inductor + CUDA graphs (compiled once with dynamic
shapes, every (batch, width bucket) graph captured by warm_up, timed: the launch cost); and the
fixed-shape runner (--step-shape fixed). Each (batch, width) step is timed as the engine runs it:
forward (or graph replay) + argmax + one host sync. Per forward without graphs: kernel count, GPU
time, and the host gap (step wall time - GPU busy time). Random weights: speed does not depend on values.

    python3 benchmarks/profile_gpu_decode.py [--steps 50] [--runners eager,eager+graphs] [--step-attention triton]
        [--out profile.json]

Cold (a fresh machine, empty inductor cache) the two compiled runners need several minutes: the
compile of each specialisation (batch 1 or more x width 1 or more) took 8-85 s on the H200 host
(benchmarks/results/h200-2026-12-01b). --runners eager,eager+graphs gives the kernel tables in seconds.
"""
import argparse
import json
import statistics
import time

import torch

from autotune.embedded.model import KVCache, ModelArgs, Transformer
from autotune.embedded.runner import MAX_GRAPH_WIDTH, ModelRunner
from autotune.embedded.weights import build_model

# The bundled SmolLM2-135M as the engine loads it (read_gguf at max_seq_len 2048 + 17 headroom), so the
# inductor cache this warms is the one `autotune serve --compile inductor` then hits.
SMOLLM2_135M = ModelArgs(dim=576, n_layers=30, n_heads=9, n_kv_heads=3, intermediate_size=1536, vocab_size=49152,
                         head_dim=64, norm_eps=9.999999747378752e-06, rope_base=100000.0, max_seq_len=2065,
                         tie_embeddings=True)
SLOTS, GRAPH_SIZES = 8, [1, 2, 4, 8]
SHAPES = [(1, 1), (1, 5), (1, 9), (4, 1), (4, 5), (8, 1), (8, 5), (8, 9)]  # (batch, width): decode, k = 4, k = 8
KV_POSITION = 300  # where the rows stand in their sequences (a prompt plus some output)


def random_model():
    torch.manual_seed(0)
    state = {k: torch.randn_like(v) * 0.02 for k, v in Transformer(SMOLLM2_135M).state_dict().items()}
    return build_model(SMOLLM2_135M, state, torch.bfloat16, torch.device("cuda"))


def step_inputs(batch, width):
    ids = torch.randint(0, SMOLLM2_135M.vocab_size, (batch, width), device="cuda")
    pos = (KV_POSITION + torch.arange(width, device="cuda")).repeat(batch, 1)
    return ids, pos, torch.arange(batch, device="cuda")


def step_ms(runner, batch, width, steps) -> float:
    """Median wall ms of one engine-like step: forward, argmax, the host sync."""
    ids, pos, rows = step_inputs(batch, width)
    times = []
    for i in range(steps + 5):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        runner(ids, pos, rows, 384).argmax(-1).tolist()
        if i >= 5:
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def kernel_profile(runner, batch, width) -> dict:
    """One step at the whole cache (what a graph attends; the compiled forward reuses the graphs' compilations)."""
    ids, pos, rows = step_inputs(batch, width)
    kv_len = runner.cache.max_len
    for _ in range(3):
        runner(ids, pos, rows, kv_len).argmax(-1).tolist()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        runner(ids, pos, rows, kv_len).argmax(-1).tolist()
        wall = (time.perf_counter() - t0) * 1e3
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    gpu = sum(e.device_time_total for e in events) / 1e3
    top = sorted(events, key=lambda e: -e.device_time_total)[:8]
    return {"kernels": sum(e.count for e in events), "gpu_ms": round(gpu, 3), "wall_ms": round(wall, 3),
            "host_gap_ms": round(wall - gpu, 3),
            "top": [{"name": e.key[:70], "count": e.count, "us": round(e.device_time_total, 1)} for e in top]}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--out", default=None)
    parser.add_argument("--runners", default="inductor+graphs,inductor+graphs fixed,eager+graphs,eager,inductor",
                        help="comma-separated, from: inductor+graphs, inductor+graphs fixed, eager+graphs, eager, "
                             "inductor (the kernel table of the compiled forward without graphs)")
    parser.add_argument("--step-attention", choices=("sdpa", "triton"), default="sdpa",
                        help="the steps' attention: SDPA with the position mask, or kernels/step_attention.py")
    args = parser.parse_args()
    chosen = args.runners.split(",")
    model = random_model()
    if args.step_attention == "triton":
        from autotune.embedded.kernels import step_attention
        model.use_step_attention(step_attention.step_attention_op, step_attention.max_width)
    cache = lambda: KVCache(SMOLLM2_135M, SLOTS + 1, SMOLLM2_135M.max_seq_len, torch.bfloat16, "cuda")
    report = {"shapes": SHAPES, "steps": args.steps, "step_attention": args.step_attention, "device": torch.cuda.get_device_name(),
              "torch": torch.__version__, "step_ms": {}, "warm_up_s": {}, "kernels": {}}
    runners = {"inductor+graphs": ModelRunner(model, cache(), "inductor", GRAPH_SIZES, scratch_slot=SLOTS),
               "inductor+graphs fixed": ModelRunner(model, cache(), "inductor", GRAPH_SIZES, scratch_slot=SLOTS,
                                                    fixed_shape=True),
               "eager+graphs": ModelRunner(model, cache(), "none", GRAPH_SIZES, scratch_slot=SLOTS),
               "eager": ModelRunner(model, cache())}
    runners = {name: runner for name, runner in runners.items() if name in chosen}
    for name, runner in runners.items():
        if name != "eager":
            report["warm_up_s"][name] = round(runner.warm_up(SLOTS, range(1, MAX_GRAPH_WIDTH + 1)), 1)
            print(f"{name}: warm-up {report['warm_up_s'][name]} s, {len(runner.graphs)} graphs", flush=True)
        report["step_ms"][name] = {f"{b}x{w}": round(step_ms(runner, b, w, args.steps), 3) for b, w in SHAPES}
        print(f"{name:>22}: " + "  ".join(f"{k} {v:.2f}" for k, v in report["step_ms"][name].items()) + "  (ms/step)",
              flush=True)
        if runner.late_captures:
            print(f"{name}: {runner.late_captures} graphs captured after warm-up", flush=True)
        save(report, args.out)
    if "inductor" in chosen:
        runners["inductor"] = ModelRunner(model, cache(), "inductor")  # the same compiled forward, without graphs
    for name in [n for n in ("eager", "eager+graphs", "inductor", "inductor+graphs") if n in runners]:
        for b, w in ((1, 1), (1, 5), (8, 5)):
            p = kernel_profile(runners[name], b, w)
            report["kernels"][f"{name} {b}x{w}"] = p
            print(f"{name} {b}x{w}: {p['kernels']} kernels, GPU {p['gpu_ms']} ms, wall {p['wall_ms']} ms, "
                  f"host gap {p['host_gap_ms']} ms; top: " + ", ".join(f"{t['name'][:40]} x{t['count']}" for t in p["top"][:3]),
                  flush=True)
            save(report, args.out)


def save(report: dict, path: str | None):
    if path:
        with open(path, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
