"""Attention of a decode or verify step on CUDA: a few queries a row against the whole KV cache (Triton).

Why: SDPA with the position mask runs such a step as one tile of queries walking all 2065 cache
positions in sequence: 66 us a layer for a 5-wide verify step on the H200, against 5 us for a 1-wide
step, so every verify step cost 2.5 plain steps (benchmarks/results/h200-2026-12-01e/parts.json). Here
the cache is split into chunks that run in parallel (flash-decoding), each chunk stops at the row's
last position, and the two passes are:

1. per (row, KV head, chunk): the GQA group's queries (all heads sharing that KV head, every column
   of the step, stacked as rows of one tile) against the chunk's keys, with an online softmax; writes
   the chunk's unnormalised output, running max and sum;
2. per (row, KV head): the chunks merged by their maxima, written as [B, T, H, D].

Key j is visible to query (b, t) iff j <= pos[b, t] (the engine's causal-by-position mask). The cache
is read through the rows' slots, so no gathered copy of it is made.
"""
import torch
import triton
import triton.language as tl

BLOCK_N = 64  # keys per tile
TARGET_SPLITS = 16  # chunks of one (row, KV head): enough programs for a GPU's SMs at batch 1


@triton.jit
def _chunk_kernel(Q, K, V, Slots, Pos, PartOut, PartMax, PartSum, kv_len, chunk, scale,
                  stride_qb, stride_qt, stride_qh, stride_qd, stride_ks, stride_kh, stride_kl, stride_sb, stride_pb, T,
                  N_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, SPLITS: tl.constexpr, BLOCK_Q: tl.constexpr,
                  BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr):
    row_head, split = tl.program_id(0), tl.program_id(1)
    b, kv_head = row_head // N_KV_HEADS, row_head % N_KV_HEADS
    r = tl.arange(0, BLOCK_Q)  # tile row r: query head kv_head * GROUP + r // T, column r % T
    live = r < GROUP * T
    t, head = r % T, kv_head * GROUP + r // T
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + b * stride_qb + t[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :] * stride_qd,
                mask=live[:, None], other=0.0)
    pos = tl.load(Pos + b * stride_pb + t, mask=live, other=-1)
    slot = tl.load(Slots + b * stride_sb)  # the scheduler's slots are a strided column of its packed ints
    lo = split * chunk
    hi = tl.minimum(tl.minimum(lo + chunk, kv_len), tl.max(pos, 0) + 1)  # no key past the row's last position
    base = slot.to(tl.int64) * stride_ks + kv_head * stride_kh
    running_max = tl.full([BLOCK_Q], -1e30, tl.float32)  # finite: a fully masked row then sums exp(-inf) = 0
    running_sum = tl.zeros([BLOCK_Q], tl.float32)
    acc = tl.zeros([BLOCK_Q, HEAD_DIM], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        in_chunk = n < hi
        k = tl.load(K + base + n[:, None] * stride_kl + d[None, :], mask=in_chunk[:, None], other=0.0)
        scores = tl.dot(q, tl.trans(k)) * scale
        scores = tl.where((n[None, :] <= pos[:, None]) & in_chunk[None, :], scores, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, 1))
        alpha = tl.exp(running_max - new_max)
        p = tl.exp(scores - new_max[:, None])
        running_sum = running_sum * alpha + tl.sum(p, 1)
        v = tl.load(V + base + n[:, None] * stride_kl + d[None, :], mask=in_chunk[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        running_max = new_max
    part = row_head * SPLITS + split
    tl.store(PartOut + (part * BLOCK_Q + r[:, None]) * HEAD_DIM + d[None, :], acc)
    tl.store(PartMax + part * BLOCK_Q + r, running_max)
    tl.store(PartSum + part * BLOCK_Q + r, running_sum)


@triton.jit
def _merge_kernel(PartOut, PartMax, PartSum, Out, stride_ob, stride_ot, stride_oh, T,
                  N_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, SPLITS: tl.constexpr, BLOCK_Q: tl.constexpr,
                  HEAD_DIM: tl.constexpr):
    row_head = tl.program_id(0)
    b, kv_head = row_head // N_KV_HEADS, row_head % N_KV_HEADS
    r = tl.arange(0, BLOCK_Q)
    d = tl.arange(0, HEAD_DIM)
    first = row_head * SPLITS * BLOCK_Q
    overall = tl.full([BLOCK_Q], -1e30, tl.float32)
    for s in tl.static_range(SPLITS):
        overall = tl.maximum(overall, tl.load(PartMax + first + s * BLOCK_Q + r))
    total = tl.zeros([BLOCK_Q], tl.float32)
    acc = tl.zeros([BLOCK_Q, HEAD_DIM], tl.float32)
    for s in tl.static_range(SPLITS):
        weight = tl.exp(tl.load(PartMax + first + s * BLOCK_Q + r) - overall)
        total += weight * tl.load(PartSum + first + s * BLOCK_Q + r)
        acc += weight[:, None] * tl.load(PartOut + (first + s * BLOCK_Q + r[:, None]) * HEAD_DIM + d[None, :])
    out = acc / tl.where(total > 0, total, 1.0)[:, None]
    live = r < GROUP * T
    t, head = r % T, kv_head * GROUP + r // T
    tl.store(Out + b * stride_ob + t[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
             out.to(Out.dtype.element_ty), mask=live[:, None])


def max_width(n_heads: int, n_kv_heads: int, head_dim: int) -> int:
    """The widest step this kernel takes: a tile of at most 128 query rows, a power-of-two head size (tl.arange)."""
    return 128 // (n_heads // n_kv_heads) if head_dim >= 16 and head_dim & (head_dim - 1) == 0 else 0


def step_attention(q, k_cache, v_cache, slots, pos, kv_len: int):
    """q [B, T, H, D] (rotated), caches [slots, Hkv, L, D], slots [B], pos [B, T] -> [B, T, H, D]."""
    batch, width, n_heads, head_dim = q.shape
    n_kv_heads, max_len = k_cache.shape[1], k_cache.shape[2]
    group = n_heads // n_kv_heads
    block_q = max(16, triton.next_power_of_2(group * width))  # tl.dot takes tiles of 16 rows and up
    chunk = BLOCK_N * triton.cdiv(max_len, BLOCK_N * TARGET_SPLITS)
    splits = triton.cdiv(max_len, chunk)  # from the cache's (static) length: one graph serves every position
    parts = batch * n_kv_heads * splits * block_q
    part_out = torch.empty((parts, head_dim), dtype=torch.float32, device=q.device)
    part_max = torch.empty(parts, dtype=torch.float32, device=q.device)
    part_sum = torch.empty(parts, dtype=torch.float32, device=q.device)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # contiguous, whatever q's strides (RoPE's are not)
    _chunk_kernel[(batch * n_kv_heads, splits)](
        q, k_cache, v_cache, slots, pos, part_out, part_max, part_sum, kv_len, chunk, head_dim ** -0.5,
        q.stride(0), q.stride(1), q.stride(2), q.stride(3), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        slots.stride(0), pos.stride(0), width, N_KV_HEADS=n_kv_heads, GROUP=group, SPLITS=splits, BLOCK_Q=block_q, BLOCK_N=BLOCK_N, HEAD_DIM=head_dim)
    _merge_kernel[(batch * n_kv_heads,)](
        part_out, part_max, part_sum, out, out.stride(0), out.stride(1), out.stride(2), width,
        N_KV_HEADS=n_kv_heads, GROUP=group, SPLITS=splits, BLOCK_Q=block_q, HEAD_DIM=head_dim)
    return out


@torch.library.custom_op("autotune::step_attention", mutates_args=())
def step_attention_op(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                      pos: torch.Tensor, kv_len: int) -> torch.Tensor:
    """step_attention as one opaque op: torch.compile calls it as it is, so its Triton launch parameters (the
    tile size follows the width) never make dynamo specialise or recompile the model's forward."""
    return step_attention(q, k_cache, v_cache, slots, pos, kv_len)


@step_attention_op.register_fake
def _(q, k_cache, v_cache, slots, pos, kv_len):
    return torch.empty(q.shape, dtype=q.dtype, device=q.device)
