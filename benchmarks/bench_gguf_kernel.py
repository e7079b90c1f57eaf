"""One matmul of the GGUF C kernel per block format: this tree's kernel against another commit's, alternated.

The default shape is SmolLM2-135M's ffn_down (576 outputs x 1536 inputs: the layers a K-quant mix file
stores as Q4_K/Q5_K/Q6_K), one row of x (a decode step), one thread, SwiGLU folded in as the engine runs that
layer (--plain for a bare matmul). Weights are random bytes with small scales (every nibble and bit pattern);
both builds read the same bytes. Each round times every format on both builds in turn (who goes first
alternates), as CPU time per call over --calls calls; the table gives each build's median over the rounds and
the median of the per-round ratios (this tree / the other) with a 95% bootstrap interval.

    python3 benchmarks/bench_gguf_kernel.py --against HEAD~1 [--rows 1] [--rounds 9] [--calls 400]
"""
import argparse
import ctypes
import random
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np

from autotune.embedded import quantize

BOOTSTRAP = 2000
ROOT = Path(__file__).resolve().parents[1]


def build_at(commit: str) -> ctypes.CDLL:
    """The kernel library built from commit's sources, with the engine's own flags."""
    folder = Path(tempfile.mkdtemp(prefix="kernel-"))
    sources = []
    for path in quantize.KERNEL_SOURCES:
        relative = path.relative_to(ROOT)
        text = subprocess.run(["git", "show", f"{commit}:{relative}"], cwd=ROOT, capture_output=True, check=True).stdout
        (folder / path.name).write_bytes(text)
        sources.append(folder / path.name)
    lib = ctypes.CDLL(str(quantize.compile_kernel(sources)))
    pointer, size = ctypes.c_void_p, ctypes.c_int64
    lib.gguf_linear.argtypes = [ctypes.c_int, pointer, size, size, pointer, size, pointer, size, pointer, ctypes.c_float,
                                ctypes.c_int, ctypes.c_int]
    lib.gguf_linear.restype = ctypes.c_int
    return lib


def as_read_by(lib, ggml_type: int, rows: np.ndarray, cols: int) -> np.ndarray:
    """rows as lib's gguf_linear reads them: repacked by lib where it repacks (from the commit after 01f2255 on)."""
    if not hasattr(lib, "gguf_pack"):
        return rows
    size = ctypes.c_int64
    lib.gguf_packed_row_bytes.argtypes, lib.gguf_packed_row_bytes.restype = [ctypes.c_int, size], size
    lib.gguf_pack.argtypes = [ctypes.c_int, ctypes.c_void_p, size, size, ctypes.c_void_p]
    packed = np.empty((rows.shape[0], lib.gguf_packed_row_bytes(ggml_type, cols)), np.uint8)
    lib.gguf_pack(ggml_type, rows.ctypes.data, rows.shape[0], cols, packed.ctypes.data)
    return packed


def random_rows(ggml_type: int, rows: int, cols: int, rng) -> np.ndarray:
    """Random bytes, then every fp16 scale field set to a small positive value (where each format keeps them)."""
    _, per_block, block_bytes = quantize.GGML_BLOCKS[ggml_type]
    raw = rng.integers(0, 256, (rows, cols // per_block, block_bytes), dtype=np.uint8)
    name = quantize.GGML_BLOCKS[ggml_type][0]
    fields = {"Q6_K": [block_bytes - 2]}.get(name, [0, 2] if name in ("Q4_1", "Q5_1", "Q4_K", "Q5_K") else [0])
    for at in fields:
        raw[..., at:at + 2] = rng.uniform(1e-3, 1e-2, (rows, cols // per_block, 1)).astype(np.float16).view(np.uint8)
    return raw.reshape(rows, -1)


def per_call_us(lib, ggml_type, x, w, y, rows, cols, gated, calls) -> float | None:
    def call():
        return lib.gguf_linear(ggml_type, x.ctypes.data, rows, cols, w.ctypes.data, w.shape[0], y.ctypes.data,
                               w.shape[0], None, 0.0, gated, 1)
    if call() != 0:
        return None  # a format that build does not run
    start = time.process_time()
    for _ in range(calls):
        call()
    return (time.process_time() - start) / calls * 1e6


def interval(ratios: list[float], seed: int) -> tuple[float, float]:
    rng = random.Random(seed)
    meds = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(BOOTSTRAP))
    return meds[int(0.025 * BOOTSTRAP)], meds[int(0.975 * BOOTSTRAP)]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", default="HEAD", help="the commit whose kernel is the baseline")
    parser.add_argument("--out-features", type=int, default=576)
    parser.add_argument("--in-features", type=int, default=1536)
    parser.add_argument("--rows", type=int, default=1, help="rows of x (1: a decode step)")
    parser.add_argument("--plain", action="store_true", help="a bare matmul, without the folded SwiGLU")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--calls", type=int, default=400)
    args = parser.parse_args()
    builds = {"this tree": quantize.build_kernel(), args.against: build_at(args.against)}
    rng = np.random.default_rng(0)
    gated = 0 if args.plain else 1
    x = rng.standard_normal((args.rows, args.in_features * (1 + gated))).astype(np.float32)
    y = np.empty((args.rows, args.out_features), np.float32)
    stored = {t: random_rows(t, args.out_features, args.in_features, rng) for t in quantize.GGML_BLOCKS}
    weights = {(t, b): as_read_by(lib, t, rows, args.in_features) for t, rows in stored.items() for b, lib in builds.items()}
    times = {key: [] for key in weights}
    for round_ in range(args.rounds):
        for t in stored:
            order = list(builds) if round_ % 2 == 0 else list(reversed(builds))
            for b in order:
                times[t, b].append(per_call_us(builds[b], t, x, weights[t, b], y, args.rows, args.in_features, gated,
                                               args.calls))
    print(f"{args.out_features} x {args.in_features}, {args.rows} row(s) of x, {'plain' if args.plain else 'SwiGLU folded'}, "
          f"1 thread, {args.rounds} rounds of {args.calls} calls; CPU time per call")
    print(f"| format | this tree (us) | {args.against} (us) | this tree / {args.against} (median of rounds) | 95% interval |")
    print("| --- | --- | --- | --- | --- |")
    for t in stored:
        new, old = times[t, "this tree"], times[t, args.against]
        name = quantize.GGML_BLOCKS[t][0]
        if None in old:
            print(f"| {name} | {statistics.median(new):.1f} | not run | - | - |")
            continue
        ratios = [a / b for a, b in zip(new, old)]
        low, high = interval(ratios, t)
        print(f"| {name} | {statistics.median(new):.1f} | {statistics.median(old):.1f} | {statistics.median(ratios):.2f}x "
              f"| {low:.2f}-{high:.2f}x |")


if __name__ == "__main__":
    main()
