"""A model bound to its KV cache, run eagerly, through torch.compile, or replayed from CUDA graphs.

Two kinds of call. A prefill chunk (logits_from > 0, or wider than any step) runs the eager forward:
prompt lengths vary with every request, and compiling each would recompile at serving time. A step
(decode, verify, draft pass: up to MAX_GRAPH_WIDTH wide) runs the compiled forward, compiled once with
dynamic shapes, so a new batch size, width or kv_len does not recompile it; on CUDA it replays a graph.

CUDA graphs are captured by warm_up(), before the engine serves, for every (batch size, width bucket)
the scheduler can produce: a step is padded up to the nearest captured batch size (rows that write
to a scratch cache slot) and width bucket (columns at the positions after the row's last, which the
mask hides and the next step overwrites), and attends the whole cache (a fixed shape). Each graph reads
its inputs from one packed buffer and also writes the argmax of its logits, so a greedy step whose
inputs are on the host (plain decode, n-gram drafts) is one copy in, one replay, one copy out
(host_greedy): on a GPU a small model's step is launch-bound, and each eager op around the replay
cost about as much host time as a layer's kernels.

Prefill never runs through cuDNN's attention: SDPA picks it for a masked call on Hopper, and it builds a
plan per new shape (hundreds of ms each, sglang#4650). Where steps replay graphs, a prefill chunk replays one
too: padded up to a width bucket (prefill_buckets; the padding columns sit at positions after the chunk's
last, as a step's do), the eager forward captured over the whole cache. Eagerly, a chunk costs tens of ms
of kernel launches on a GPU, more than the first token of a short answer takes to decode. Elsewhere
(no graphs, a batch of several prompts, a drafter's shallower pass) prefill runs eagerly at its own shape.

fixed_shape pads every full-depth step to one shape (all slots x MAX_GRAPH_WIDTH, the whole cache):
each token is then computed by the same kernels whatever the draft length or the concurrency (a GEMM of
another width may pick another kernel and round differently), which should make greedy output on CUDA
the same with and without speculation. Checked on the CPU only so far (benchmarks/results/h200-2026-12-01b).
"""
import time

import numpy as np
import torch
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

from autotune.embedded.config import MAX_DRAFT_LENGTH
from autotune.embedded.model import KVCache, Transformer

MAX_GRAPH_WIDTH = MAX_DRAFT_LENGTH + 1  # a verify step of the longest draft
# Step widths are padded up to one of these: k = 4 and k = 8 verify without padding, and 6 buckets x
# the batch sizes stay a few dozen graphs. Padding costs little on a GPU (a step is launch-bound).
WIDTH_BUCKETS = (1, 2, 3, 5, 9, MAX_GRAPH_WIDTH)
PREFILL_GRAPH_MAX_WIDTH = 512
PREFILL_ATTENTION = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def bucket(value: int, buckets) -> int:
    return next(b for b in buckets if b >= value)


def prefill_buckets(max_chunk: int) -> tuple[int, ...]:
    """The widths prefill chunks of up to max_chunk tokens are padded to: powers of two from 32, then the
    widest chunk. Narrower chunks pad to 32 too (a chunk whose head skips its first positions is no step).
    Chunks past PREFILL_GRAPH_MAX_WIDTH run eagerly: there compute outweighs launches, and each graph keeps
    its logits [width, vocab] alive."""
    widest = min(max_chunk, PREFILL_GRAPH_MAX_WIDTH)
    widths = [32]
    while widths[-1] < widest:
        widths.append(widths[-1] * 2)
    return (*widths[:-1], max(widest, 32))


class _StepGraph:
    """One step shape's static inputs (views of `packed`) and, once captured, its graph and outputs."""

    def __init__(self, packed: Tensor, ids: Tensor, pos: Tensor, slots: Tensor):
        self.packed, self.ids, self.pos, self.slots = packed, ids, pos, slots
        self.graph = self.logits = self.tokens = self.host_in = self.host_out = None


class ModelRunner:
    def __init__(self, model: Transformer, cache: KVCache, compile: str = "none", graph_batch_sizes=(),
                 scratch_slot: int | None = None, fixed_shape: bool = False, prefill_widths=()):
        """prefill_widths: the buckets single-prompt prefill chunks pad to (prefill_buckets), each a graph
        where steps are graphed, else run padded without one; empty: prefill at the chunk's own width."""
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
        self.prefill_widths = tuple(prefill_widths) if scratch_slot is not None else ()
        self.graphs: dict[tuple, _StepGraph] = {}  # (batch size, width, layers) of a step; ("prefill", width)
        self.pool = None
        self.late_captures = 0  # graphs captured after warm_up (a shape warm_up did not foresee)

    def __call__(self, input_ids: Tensor, input_pos: Tensor, rows: Tensor | None, kv_len: int,
                 num_layers: int | None = None, logits_from: int = 0, logits_to: int | None = None) -> Tensor:
        batch, width = input_ids.shape
        if logits_from or width > MAX_GRAPH_WIDTH:
            if batch == 1 and num_layers is None and self.prefill_widths and width <= self.prefill_widths[-1]:
                return self._padded_prefill(input_ids, input_pos, rows)[:, logits_from:logits_to or width]
            with sdpa_kernel(PREFILL_ATTENTION):
                return self.model(input_ids, input_pos, self.cache, rows=rows, num_layers=num_layers, kv_len=kv_len,
                                  logits_from=logits_from, logits_to=logits_to)
        return self._step(input_ids, input_pos, rows, kv_len, num_layers)[:, :logits_to]

    def _step(self, input_ids: Tensor, input_pos: Tensor, rows: Tensor | None, kv_len: int,
              num_layers: int | None) -> Tensor:
        batch, width = input_ids.shape
        if not (self.compiled or self.graph_sizes or self.fixed_shape):  # eager: rows None reads the cache as a view
            return self.model(input_ids, input_pos, self.cache, rows=rows, num_layers=num_layers, kv_len=kv_len)
        rows = rows if rows is not None else torch.arange(batch, device=input_ids.device)
        shape = self._padded_shape(batch, width, num_layers)
        if shape:
            return self._padded(input_ids, input_pos, rows, *shape, num_layers)
        # Standard strides, as warm_up's: dynamo guards them (even of size-1 dims, which contiguous() keeps),
        # and the scheduler's rows are a strided column of its packed ints.
        input_ids, input_pos, rows = (t.clone(memory_format=torch.contiguous_format) for t in (input_ids, input_pos, rows))
        return self.step_forward(input_ids, input_pos, self.cache, rows=rows, num_layers=num_layers, kv_len=kv_len)

    @property
    def pads_steps(self) -> bool:
        """Whether steps run padded (graphs, or one fixed shape): those host_greedy can take."""
        return bool(self.graph_sizes or self.fixed_shape)

    def _padded_shape(self, batch: int, width: int, num_layers: int | None) -> tuple[int, int] | None:
        """The [size, width bucket] a step is padded to, or None where it runs at its own shape."""
        if self.fixed_shape and num_layers is None:
            return self.scratch_slot, MAX_GRAPH_WIDTH
        if self.graph_sizes and batch <= self.graph_sizes[-1]:
            return bucket(batch, self.graph_sizes), bucket(width, WIDTH_BUCKETS)
        return None

    def _padded(self, input_ids, input_pos, rows, size, width_bucket, num_layers):
        """The step padded to [size, width_bucket], through its graph if graphs are on."""
        batch, width = input_ids.shape
        step = self._graph(size, width_bucket, num_layers) if self.graph_sizes else self._static_inputs(size, width_bucket)
        ids, pos, slots = step.ids, step.pos, step.slots
        ids[:batch, :width].copy_(input_ids)
        ids[:batch, width:] = 0
        pos[:batch, :width].copy_(input_pos)
        pos[:batch, width:] = input_pos[:, -1:] + torch.arange(1, width_bucket - width + 1, device=pos.device)
        slots[:batch].copy_(rows)
        ids[batch:], pos[batch:], slots[batch:] = 0, 0, self.scratch_slot
        if self.graph_sizes:
            step.graph.replay()
            return step.logits[:batch, :width]
        return self._run_static(step, num_layers)[:batch, :width]

    def _padded_prefill(self, input_ids: Tensor, input_pos: Tensor, rows: Tensor | None) -> Tensor:
        """A one-prompt chunk's logits [1, bucket, V], padded to its width bucket, through its graph if steps
        are graphed. The padding columns write the cache after the chunk's last position (clamped into the
        cache), where the mask hides them from the chunk and the next chunk or step overwrites them."""
        width = input_ids.shape[1]
        width_bucket = bucket(width, self.prefill_widths)
        step = self._prefill_graph(width_bucket) if self.graph_sizes else self._static_inputs(1, width_bucket)
        step.ids[:, :width].copy_(input_ids)
        step.ids[:, width:] = 0
        step.pos[:, :width].copy_(input_pos)
        pad = input_pos[:, -1:] + torch.arange(1, width_bucket - width + 1, device=input_pos.device)
        step.pos[:, width:] = pad.clamp_(max=self.cache.max_len - 1)
        step.slots.copy_(rows if rows is not None else step.slots.new_zeros(1))
        if self.graph_sizes:
            step.graph.replay()
            return step.logits
        return self._prefill_forward(*(t.clone(memory_format=torch.contiguous_format)
                                       for t in (step.ids, step.pos, step.slots)))[0]

    def _prefill_graph(self, width: int) -> _StepGraph:
        key = ("prefill", width)
        if key not in self.graphs:
            self.late_captures += 1
            self.graphs[key] = self._capture(1, width, self._prefill_forward)
        return self.graphs[key]

    def _prefill_forward(self, ids: Tensor, pos: Tensor, slots: Tensor) -> tuple[Tensor, None]:
        with sdpa_kernel(PREFILL_ATTENTION):
            return self.model(ids, pos, self.cache, rows=slots, kv_len=self.cache.max_len), None

    def host_greedy(self, input_ids: np.ndarray, input_pos: np.ndarray, rows: np.ndarray) -> np.ndarray | None:
        """The argmax of a full-depth step's logits [B, T], for host inputs ([B, T], [B, T], [B]), as a host
        array; None where the step is not padded (the caller runs it through __call__).

        _padded's padding, done in numpy into pinned memory: one copy in, the replay, one copy out.
        """
        batch, width = input_ids.shape
        shape = self._padded_shape(batch, width, None) if width <= MAX_GRAPH_WIDTH else None
        if not shape:
            return None
        size, width_bucket = shape
        step = self._graph(size, width_bucket, None) if self.graph_sizes else self._static_inputs(size, width_bucket)
        host_in = step.host_in if self.graph_sizes else torch.empty(step.packed.shape, dtype=torch.long)
        packed = host_in.numpy()
        ids, pos, slots = packed[:, :width_bucket], packed[:, width_bucket:-1], packed[:, -1]
        ids[:batch, :width], ids[:batch, width:] = input_ids, 0
        pos[:batch, :width] = input_pos
        pos[:batch, width:] = input_pos[:, -1:] + np.arange(1, width_bucket - width + 1)
        slots[:batch] = rows
        ids[batch:], pos[batch:], slots[batch:] = 0, 0, self.scratch_slot
        step.packed.copy_(host_in, non_blocking=True)
        if not self.graph_sizes:
            return self._run_static(step, None).argmax(-1)[:batch, :width].cpu().numpy()
        step.graph.replay()
        step.host_out.copy_(step.tokens, non_blocking=True)
        torch.cuda.current_stream().synchronize()  # waits with the GIL released: the server's loop runs meanwhile
        return step.host_out.numpy()[:batch, :width]

    def _graph(self, size: int, width: int, num_layers: int | None) -> _StepGraph:
        key = (size, width, num_layers)
        if key not in self.graphs:
            self.late_captures += 1
            self.graphs[key] = self._capture(size, width, lambda *inputs: self._greedy_step(*inputs, num_layers))
        return self.graphs[key]

    def _static_inputs(self, size: int, width: int) -> _StepGraph:
        """A step's padded inputs, as views of one packed [size, 2 * width + 1] buffer (ids, positions, slot)."""
        packed = torch.zeros((size, 2 * width + 1), dtype=torch.long, device=self.cache.device)
        packed[:, -1] = self.scratch_slot
        return _StepGraph(packed, packed[:, :width], packed[:, width:-1], packed[:, -1])

    def _run(self, ids, pos, slots, num_layers):
        return self.step_forward(ids, pos, self.cache, rows=slots, num_layers=num_layers, kv_len=self.cache.max_len)

    def _greedy_step(self, ids, pos, slots, num_layers):
        logits = self._run(ids, pos, slots, num_layers)
        return logits, logits.argmax(-1)

    def _run_static(self, step: _StepGraph, num_layers):
        # Standard strides (views of the packed buffer are not): dynamo guards them, as in __call__.
        ids, pos, slots = (t.clone(memory_format=torch.contiguous_format) for t in (step.ids, step.pos, step.slots))
        return self._run(ids, pos, slots, num_layers)

    def _capture(self, size: int, width: int, forward) -> _StepGraph:
        """A graph of forward(ids, pos, slots) -> (logits, argmax or None) over a [size, width] input."""
        step = self._static_inputs(size, width)
        # The forward reads contiguous copies (the strides warm_up compiled for), made inside the graph.
        ids, pos, slots = (torch.empty_like(t, memory_format=torch.contiguous_format)
                           for t in (step.ids, step.pos, step.slots))

        def run():
            ids.copy_(step.ids), pos.copy_(step.pos), slots.copy_(step.slots)
            return forward(ids, pos, slots)

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up (and compile) writes only the scratch slot
            for _ in range(2):
                run()
        torch.cuda.current_stream().wait_stream(side)
        step.graph = torch.cuda.CUDAGraph()
        # One pool for all graphs: they replay one at a time, and each keeps its output alive.
        with torch.cuda.graph(step.graph, pool=self.pool):
            step.logits, step.tokens = run()
        self.pool = step.graph.pool()
        if step.tokens is not None:  # a step's, for host_greedy
            step.host_in = torch.empty(step.packed.shape, dtype=torch.long, pin_memory=True)
            step.host_out = torch.empty(step.tokens.shape, dtype=torch.long, pin_memory=True)
        return step

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
        if self.graph_sizes:
            for width in self.prefill_widths:  # capture each prefill bucket (writes only the scratch slot)
                self._prefill_graph(width)
        if device.type == "cuda":
            torch.cuda.synchronize()
        self.late_captures = 0
        return time.perf_counter() - start

