"""The Triton step attention (kernels/step_attention.py) against SDPA, run by Triton's interpreter on the CPU.

TRITON_INTERPRET=1 makes @triton.jit kernels run as NumPy on CPU tensors: the same kernel code the H200 runs,
checked here without a GPU (speed is measured on the device: benchmarks/results/h200-2026-12-01e).
"""
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import httpx

INTERPRETED = {**os.environ, "TRITON_INTERPRET": "1"}

KERNEL_CHECK = r"""
import torch
import torch.nn.functional as F
from autotune.embedded.kernels.step_attention import max_width, step_attention_op

torch.manual_seed(0)
worst = 0.0
# (batch, width, heads, kv heads, head dim, cache length, slots): decode, verify widths, GQA groups of 3 and 1,
# a cache longer than one chunk, rows at the cache's start and near its end
for batch, width, heads, kv_heads, dim, length, slots in [(1, 1, 9, 3, 64, 2065, 2), (2, 5, 9, 3, 64, 300, 3),
                                                          (3, 17, 4, 4, 32, 200, 4), (2, 9, 8, 2, 16, 1100, 2)]:
    assert width <= max_width(heads, kv_heads, dim)
    q = torch.randn(batch, width, heads, 2 * dim)[..., ::2]  # strided, like RoPE's output
    k_cache, v_cache = torch.randn(slots, kv_heads, length, dim), torch.randn(slots, kv_heads, length, dim)
    starts = torch.tensor([0, length - width][:batch] + [length // 3] * max(0, batch - 2))
    pos = starts[:, None] + torch.arange(width)
    # The kernel reads the cache through the rows' slots: a strided column of packed ints, as the scheduler's
    # (newest token, position, slot) rows are; a kernel reading them as contiguous reads tokens as slots.
    rows = torch.stack([torch.randint(10**6, 10**7, (batch,)), starts, torch.randperm(slots)[:batch]], 1)[:, 2]
    out = step_attention_op(q, k_cache, v_cache, rows, pos, length)
    mask = (torch.arange(length)[None, None, :] <= pos[:, :, None])[:, None]
    reference = F.scaled_dot_product_attention(q.transpose(1, 2), k_cache[rows], v_cache[rows], attn_mask=mask,
                                               enable_gqa=heads != kv_heads).transpose(1, 2)
    worst = max(worst, (out - reference).abs().max().item())
assert max_width(9, 3, 64) == 42 and max_width(9, 3, 80) == 0  # tiles of <= 128 rows, power-of-two heads only
print(worst)
"""


def test_kernel_matches_sdpa_on_every_step_shape():
    done = subprocess.run([sys.executable, "-c", KERNEL_CHECK], env=INTERPRETED, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert float(done.stdout.split()[-1]) < 1e-5


def test_model_logits_match_sdpa_with_the_kernel(tiny_checkpoint):
    """A decode step and a 6-wide verify step through the model, with and without the kernel."""
    check = rf"""
import torch
from autotune.embedded.kernels.step_attention import max_width, step_attention_op
from autotune.embedded.model import KVCache
from autotune.embedded.weights import load_model

loaded = load_model({tiny_checkpoint!r}, max_seq_len=100)
model, args = loaded.model, loaded.args
cache = KVCache(args, 3, 100, torch.float32)
prompt = torch.randint(0, args.vocab_size, (2, 20))
model(prompt, torch.arange(20).repeat(2, 1), cache, rows=torch.tensor([2, 0]), kv_len=100)
step_ids, rows = torch.randint(0, args.vocab_size, (2, 6)), torch.tensor([2, 0])
outputs = []
for kernel in (None, step_attention_op):
    model.use_step_attention(kernel, max_width)
    for width in (1, 6):
        outputs.append(model(step_ids[:, :width], 20 + torch.arange(width).repeat(2, 1), cache, rows=rows, kv_len=100))
print(max((a - b).abs().max().item() for a, b in zip(outputs[:2], outputs[2:])))
"""
    done = subprocess.run([sys.executable, "-c", check], env=INTERPRETED, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert float(done.stdout.split()[-1]) < 1e-4


def test_served_greedy_tokens_are_the_same_with_the_kernel(tiny_checkpoint, start_embedded_server, monkeypatch):
    """Two servers, SDPA and the kernel, n-gram drafting (verify widths > 1), three requests at once (three
    slots); the first ends early, so the later steps batch slots 1 and 2 (rows other than 0..B-1)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    texts = {}
    requests = [("a b a b a b a b", 4), ("x = 1\ny = 2\nx = 1\ny =", 20), ("def f(x):\n    return x", 20)]
    for attention in ("sdpa", "triton"):
        server = start_embedded_server(model=tiny_checkpoint, drafter="ngram", draft_length=4, verify_slots=3,
                                       max_seq_len=100, device="cpu", step_attention=attention)
        with httpx.Client(base_url=server.url, timeout=300) as client, ThreadPoolExecutor(3) as pool:
            replies = pool.map(lambda request: client.post("/v1/completions", json={
                "prompt": request[0], "max_tokens": request[1], "temperature": 0, "ignore_eos": True}).json(),
                requests)
            texts[attention] = [reply["choices"][0]["text"] for reply in replies]
        assert "step attention" in server.log() or attention == "sdpa"
    assert texts["triton"] == texts["sdpa"]


def test_triton_step_attention_on_a_cpu_is_refused_in_one_line():
    done = subprocess.run([sys.executable, "-m", "autotune.cli", "serve", "--device", "cpu", "--step-attention",
                           "triton"], env={k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"},
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == "error: step_attention triton needs a CUDA device"

