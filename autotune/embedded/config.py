"""What the embedded engine is launched with, what a request asks of it, and what it reports back."""
from dataclasses import dataclass, field

DRAFTERS = ("none", "ngram", "early_exit", "draft_model", "quantized_self")
DRAFT_POLICIES = ("fixed", "adaptive", "estimator")
DTYPES = ("float32", "bfloat16", "float16")
QUANTIZATIONS = ("none", "int8", "gguf")
COMPILE_BACKENDS = ("none", "inductor", "aot_eager")
# fixed: every decode/verify step runs at one padded shape (the same kernels for every token), meant to
# make greedy output on CUDA independent of the draft length and the concurrency; bucketed: faster.
# Not yet verified on a GPU (benchmarks/results/h200-2026-12-01b); a wide step costs ~2.5x a plain one there.
STEP_SHAPES = ("bucketed", "fixed")
# Attention of decode/verify steps: triton is kernels/step_attention.py (CUDA, split over the cache); auto takes it
# on CUDA when Triton is installed, else sdpa (PyTorch's scaled_dot_product_attention with the position mask).
STEP_ATTENTIONS = ("auto", "sdpa", "triton")
# on: where step graphs are captured (cuda_graph_batch_sizes), prefill chunks replay graphs too, one per width
# bucket (runner.prefill_buckets); off: prefill runs eagerly, tens of ms of kernel launches a chunk on a GPU.
PREFILL_GRAPHS = ("on", "off")
MAX_DRAFT_LENGTH = 16  # longest draft a verify step takes (CUDA graphs are captured up to k + 1 wide)
# Sampling limits, the engine's and its OpenAI API's alike: temperature as OpenAI bounds it, a penalty
# past which every seen token is all but banned.
MAX_TEMPERATURE = 2.0
MAX_REPETITION_PENALTY = 10.0
# Changeable on a running server between steps (POST /admin/runtime): the tuner needs no relaunch for them.
# draft_schedule there is the schedule itself (a JSON object, or null for none), not a file.
RUNTIME_KNOBS = ("draft_length", "draft_policy", "ngram_min", "ngram_max", "draft_schedule")
CHOICES = {"drafter": DRAFTERS, "draft_policy": DRAFT_POLICIES, "dtype": DTYPES, "quantization": QUANTIZATIONS,
           "compile": COMPILE_BACKENDS, "step_shape": STEP_SHAPES,
           "step_attention": STEP_ATTENTIONS, "prefill_graphs": PREFILL_GRAPHS}


@dataclass
class EngineConfig:
    """Launch-time settings: one field per `autotune serve` flag of the same name."""

    model: str | None = None  # GGUF file or HF safetensors directory; None = bundled SmolLM2-135M
    draft_model: str | None = None  # second checkpoint for drafter=draft_model (same vocabulary)
    drafter: str = "none"
    draft_length: int = 4  # k: tokens proposed per verify step (the starting point for dynamic policies)
    draft_policy: str = "fixed"
    draft_estimator: str | None = None  # estimator.json or draft_length_estimator.py for policy=estimator
    # batch size -> draft length file (draft_schedule.py), applied at every step within each request's own k
    draft_schedule: str | None = None
    early_exit_layers: int = 8  # L for drafter=early_exit
    ngram_min: int = 1  # prompt-lookup match window, shortest
    ngram_max: int = 4  # and longest suffix tried
    verify_slots: int = 4  # sequences decoded/verified together per step (continuous batching width)
    prefill_ubatch: int = 256  # prompt tokens per prefill chunk
    dtype: str = "float32"
    quantization: str = "none"  # of the target: int8 weight-only, or gguf (the GGUF's own blocks, CPU)
    compile: str = "none"
    cuda_graph_batch_sizes: list[int] = field(default_factory=list)  # CUDA only; empty = no graphs
    step_shape: str = "bucketed"  # fixed: one padded shape for every step (runner.py), for exact greedy on CUDA
    step_attention: str = "auto"
    prefill_graphs: str = "on"
    threads: int | None = None  # torch intra-op threads on CPU; None = torch's default
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    max_seq_len: int = 2048  # KV cache length per slot
    seed: int = 0


@dataclass
class SamplingParams:
    max_tokens: int = 128
    temperature: float = 0.0  # 0 = greedy, exact
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    seed: int | None = None
    draft_length: int | None = None  # per-request override of k (runtime knob the tuner sets per request)
    draft_trace: bool = False  # return each step's proposed-token signals in usage (estimator collection)


@dataclass
class GenerationRequest:
    prompt_ids: list[int]
    params: SamplingParams
    stop_token_ids: frozenset[int] = frozenset()
    prompt_text: str = ""  # for estimator policies that read the prompt


@dataclass
class SpecStats:
    """Speculative-decoding counters of one request (or of the whole engine, summed)."""

    verify_steps: int = 0  # target forward passes that produced tokens (prefill excluded)
    draft_tokens: int = 0  # tokens proposed by the drafter
    accepted_tokens: int = 0  # proposed tokens the target accepted
    rejections: int = 0  # verify steps that stopped at a rejected proposal
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    # per verify step when the request asked for draft_trace: [entropies, top-1 probs, accepted] of its proposals
    trace: list = field(default_factory=list)

    @property
    def accept_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0


@dataclass
class GenerationEvent:
    """Streamed from the scheduler to whoever submitted the request, in order.

    Every event carries the new token ids since the last one (possibly empty); the last event has
    finish_reason set ("stop", "length", "abort" or "error") and the final stats.
    """

    new_token_ids: list[int]
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    spec: SpecStats | None = None
    prompt_entropy: float | None = None  # mean next-token entropy (nats) over the first 32 prompt tokens
    error: str | None = None


def rule_violations(c: EngineConfig) -> list[str]:
    """Every reason the engine refuses this configuration (empty: it runs). `autotune serve` stops at
    the first; the tuner's adapter records them all before any launch."""
    out = [f"{name} must be one of {', '.join(allowed)}, got {getattr(c, name)!r}"
           for name, allowed in CHOICES.items() if getattr(c, name) not in allowed]
    if not 0 <= c.draft_length <= MAX_DRAFT_LENGTH:
        out.append(f"draft_length must be in 0..{MAX_DRAFT_LENGTH}, got {c.draft_length}")
    if c.drafter == "ngram" and not 1 <= c.ngram_min <= c.ngram_max:
        out.append(f"need 1 <= ngram_min <= ngram_max, got {c.ngram_min}..{c.ngram_max}")
    if c.verify_slots < 1 or c.prefill_ubatch < 1 or c.max_seq_len < 2:
        out.append("verify_slots and prefill_ubatch must be >= 1, max_seq_len >= 2")
    if any(b < 1 for b in c.cuda_graph_batch_sizes or []):
        out.append("cuda_graph_batch_sizes must be positive")
    if c.quantization == "gguf" and (c.dtype != "float32" or c.compile != "none"):
        out.append("quantization gguf runs the GGUF's blocks on the CPU in float32 through a C kernel torch.compile cannot "
                   "trace: needs dtype float32, compile none")
    if c.drafter == "quantized_self" and c.quantization != "none":
        out.append("drafter quantized_self drafts with an int8 copy of a float target: needs quantization none")
    if c.drafter == "draft_model" and not c.draft_model:
        out.append("drafter draft_model needs a draft model (--draft-model)")
    if c.draft_policy == "estimator" and not c.draft_estimator:
        out.append("draft_policy estimator needs draft_estimator (an estimator.json)")
    return out
