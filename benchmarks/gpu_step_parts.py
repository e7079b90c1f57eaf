"""What each part of a CUDA decode/verify step costs, per (batch, width), and what the alternatives cost.

A step of the embedded model is 30 layers of: fused q/k/v matmul, RoPE, KV write, attention over the
whole cache (the graphs' fixed shape), output matmul, gate/up matmul, SwiGLU, down matmul, two RMSNorms;
then the head. This times each part alone, replayed from a CUDA graph of REPEAT calls (so launch gaps are
the graph's, as in the engine), for the SmolLM2-135M shapes, and the candidate replacements:

- matmuls: cuBLAS (F.linear, what eager and inductor's extern mm run) against a row-dot form that
  inductor compiles into one Triton reduction kernel (each output a dot product over the input
  width, the weight read from L2 once per row: a few rows is what a decode or verify step has), and
  against inductor's max-autotune (Triton GEMM templates compete with cuBLAS) for a few shapes;
- attention: SDPA with the bool mask and enable_gqa (the engine's --step-attention sdpa), SDPA with the
  query heads grouped under their KV head (no KV repeat, a mask per group), the explicit
  matmul-softmax-matmul form, and the engine's Triton step kernel (kernels/step_attention.py).

    python3 benchmarks/gpu_step_parts.py [--no-autotune] [--out parts.json]
"""
import argparse
import json

import torch
import torch.nn.functional as F
from profile_gpu_decode import SMOLLM2_135M as M  # the bundled model's shapes, as the engine loads it

DIM, HEADS, KV_HEADS, HEAD_DIM, FFN, VOCAB, CACHE = (M.dim, M.n_heads, M.n_kv_heads, M.head_dim, M.intermediate_size,
                                                     M.vocab_size, M.max_seq_len)
SHAPES = [(1, 1), (1, 2), (1, 5), (1, 9), (4, 1), (4, 5), (8, 1), (8, 9)]
TUNED_SHAPES = [(1, 1), (1, 5), (8, 9)]
MATMULS = {"qkv": (DIM, (HEADS + 2 * KV_HEADS) * HEAD_DIM), "o": (HEADS * HEAD_DIM, DIM), "gate_up": (DIM, 2 * FFN),
           "down": (FFN, DIM), "head": (DIM, VOCAB)}
REPEAT = 20


def graph_us(fn, *args) -> float:
    """Microseconds per call of fn(*args) replayed REPEAT times inside one CUDA graph (median of 7 replays)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn(*args)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(REPEAT):
            fn(*args)
    times = []
    for _ in range(7):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / REPEAT)
    return sorted(times)[len(times) // 2]


def rowdot(x, w):
    return (x[..., None, :].float() * w.float()).sum(-1).to(x.dtype)


def sdpa_gqa(q, k, v, mask):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


def sdpa_grouped(q, k, v, mask):
    """Queries of one KV head's group stacked along the sequence axis: [B, Hkv, G*T, D] against [B, Hkv, L, D]."""
    b, h, t, d = q.shape
    group = h // k.shape[1]
    qg = q.reshape(b, k.shape[1], group * t, d)
    out = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask.repeat(1, 1, group, 1))
    return out.reshape(b, h, t, d)


def explicit(q, k, v, mask):
    b, h, t, d = q.shape
    group = h // k.shape[1]
    qg = q.reshape(b, k.shape[1], group * t, d)
    scores = (qg @ k.transpose(-1, -2)).float() * d ** -0.5
    scores = scores.masked_fill(~mask.repeat(1, 1, group, 1), float("-inf"))
    return (scores.softmax(-1).to(q.dtype) @ v).reshape(b, h, t, d)


def triton_step(q, k, v, mask):
    """The engine's kernel on the same inputs (q as [B, T, H, D]; positions recovered from the mask)."""
    from autotune.embedded.kernels.step_attention import step_attention_op

    pos = mask[:, 0].sum(-1) - 1
    slots = torch.arange(q.shape[0], device=q.device)
    return step_attention_op(q.transpose(1, 2), k, v, slots, pos, k.shape[2]).transpose(1, 2)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out")
    parser.add_argument("--no-autotune", dest="autotune", action="store_false", help="skip max-autotune (minutes)")
    args = parser.parse_args()
    torch.manual_seed(0)
    dev, dt = "cuda", torch.bfloat16
    weights = {name: torch.randn(n_out, n_in, device=dev, dtype=dt) * 0.02 for name, (n_in, n_out) in MATMULS.items()}
    torch._dynamo.config.recompile_limit = 1000  # one compilation per shape, on purpose
    linear_tuned = torch.compile(F.linear, mode="max-autotune-no-cudagraphs", dynamic=False)
    rowdot_inductor = torch.compile(rowdot, dynamic=False)
    attention = {"sdpa_gqa": sdpa_gqa, "sdpa_grouped": sdpa_grouped, "explicit": explicit,
                 "explicit_inductor": torch.compile(explicit, dynamic=False), "triton_step": triton_step}
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "repeat": REPEAT, "us": {}}
    for batch, width in SHAPES:
        rows = {}
        for name, w in weights.items():
            x = torch.randn(batch, width, w.shape[1], device=dev, dtype=dt)
            rows[f"{name} cublas"] = graph_us(F.linear, x, w)
            rows[f"{name} rowdot"] = graph_us(rowdot_inductor, x, w)
            if args.autotune and (batch, width) in TUNED_SHAPES:  # autotuning every shape would take minutes
                rows[f"{name} max-autotune"] = graph_us(linear_tuned, x, w)
        q = torch.randn(batch, HEADS, width, HEAD_DIM, device=dev, dtype=dt)
        k = torch.randn(batch, KV_HEADS, CACHE, HEAD_DIM, device=dev, dtype=dt)
        v = torch.randn_like(k)
        pos = 300 + torch.arange(width, device=dev).repeat(batch, 1)
        mask = (torch.arange(CACHE, device=dev)[None, None, :] <= pos[:, :, None])[:, None]
        reference = explicit(q, k, v, mask).float()
        for name, fn in attention.items():
            error = (fn(q, k, v, mask).float() - reference).abs().max().item()
            rows[f"attention {name}"] = graph_us(fn, q, k, v, mask)
            rows[f"attention {name} max_abs_err"] = error
        report["us"][f"{batch}x{width}"] = {key: round(value, 3) for key, value in rows.items()}
        print(f"{batch}x{width}: " + ", ".join(f"{key} {value:.1f}" for key, value in rows.items()), flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
