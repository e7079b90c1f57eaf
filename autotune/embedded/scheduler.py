"""The embedded engine: continuous batching of speculative steps on one background thread.

Each turn of the loop admits queued requests into free cache slots (FIFO), feeds one prefill chunk
of the oldest prefilling request (so a long prompt never stalls running streams for long), then
runs one speculative step (generate.py) over every decoding request together. Requests leave the
batch as soon as they finish or are cancelled.
"""
import collections
import itertools
import logging
import math
import os
import threading
from collections.abc import Callable
from dataclasses import asdict, replace

import numpy as np
import torch
from pydantic import ValidationError

from autotune.embedded.config import (
    MAX_DRAFT_LENGTH,
    MAX_REPETITION_PENALTY,
    MAX_TEMPERATURE,
    RUNTIME_KNOBS,
    EngineConfig,
    GenerationEvent,
    GenerationRequest,
    SpecStats,
    rule_violations,
)
from autotune.embedded.draft_policy import DraftPolicy, load_estimator
from autotune.embedded.draft_schedule import DraftSchedule
from autotune.embedded.drafters import ModelDrafter, NgramDrafter, NoDrafter
from autotune.embedded.generate import (
    ENTROPY_POSITIONS,
    StepInput,
    prefill_chunk,
    speculative_step,
)
from autotune.embedded.model import KVCache
from autotune.embedded.runner import MAX_GRAPH_WIDTH, ModelRunner, prefill_buckets
from autotune.embedded.sampling import SamplingBatch

log = logging.getLogger(__name__)
KV_BUCKET = 64  # attended cache lengths are rounded up to this (fewer distinct shapes for compile)


class Sequence:
    """One request in flight: its tokens, cache slot, draft length and counters."""

    def __init__(self, request_id: int, request: GenerationRequest, on_event, slot: int, stops: frozenset[int],
                 generator: torch.Generator):
        self.id, self.request, self.params, self.on_event = request_id, request, request.params, on_event
        self.slot, self.stops, self.generator = slot, stops, generator
        self.prompt_len = len(request.prompt_ids)
        self.tokens = np.empty(self.prompt_len + self.params.max_tokens, dtype=np.int64)
        self.tokens[: self.prompt_len] = request.prompt_ids
        self.length = self.prompt_len
        self.prefilled = 0  # prompt tokens in the cache; prefill stops one short (the newest is fed by a step)
        self.entropy_sum: torch.Tensor | float = 0.0
        self.prompt_entropy: float | None = None
        self.k = 0
        self.stop_above: float | None = None  # the draft stop threshold (draft_policy.py); None: never stop
        self.target_signals: tuple[float, float] | None = None  # the last step's, for n-gram stopping
        self.completion = 0
        self.spec = SpecStats()
        self.draft_lag = 0  # tokens of steps its drafter's own cache missed (steps nobody in the batch drafted)

    @property
    def decoding(self) -> bool:
        return self.prefilled >= self.prompt_len - 1


def _step_attention(choice: str, device: torch.device):
    """(kernel, max_width) of the Triton step attention if `choice` takes it here, else None."""
    if choice == "sdpa" or (choice == "auto" and device.type != "cuda"):
        return None
    # Triton's interpreter (TRITON_INTERPRET=1) runs the kernel on CPU tensors: how the tests check it without a GPU.
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("step_attention triton needs a CUDA device")
    try:
        from autotune.embedded.kernels import step_attention
    except ImportError as e:
        if choice == "auto":
            return None
        raise ValueError(f"step_attention triton needs Triton installed ({e})") from None
    return step_attention.step_attention_op, step_attention.max_width


class Engine:
    def __init__(self, config: EngineConfig):
        from autotune.embedded.weights import DTYPES as TORCH_DTYPES
        from autotune.embedded.weights import load_draft_model, load_model

        self.config = config
        _validate(config)
        schedule = DraftSchedule.load(config.draft_schedule) if config.draft_schedule else None
        self._use_schedule(_checked_schedule(schedule, config.drafter, f"draft schedule {config.draft_schedule}"))
        if config.threads:
            torch.set_num_threads(config.threads)
        self.device = torch.device("cuda" if config.device == "auto" and torch.cuda.is_available() else
                                   "cpu" if config.device == "auto" else config.device)
        headroom = MAX_DRAFT_LENGTH + 1  # a step may write k + 1 positions past a sequence's end
        target = load_model(config.model, config.dtype, str(self.device), config.max_seq_len + headroom)
        if config.quantization == "int8":
            from autotune.embedded.quantize import quantize_int8
            target.model = quantize_int8(target.model, copy=False)
        elif config.quantization == "gguf":
            from autotune.embedded.quantize import quantize_gguf
            quantize_gguf(target.model, target.gguf_blocks, self.device, TORCH_DTYPES[config.dtype])
        self.tokenizer, self.model_name, self.vocab_size = target.tokenizer, target.name, target.args.vocab_size
        self.max_seq_len = min(config.max_seq_len, target.args.max_seq_len - headroom)
        graphs = list(config.cuda_graph_batch_sizes) if self.device.type == "cuda" else []
        slots, cache_len, dtype = config.verify_slots, self.max_seq_len + headroom, TORCH_DTYPES[config.dtype]
        fixed = config.step_shape == "fixed"
        scratch = slots if graphs or fixed else None  # one more cache slot, for the padding rows of a step

        graphed_prefill = graphs and config.prefill_graphs == "on"
        prefill_widths = prefill_buckets(min(config.prefill_ubatch, self.max_seq_len)) if graphed_prefill else ()
        step_attention = _step_attention(config.step_attention, self.device)
        if step_attention:
            log.info("step attention: triton (kernels/step_attention.py)")

        def runner(model, args, fixed_shape=False):
            if step_attention:
                model.use_step_attention(*step_attention)
            cache = KVCache(args, slots + (scratch is not None), cache_len, dtype, self.device)
            return ModelRunner(model, cache, config.compile, graphs, scratch_slot=scratch, fixed_shape=fixed_shape,
                               prefill_widths=prefill_widths)

        self.target = runner(target.model, target.args, fixed_shape=fixed)
        warm_ups = [(self.target, range(1, MAX_GRAPH_WIDTH + 1), (None,))]  # verify widths, short prompts
        if config.drafter == "ngram":
            self.drafter = NgramDrafter(config.ngram_min, config.ngram_max)
        elif config.drafter == "early_exit":
            if not 1 <= config.early_exit_layers < target.args.n_layers:
                raise ValueError(f"early_exit_layers must be in 1..{target.args.n_layers - 1}")
            layers = config.early_exit_layers
            self.drafter = ModelDrafter(lambda *a: self.target(*a, num_layers=layers), shares_target_cache=True)
            warm_ups.append((self.target, (1,), (layers,)))
        elif config.drafter in ("draft_model", "quantized_self"):
            if config.drafter == "draft_model":
                if not config.draft_model:
                    raise ValueError("drafter draft_model needs a draft checkpoint (--draft-model PATH)")
                draft = load_draft_model(config.draft_model, target, config.dtype, str(self.device),
                                         config.max_seq_len + headroom)
                if config.quantization == "gguf" and draft.gguf_blocks:  # a Q8_0 draft runs on the C kernel too
                    quantize_gguf(draft.model, draft.gguf_blocks, self.device, TORCH_DTYPES[config.dtype])
                draft_model, draft_args, vocab_subset = draft.model, draft.args, draft.vocab_subset
            else:
                from autotune.embedded.quantize import quantize_int8
                draft_model, draft_args, vocab_subset = quantize_int8(target.model, copy=True), target.args, None
            draft_runner = runner(draft_model, draft_args)
            self.drafter = ModelDrafter(draft_runner, shares_target_cache=False, prefill_forward=draft_runner,
                                        vocab_subset=vocab_subset, vocab_size=self.vocab_size)
            warm_ups.append((draft_runner, (1, 2), (None,)))  # a draft pass feeds 1 token, or 2 after a full accept
        else:
            self.drafter = NoDrafter()
        self._drafter_has_own_cache = isinstance(self.drafter, ModelDrafter) and not self.drafter.shares_target_cache
        estimator = load_estimator(config.draft_estimator) if config.draft_estimator else None
        self.policy = DraftPolicy(config.draft_policy, config.draft_length, estimator)
        self.slot_rows = [torch.tensor([s], device=self.device) for s in range(slots)]
        self._greedy_sampling: dict[int, SamplingBatch] = {}
        # Compile and capture now, before /health answers: at serving time a new shape would stall every stream.
        self.warmup_seconds = 0.0
        if config.compile != "none" or graphs:
            self.warmup_seconds = sum(r.warm_up(slots, widths, depths) for r, widths, depths in warm_ups)
            log.info("warm-up (compile %s, %d CUDA graphs): %.1f s", config.compile,
                     sum(len(r.graphs) for r in {r for r, _, _ in warm_ups}), self.warmup_seconds)
        self.seeds = np.random.default_rng(config.seed)

        self._lock = threading.Condition()
        self._queue: collections.deque[Sequence] = collections.deque()
        self._running: list[Sequence] = []
        self._cancelled: set[int] = set()
        self._ids = itertools.count(1)
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._totals = dict(requests_total=0, prompt_tokens_total=0, generation_tokens_total=0, verify_steps=0,
                            draft_tokens=0, accepted_tokens=0, rejections=0, draft_seconds_total=0.0,
                            verify_seconds_total=0.0)
        # per batch size of a decode step (the schedule's input): steps run, tokens proposed
        self._batch_steps: collections.Counter[int] = collections.Counter()
        self._batch_draft_tokens: collections.Counter[int] = collections.Counter()

    # -- the public, thread-safe surface ---------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="embedded-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        with self._lock:
            self._stopping = True
            self._lock.notify()
        if self._thread:
            self._thread.join()
            self._thread = None

    def submit(self, request: GenerationRequest, on_event: Callable[[GenerationEvent], None]) -> int:
        request_id = next(self._ids)
        with self._lock:
            self._totals["requests_total"] += 1
            self._queue.append(Sequence(request_id, request, on_event, -1, frozenset(), None))
            self._lock.notify()
        return request_id

    def cancel(self, request_id: int) -> None:
        with self._lock:
            self._cancelled.add(request_id)
            self._lock.notify()

    def stats(self) -> dict:
        with self._lock:
            totals = dict(self._totals, requests_running=len(self._running), requests_waiting=len(self._queue),
                          warmup_seconds=self.warmup_seconds, late_graph_captures=self.target.late_captures,
                          steps_by_batch=dict(self._batch_steps), draft_tokens_by_batch=dict(self._batch_draft_tokens))
        steps, proposed = totals["verify_steps"], totals["draft_tokens"]
        totals["accept_length"] = totals["generation_tokens_total"] / steps if steps else 0.0
        totals["accept_rate"] = totals["accepted_tokens"] / proposed if proposed else 0.0
        return totals

    def update_runtime(self, **knobs) -> dict:
        """Change draft_length, draft_policy, ngram_min, ngram_max, draft_schedule (an object, null: none) between
        steps; returns the values now."""
        unknown = set(knobs) - set(RUNTIME_KNOBS)
        if unknown:
            raise ValueError(f"unknown runtime knob(s) {sorted(unknown)}; known: {', '.join(RUNTIME_KNOBS)}")
        with self._lock:
            current = dict(draft_length=self.policy.draft_length, draft_policy=self.policy.name,
                           ngram_min=self.config.ngram_min, ngram_max=self.config.ngram_max,
                           draft_schedule=self.schedule.model_dump(mode="json") if self.schedule else None)
            new = dict(current, **knobs)
            for name in ("draft_length", "ngram_min", "ngram_max"):
                if not isinstance(new[name], int) or isinstance(new[name], bool):
                    raise ValueError(f"{name} must be an integer, got {new[name]!r}")
            problems = rule_violations(replace(self.config, **{k: v for k, v in new.items() if k != "draft_schedule"}))
            if problems:
                raise ValueError(problems[0])
            schedule = _checked_schedule(_schedule_of(new["draft_schedule"]), self.config.drafter, "draft_schedule")
            self._use_schedule(schedule)
            self.policy = DraftPolicy(new["draft_policy"], new["draft_length"], self.policy.estimator)
            self.config = replace(self.config, ngram_min=new["ngram_min"], ngram_max=new["ngram_max"])  # the caller's stays
            if isinstance(self.drafter, NgramDrafter):
                self.drafter.ngram_min, self.drafter.ngram_max = new["ngram_min"], new["ngram_max"]
            return new

    def _use_schedule(self, schedule: DraftSchedule | None):
        """The schedule's draft length per batch size, looked up once here: a step reads one list entry."""
        self.schedule = schedule
        self._batch_caps = [schedule.length_for(b) for b in range(self.config.verify_slots + 1)] if schedule else None

    # -- the engine thread -----------------------------------------------------------------------
    def _loop(self):
        while True:
            with self._lock:
                while not (self._running or self._queue or self._cancelled or self._stopping):
                    self._lock.wait()
                if self._stopping:
                    break
                cancelled, self._cancelled = self._cancelled, set()
                for seq in [s for s in self._queue if s.id in cancelled]:
                    self._queue.remove(seq)
                    self._finish(seq, "abort")
                admitted = self._admit()
            for seq in [s for s in self._running if s.id in cancelled]:
                self._finish(seq, "abort")
            for seq in admitted:
                if seq.id not in cancelled:
                    self._start(seq)
            try:
                self._step()
            except Exception as exc:  # a broken step must not take the server down with it
                log.exception("engine step failed")
                for seq in list(self._running):
                    self._finish(seq, "error", f"engine step failed: {type(exc).__name__}: {exc}")
        with self._lock:
            leftover, self._queue = list(self._running) + list(self._queue), collections.deque()
        for seq in leftover:
            self._finish(seq, "abort")

    def _admit(self) -> list[Sequence]:
        """Move queued requests into free slots, oldest first (caller holds the lock)."""
        free = sorted(set(range(self.config.verify_slots)) - {s.slot for s in self._running})
        admitted = []
        while free and self._queue:
            seq = self._queue.popleft()
            seq.slot = free.pop(0)
            self._running.append(seq)
            admitted.append(seq)
        return admitted

    def _start(self, seq: Sequence):
        problem = self._check(seq.request)
        if problem:
            return self._finish(seq, "error", problem)
        params = seq.params
        stops = set(seq.request.stop_token_ids)
        if params.ignore_eos:
            stops -= self.tokenizer.stop_token_ids
        seq.stops = frozenset(stops)
        if params.temperature > 0:
            seed = params.seed if params.seed is not None else int(self.seeds.integers(2**62))
            seq.generator = torch.Generator(self.device).manual_seed(seed)
        with self._lock:
            self._totals["prompt_tokens_total"] += seq.prompt_len
        if seq.decoding:
            self._begin_decoding(seq)

    def _check(self, request: GenerationRequest) -> str | None:
        params, prompt = request.params, request.prompt_ids
        if not prompt:
            return "the prompt is empty"
        if min(prompt) < 0 or max(prompt) >= self.vocab_size:
            return f"prompt token ids must be in 0..{self.vocab_size - 1}"
        if params.max_tokens <= 0:
            return f"max_tokens must be positive, got {params.max_tokens}"
        if len(prompt) + params.max_tokens > self.max_seq_len:
            return (f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) exceeds the context "
                    f"length of {self.max_seq_len} tokens")
        if not (0 <= params.temperature <= MAX_TEMPERATURE and 0 < params.top_p <= 1 and params.top_k >= 0
                and 0 < params.repetition_penalty <= MAX_REPETITION_PENALTY):
            return (f"need 0 <= temperature <= {MAX_TEMPERATURE:g}, 0 < top_p <= 1, top_k >= 0, "
                    f"0 < repetition_penalty <= {MAX_REPETITION_PENALTY:g}")
        if params.draft_length is not None and not 0 <= params.draft_length <= MAX_DRAFT_LENGTH:
            return f"draft_length must be in 0..{MAX_DRAFT_LENGTH}, got {params.draft_length}"
        return None

    def _step(self):
        prefilling = [s for s in self._running if not s.decoding]
        if prefilling:
            self._prefill(prefilling[0])
        decoding = [s for s in self._running if s.decoding]
        if decoding:
            self._decode(decoding)

    def _prefill(self, seq: Sequence):
        start = seq.prefilled
        # One forward a chunk: the head runs only on the entropy positions in it (prefill_chunk). On a GPU an
        # eager forward is tens of ms of launches, more than the chunk's compute.
        end = min(seq.prompt_len - 1, start + self.config.prefill_ubatch)
        chunk = torch.from_numpy(seq.tokens[start:end]).to(self.device)[None]
        row = None if seq.slot == 0 else self.slot_rows[seq.slot]
        entropy = prefill_chunk(self.target, self.drafter, chunk, start, row, _bucket(end, self.target.cache.max_len))
        if entropy is not None:
            seq.entropy_sum = seq.entropy_sum + entropy
        seq.prefilled = end
        if seq.decoding:
            self._begin_decoding(seq)

    def _begin_decoding(self, seq: Sequence):
        counted = min(ENTROPY_POSITIONS, seq.prompt_len - 1)
        seq.prompt_entropy = float(seq.entropy_sum) / counted if counted else None
        override = seq.params.draft_length
        features = dict(prompt_entropy=seq.prompt_entropy or 0.0, prompt_tokens=seq.prompt_len,
                        prompt_chars=len(seq.request.prompt_text), temperature=seq.params.temperature,
                        top_p=seq.params.top_p, prompt_text=seq.request.prompt_text)
        seq.k = override if override is not None else self.policy.first_k(features)
        if type(self.drafter) is NoDrafter:
            seq.k = 0
        # k = 0 stays 0 under every policy, so such a request never drafts and has nothing to stop: without a
        # threshold its steps are a draft_length 0 request's (no target-law signals for the n-gram rule).
        seq.stop_above = self.policy.stop_above(features) if override is None and seq.k else None

    def _decode(self, batch: list[Sequence]):
        policy = self.policy
        ks = self._draft_lengths(batch)
        drafts = max(ks) > 0  # whether the drafter runs this step (for every row of the batch)
        if drafts and self._drafter_has_own_cache:
            self._catch_up_drafter(batch)
        positions = [s.length - 1 for s in batch]
        host = np.array([[s.tokens[s.length - 1], p, s.slot] for s, p in zip(batch, positions)], dtype=np.int64)
        # A step nobody drafts in (k = 0, or capped to 0 by the schedule) has nothing to stop: without the stop
        # rule it is a plain step (no target signals computed; on a GPU the host path).
        stop_above = [s.stop_above for s in batch] if drafts else [None] * len(batch)
        step = StepInput(
            host=host, histories=[s.tokens[: s.length] for s in batch], draft_lengths=ks,
            kv_len=_bucket(max(positions) + max(ks) + 1, self.target.cache.max_len),
            sampling=self._sampling(batch), device=self.device,
            **policy.step_fields(stop_above, [s.params.draft_trace for s in batch],
                                 [s.target_signals for s in batch] if isinstance(self.drafter, NgramDrafter) else None),
        )
        out = speculative_step(self.target, self.drafter, step)
        with self._lock:
            self._totals["draft_seconds_total"] += out.draft_seconds
            self._totals["verify_seconds_total"] += out.verify_seconds
            self._batch_steps[len(batch)] += 1
            self._batch_draft_tokens[len(batch)] += sum(out.proposed)
        if not drafts and self._drafter_has_own_cache:
            for seq in batch:
                seq.draft_lag += 1  # a plain step emits one token, which the drafter's cache did not get
        for row, (seq, tokens, proposed, accepted) in enumerate(zip(batch, out.tokens, out.proposed, out.accepted)):
            spec = seq.spec
            # Where the step read no target signals (a plain step) they are unknown, as at a request's first step:
            # the n-gram stop rule lets its next step draft rather than judge it by an older position's.
            seq.target_signals = out.target_signals[row] if out.target_signals else None
            if seq.params.draft_trace and out.signals is not None:
                signals = out.signals[row]
                spec.trace.append([[round(e, 4) for e, _ in signals], [round(p, 4) for _, p in signals], accepted])
            spec.verify_steps += 1
            spec.draft_tokens += proposed
            spec.accepted_tokens += accepted
            spec.rejections += accepted < proposed
            spec.draft_seconds += out.draft_seconds
            spec.verify_seconds += out.verify_seconds
            if seq.params.draft_length is None:
                seq.k = policy.next_k(seq.k, proposed, accepted)
            self._emit(seq, tokens, proposed, accepted)

    def _draft_lengths(self, batch: list[Sequence]) -> list[int]:
        """Each row's k this step: its request's own (policy, or its draft_length) within the schedule's length for
        this batch size, never past max_tokens (a step emits at most k + 1 tokens). The schedule only lowers a k
        the request drafts anyway (<= MAX_DRAFT_LENGTH, the widest verify step warm_up compiles and captures at
        every batch size), so it makes no shape the engine has not already got."""
        caps = self._batch_caps
        cap = caps[len(batch)] if caps else MAX_DRAFT_LENGTH
        return [min(s.k, cap, s.params.max_tokens - s.completion - 1) for s in batch]

    def _catch_up_drafter(self, batch: list[Sequence]):
        """Feed a drafter with its own cache the tokens of the steps it did not run (draft_lag), before it drafts
        again: it re-feeds only the newest two itself, and would otherwise attend stale entries. Through its
        prefill path: one-token chunks take the width-1 step warm_up captured, wider ones prefill's buckets."""
        for seq in batch:
            start, end = max(0, seq.length - 2 - seq.draft_lag), seq.length - 2
            seq.draft_lag = 0
            row = None if seq.slot == 0 else self.slot_rows[seq.slot]
            for chunk in range(start, end, self.config.prefill_ubatch):
                chunk_end = min(end, chunk + self.config.prefill_ubatch)
                ids = torch.from_numpy(seq.tokens[chunk:chunk_end]).to(self.device)[None]
                positions = torch.arange(chunk, chunk_end, device=self.device)[None]
                self.drafter.prefill(ids, positions, row, _bucket(chunk_end, self.target.cache.max_len))

    def _sampling(self, batch) -> SamplingBatch:
        if all(s.params.temperature == 0 and s.params.repetition_penalty == 1.0 for s in batch):
            if len(batch) not in self._greedy_sampling:  # the same every step: built once per batch size
                self._greedy_sampling[len(batch)] = self._sampling_of(batch)
            return self._greedy_sampling[len(batch)]
        return self._sampling_of(batch)

    def _sampling_of(self, batch) -> SamplingBatch:
        penalised = [row for row, s in enumerate(batch) if s.params.repetition_penalty != 1.0]
        presence = None
        if penalised:
            presence = torch.zeros((len(batch), self.vocab_size), dtype=torch.bool, device=self.device)
            for row in penalised:
                seq = batch[row]
                presence[row, torch.from_numpy(seq.tokens[: seq.length]).to(self.device)] = True
        # One copy: top_k travels as a float (exact far beyond any vocabulary).
        settings = torch.tensor([[s.params.temperature, s.params.top_p, s.params.repetition_penalty, s.params.top_k]
                                 for s in batch], device=self.device)
        return SamplingBatch(
            temperature=settings[:, 0], top_k=settings[:, 3].long(), top_p=settings[:, 1],
            repetition_penalty=settings[:, 2], presence=presence,
            generators=[s.generator for s in batch],
            any_sampled=any(s.params.temperature > 0 for s in batch),
            any_filtered=any(s.params.temperature > 0 and (s.params.top_k > 0 or s.params.top_p < 1) for s in batch),
        )

    def _emit(self, seq: Sequence, tokens: list[int], proposed: int, accepted: int):
        finish, new = None, []
        for token in tokens:
            new.append(token)
            seq.tokens[seq.length] = token
            seq.length += 1
            seq.completion += 1
            if token in seq.stops:
                finish = "stop"
                break
            if seq.completion >= seq.params.max_tokens:
                finish = "length"
                break
        with self._lock:
            t = self._totals
            t["generation_tokens_total"] += len(new)
            t["verify_steps"] += 1
            t["draft_tokens"] += proposed
            t["accepted_tokens"] += accepted
            t["rejections"] += accepted < proposed
        if finish:
            self._finish(seq, finish, new_tokens=new)
        else:
            self._send(seq, GenerationEvent(new))

    def _finish(self, seq: Sequence, reason: str, error: str | None = None, new_tokens=()):
        with self._lock:
            if seq in self._running:
                self._running.remove(seq)
        self._send(seq, GenerationEvent(
            list(new_tokens), finish_reason=reason, prompt_tokens=seq.prompt_len, completion_tokens=seq.completion,
            spec=SpecStats(**asdict(seq.spec)), prompt_entropy=seq.prompt_entropy, error=error))

    def _send(self, seq: Sequence, event: GenerationEvent):
        try:
            seq.on_event(event)
        except Exception:  # a consumer that breaks loses its request, not the engine
            if event.finish_reason is None:
                self.cancel(seq.id)


def _bucket(length: int, limit: int) -> int:
    return min(limit, math.ceil(length / KV_BUCKET) * KV_BUCKET)


def _schedule_of(value) -> DraftSchedule | None:
    """POST /admin/runtime's draft_schedule (a schedule object, or None) as a schedule; one-line ValueError."""
    if value is None or isinstance(value, DraftSchedule):
        return value
    try:
        return DraftSchedule.model_validate(value)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(x) for x in first["loc"])
        raise ValueError(f"draft_schedule: {where + ': ' if where else ''}{first['msg']}") from None


def _checked_schedule(schedule: DraftSchedule | None, drafter: str, source: str) -> DraftSchedule | None:
    """The schedule, if this engine can run it: fitted for its drafter, no row past MAX_DRAFT_LENGTH."""
    if schedule is None:
        return None
    if schedule.drafter != drafter:
        raise ValueError(f"{source}: fitted for drafter {schedule.drafter}, the engine drafts with {drafter}")
    if schedule.max_draft_length > MAX_DRAFT_LENGTH:
        raise ValueError(f"{source}: draft_length must be in 0..{MAX_DRAFT_LENGTH}, got {schedule.max_draft_length}")
    return schedule


def _validate(config: EngineConfig):
    problems = rule_violations(config)
    if problems:
        raise ValueError(problems[0])
