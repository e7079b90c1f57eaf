"""A model bound to its KV cache, run eagerly, through torch.compile, or replayed from CUDA graphs.

CUDA graphs capture the decode/verify forward per (batch size, width T, layers): inputs are copied
into static buffers, the batch is padded up to the nearest captured size with rows that write to a
scratch cache slot, and attention spans the whole cache (a fixed shape; the mask hides the rest).
Anything else (prefill chunks, larger batches, CPU) runs the plain or compiled forward.
"""
import torch
from torch import Tensor

from autotune.embedded.config import MAX_DRAFT_LENGTH
from autotune.embedded.model import KVCache, Transformer

MAX_GRAPH_WIDTH = MAX_DRAFT_LENGTH + 1  # a verify step of the longest draft


class ModelRunner:
    def __init__(self, model: Transformer, cache: KVCache, compile: str = "none", graph_batch_sizes=(),
                 scratch_slot: int | None = None):
        self.model, self.cache = model, cache
        self.forward = model.forward
        if compile != "none":
            torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 256)
            self.forward = torch.compile(model.forward, backend=compile, dynamic=None)
        on_cuda = cache.device.type == "cuda"
        self.graph_sizes = sorted(graph_batch_sizes) if on_cuda and scratch_slot is not None else []
        self.scratch_slot = scratch_slot
        self.graphs: dict[tuple, tuple] = {}
        self.pool = None

    def __call__(self, input_ids: Tensor, input_pos: Tensor, rows: Tensor | None, kv_len: int,
                 num_layers: int | None = None, logits_from: int = 0) -> Tensor:
        batch, width = input_ids.shape
        if self.graph_sizes and not logits_from and width <= MAX_GRAPH_WIDTH and batch <= self.graph_sizes[-1]:
            return self._replay(input_ids, input_pos, rows, num_layers)
        return self.forward(input_ids, input_pos, self.cache, rows=rows, num_layers=num_layers, kv_len=kv_len,
                            logits_from=logits_from)

    def _replay(self, input_ids, input_pos, rows, num_layers):
        batch, width = input_ids.shape
        size = next(s for s in self.graph_sizes if s >= batch)
        key = (size, width, num_layers)
        if key not in self.graphs:
            self.graphs[key] = self._capture(size, width, num_layers)
        graph, ids, pos, slots, out = self.graphs[key]
        ids[:batch].copy_(input_ids)
        pos[:batch].copy_(input_pos)
        slots[:batch].copy_(rows if rows is not None else torch.arange(batch, device=ids.device))
        ids[batch:], pos[batch:], slots[batch:] = 0, 0, self.scratch_slot
        graph.replay()
        return out[:batch]

    def _capture(self, size: int, width: int, num_layers: int | None):
        device = self.cache.device
        ids = torch.zeros((size, width), dtype=torch.long, device=device)
        pos = torch.zeros((size, width), dtype=torch.long, device=device)
        slots = torch.full((size,), self.scratch_slot, dtype=torch.long, device=device)

        def run():
            return self.forward(ids, pos, self.cache, rows=slots, num_layers=num_layers, kv_len=self.cache.max_len)

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up (and compile) writes only the scratch slot
            for _ in range(2):
                run()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = run()
        self.pool = graph.pool()
        return graph, ids, pos, slots, out
