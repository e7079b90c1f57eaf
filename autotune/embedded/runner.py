"""A model bound to its KV cache, run eagerly, through torch.compile, or replayed from CUDA graphs.

Two kinds of call. A prefill chunk (logits_from > 0, or wider than any step) runs the eager forward:
prompt lengths vary with every request, and compiling each would recompile at serving time. A step
(decode, verify, draft pass: up to MAX_GRAPH_WIDTH wide) runs the compiled forward, compiled once with
dynamic shapes, so a new batch size, width or kv_len does not recompile it; on CUDA it replays a graph.

CUDA graphs are captured by warm_up(), before the engine serves, for every (batch size, width bucket)
the scheduler can produce: a step is padded up to the nearest captured batch size (rows that write
to a scratch cache slot) and width bucket (columns at the positions after the row's last, which the
mask hides and the next step overwrites), and attends the whole cache (a fixed shape).

fixed_shape pads every full-depth step to one shape (all slots x MAX_GRAPH_WIDTH, the whole cache):
each token is then computed by the same kernels whatever the draft length or the concurrency (a GEMM of
another width may pick another kernel and round differently), which should make greedy output on CUDA
the same with and without speculation. Checked on the CPU only so far (benchmarks/results/h200-2026-12-01b).
"""
import time

import torch
from torch import Tensor

from autotune.embedded.config import MAX_DRAFT_LENGTH
from autotune.embedded.model import KVCache, Transformer

MAX_GRAPH_WIDTH = MAX_DRAFT_LENGTH + 1  # a verify step of the longest draft
# Step widths are padded up to one of these: k = 4 and k = 8 verify without padding, and 6 buckets x
# the batch sizes stay a few dozen graphs. Padding costs little on a GPU (a step is launch-bound).
WIDTH_BUCKETS = (1, 2, 3, 5, 9, MAX_GRAPH_WIDTH)


def bucket(value: int, buckets) -> int:
    return next(b for b in buckets if b >= value)


class ModelRunner:
    def __init__(self, model: Transformer, cache: KVCache, compile: str = "none", graph_batch_sizes=(),
                 scratch_slot: int | None = None, fixed_shape: bool = False):
        self.model, self.cache = model, cache
        self.step_forward, self.compiled = model.forward, compile != "none"
        if self.compiled:
            # dynamic=True: one compilation covers every batch size, width and kv_len (besides the 0/1
            # specialisation of sizes); the cache keeps its static shape.
            # Each specialisation (batch or width 1, whole cache, a CPU's few-row GEMM) is one more entry.
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
            for tensor in cache.k + cache.v:
                torch._dynamo.mark_static(tensor)
            self.step_forward = torch.compile(model.forward, backend=compile, dynamic=True)
        on_cuda = cache.device.type == "cuda"
        self.graph_sizes = sorted(set(graph_batch_sizes)) if on_cuda and scratch_slot is not None else []
        self.scratch_slot = scratch_slot
        self.fixed_shape = fixed_shape and scratch_slot is not None
        if self.fixed_shape:  # one shape: all slots, the widest step
            self.graph_sizes = [scratch_slot] if self.graph_sizes else []
        self.graphs: dict[tuple, tuple] = {}
        self.pool = None
        self.late_captures = 0  # graphs captured after warm_up (a shape warm_up did not foresee)

    def __call__(self, input_ids: Tensor, input_pos: Tensor, rows: Tensor | None, kv_len: int,
                 num_layers: int | None = None, logits_from: int = 0) -> Tensor:
        batch, width = input_ids.shape
        if logits_from or width > MAX_GRAPH_WIDTH:
            return self.model(input_ids, input_pos, self.cache, rows=rows, num_layers=num_layers, kv_len=kv_len,
                              logits_from=logits_from)
        if not (self.compiled or self.graph_sizes or self.fixed_shape):  # eager: rows None reads the cache as a view
            return self.model(input_ids, input_pos, self.cache, rows=rows, num_layers=num_layers, kv_len=kv_len)
        rows = rows if rows is not None else torch.arange(batch, device=input_ids.device)
        if self.fixed_shape and num_layers is None:
            return self._padded(input_ids, input_pos, rows, self.scratch_slot, MAX_GRAPH_WIDTH, num_layers)
        if self.graph_sizes and batch <= self.graph_sizes[-1]:
            size, width_bucket = bucket(batch, self.graph_sizes), bucket(width, WIDTH_BUCKETS)
            return self._padded(input_ids, input_pos, rows, size, width_bucket, num_layers)
        # Standard strides, as warm_up's: dynamo guards them (even of size-1 dims, which contiguous() keeps),
        # and the scheduler's rows are a strided column of its packed ints.
        input_ids, input_pos, rows = (t.clone(memory_format=torch.contiguous_format) for t in (input_ids, input_pos, rows))
        return self.step_forward(input_ids, input_pos, self.cache, rows=rows, num_layers=num_layers, kv_len=kv_len)

    def _padded(self, input_ids, input_pos, rows, size, width_bucket, num_layers):
        """The step padded to [size, width_bucket], through its graph if graphs are on."""
        batch, width = input_ids.shape
        key = (size, width_bucket, num_layers)
        if self.graph_sizes and key not in self.graphs:
            self.late_captures += 1
            self.graphs[key] = self._capture(size, width_bucket, num_layers)
        if self.graph_sizes:
            graph, ids, pos, slots, out = self.graphs[key]
        else:
            ids, pos, slots = self._static_inputs(size, width_bucket)
        ids[:batch, :width].copy_(input_ids)
        ids[:batch, width:] = 0
        pos[:batch, :width].copy_(input_pos)
        pos[:batch, width:] = input_pos[:, -1:] + torch.arange(1, width_bucket - width + 1, device=pos.device)
        slots[:batch].copy_(rows)
        ids[batch:], pos[batch:], slots[batch:] = 0, 0, self.scratch_slot
        if self.graph_sizes:
            graph.replay()
        else:
            out = self._run(ids, pos, slots, num_layers)
        return out[:batch, :width]

    def _static_inputs(self, size: int, width: int):
        device = self.cache.device
        ids = torch.zeros((size, width), dtype=torch.long, device=device)
        pos = torch.zeros((size, width), dtype=torch.long, device=device)
        slots = torch.full((size,), self.scratch_slot, dtype=torch.long, device=device)
        return ids, pos, slots

    def _run(self, ids, pos, slots, num_layers):
        return self.step_forward(ids, pos, self.cache, rows=slots, num_layers=num_layers, kv_len=self.cache.max_len)

    def _capture(self, size: int, width: int, num_layers: int | None):
        ids, pos, slots = self._static_inputs(size, width)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up (and compile) writes only the scratch slot
            for _ in range(2):
                self._run(ids, pos, slots, num_layers)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # One pool for all graphs: they replay one at a time, and each keeps its output alive.
        with torch.cuda.graph(graph, pool=self.pool):
            out = self._run(ids, pos, slots, num_layers)
        self.pool = graph.pool()
        return graph, ids, pos, slots, out

    def warm_up(self, max_batch: int, widths, layer_counts=(None,)) -> float:
        """Compile and capture every step shape a scheduler of max_batch rows can produce with these
        widths and depths, before serving; returns the seconds it took (launch cost, not serving time)."""
        start = time.perf_counter()
        device, max_len = self.cache.device, self.cache.max_len
        for num_layers in layer_counts:
            for batch in range(1, max_batch + 1):
                for width in widths:
                    ids = torch.zeros((batch, width), dtype=torch.long, device=device)
                    pos = torch.arange(width, device=device).repeat(batch, 1)
                    # A kv_len short of the cache and the whole cache: slicing all of it specialises.
                    for kv_len in {min(max_len - 1, 2 * MAX_GRAPH_WIDTH), max_len}:
                        self(ids, pos, None, kv_len, num_layers=num_layers)
        if device.type == "cuda":
            torch.cuda.synchronize()
        self.late_captures = 0
        return time.perf_counter() - start
