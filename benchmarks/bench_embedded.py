"""Embedded engine speed, against peers measured in the same run on the same weights and threads.

(a) plain greedy decode: the engine vs Hugging Face transformers `generate` (bs 1)
(b) the best speculative setting vs the engine's own plain decode, on a code-editing prompt (rewrite
    a real stdlib function with type hints) and on an open chat prompt; greedy outputs must match
(c) draft-length sweep k = 1..8 per drafter: tok/s, accept length (tokens per verify step), accept rate

    python3 benchmarks/bench_embedded.py [--quick] [--threads N] [--device cuda]

On CUDA (bf16, 256 tokens by default): the engine with CUDA graphs vs HF generate with the dynamic
cache and with cache_implementation="static". Each comparison alternates the two sides run by run
(one request each, prompt included, after one warm-up) and reports the median over pairs of the
time ratio, so drift on a shared machine hits both sides alike.
"""
import argparse
import functools
import inspect
import statistics
import textwrap
import threading
import time

import torch
from rich.console import Console
from rich.table import Table

from autotune.embedded import weights
from autotune.embedded.config import EngineConfig, GenerationRequest, SamplingParams
from autotune.embedded.scheduler import Engine

CHAT_QUESTION = "What are some good habits for staying healthy while working from home? Explain briefly."


def workloads(tokenizer) -> dict[str, list[int]]:
    source = textwrap.dedent(inspect.getsource(textwrap.TextWrapper._split_chunks)) + "\n" + textwrap.dedent(
        inspect.getsource(textwrap.TextWrapper._fix_sentence_endings))
    code = f"Rewrite these Python functions with type hints. Keep the code otherwise unchanged.\n\n```python\n{source}```"
    chat = [{"role": "user", "content": code}], [{"role": "user", "content": CHAT_QUESTION}]
    return {name: tokenizer.encode(tokenizer.apply_chat_template(messages))
            for name, messages in zip(("code", "chat"), chat)}


def timed(engine: Engine, prompt: list[int], tokens: int) -> tuple[float, list[int], object]:
    """One greedy request of exactly `tokens` tokens: (seconds, tokens, final event)."""
    out, done = [], threading.Event()
    final = []

    def on_event(event):
        out.extend(event.new_token_ids)
        if event.finish_reason:
            final.append(event)
            done.set()

    start = time.perf_counter()
    engine.submit(GenerationRequest(prompt, SamplingParams(max_tokens=tokens, ignore_eos=True)), on_event)
    done.wait()
    seconds = time.perf_counter() - start
    if final[0].finish_reason != "length":
        raise RuntimeError(f"generation failed: {final[0].error}")
    return seconds, out, final[0]


def paired(run_a, run_b, repeats: int) -> tuple[list, list, float]:
    """Alternate two runs (a, b, a, b, ...) so drift on a shared machine hits both alike.

    Returns the runs of each and the median over pairs of seconds(a) / seconds(b): b's speedup over a.
    """
    run_a(warmup=True), run_b(warmup=True)  # allocator, graphs, compile
    runs_a, runs_b = [], []
    for _ in range(repeats):
        runs_a.append(run_a())
        runs_b.append(run_b())
    return runs_a, runs_b, statistics.median(a[0] / b[0] for a, b in zip(runs_a, runs_b))


def engine_run(engine: Engine, prompt, tokens: int):
    return lambda warmup=False: timed(engine, prompt, min(tokens, 16) if warmup else tokens)


def summary(runs, tokens: int) -> dict:
    spec = runs[0][2].spec
    return {"tok_s": tokens / statistics.median(r[0] for r in runs), "tokens": runs[0][1],
            "accept_length": tokens / spec.verify_steps, "accept_rate": spec.accept_rate}


def hf_model(path, dtype, device):
    """transformers' llama, filled with the engine's own dequantised weights (exactly the same numbers;
    with --quantization gguf the engine runs the blocks these were dequantised from)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    _, ours, _, _ = weights.read_gguf(path, 1024)  # checkpoint layout: separate q/k/v and gate/up
    to_hf = {v: k for k, v in weights.HF_NAMES.items()}
    to_hf.update({f"layers.{i}.{v}.weight": f"model.layers.{i}.{k}.weight" for k, v in weights.HF_LAYER_NAMES.items()
                  for i in range(config.num_hidden_layers)})
    state = {to_hf[name]: tensor for name, tensor in ours.items() if name in to_hf}
    missing = model.load_state_dict(state, strict=False).missing_keys
    assert not [m for m in missing if m != "lm_head.weight"], missing
    if config.tie_word_embeddings:
        model.tie_weights()
    return model.to(device).eval()


def hf_run(model, prompt, tokens: int, device, static: bool):
    ids = torch.tensor([prompt], device=device)
    extra = {"cache_implementation": "static"} if static else {}

    def run(warmup=False):
        n = min(tokens, 16) if warmup else tokens
        if warmup and static:
            run()  # the static cache compiles per shape: warm the measured one too
        start = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, top_p=None, top_k=None, temperature=None, **extra)
        if device != "cpu":
            torch.cuda.synchronize()
        return time.perf_counter() - start, out[0, len(prompt):].tolist()

    return run


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer tokens, repeats and draft lengths")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--tokens", type=int)
    parser.add_argument("--repeats", type=int)
    parser.add_argument("--drafters", default="ngram,early_exit,quantized_self", help="comma-separated; empty: (a) only")
    parser.add_argument("--no-hf", action="store_true", help="skip the transformers peer (a)")
    parser.add_argument("--compile", default="none", help="none | inductor | aot_eager (the engine side)")
    parser.add_argument("--quantization", default="none",
                        help="none | int8 | gguf (the engine side; gguf runs the checkpoint's own Q4_1/Q8_0 blocks)")
    parser.add_argument("--dtype", help="float32 | bfloat16 | float16 (default: bfloat16 on CUDA, float32 on CPU)")
    args = parser.parse_args()
    cuda = args.device.startswith("cuda")
    tokens = args.tokens or (256 if cuda else 64 if args.quick else 128)
    repeats = args.repeats or (1 if args.quick else 3)
    lengths = [1, 2, 4, 8] if args.quick else list(range(1, 9))
    dtype = args.dtype or ("bfloat16" if cuda else "float32")
    torch.set_num_threads(args.threads)
    console = Console()
    console.print(f"device {args.device}, {dtype}, compile {args.compile}, quantization {args.quantization}, "
                  f"threads {args.threads}, {tokens} tokens, median of {repeats}")

    # Every engine below serves the same weights: load them once.
    weights.load_model = functools.lru_cache(maxsize=None)(weights.load_model)
    base = dict(threads=args.threads, device=args.device, dtype=dtype, max_seq_len=1024, verify_slots=1, seed=0,
                compile=args.compile, quantization=args.quantization)
    if cuda:
        base["cuda_graph_batch_sizes"] = [1]
    plain_engine = Engine(EngineConfig(drafter="none", **base))
    plain_engine.start()
    prompts = workloads(plain_engine.tokenizer)

    # (a) plain decode vs HF transformers, runs alternated
    table = Table(title=f"(a) plain greedy decode, bs 1, chat prompt, median of {repeats} alternated pairs")
    for column in ("peer", "peer tok/s", "embedded tok/s", "embedded / peer", "same tokens"):
        table.add_column(column)
    if not args.no_hf:
        model = hf_model(weights.bundled_gguf_path(), getattr(torch, dtype), args.device)
        for static in ((False, True) if cuda else (False,)):
            hf_runs, ours_runs, ratio = paired(hf_run(model, prompts["chat"], tokens, args.device, static),
                                               engine_run(plain_engine, prompts["chat"], tokens), repeats)
            table.add_row("HF generate" + (" static cache" if static else ""),
                          f"{tokens / statistics.median(r[0] for r in hf_runs):.1f}",
                          f"{summary(ours_runs, tokens)['tok_s']:.1f}", f"{ratio:.2f}x",
                          str(hf_runs[0][1] == ours_runs[0][1]))
        console.print(table)

    # (c) the sweep, each setting alternated with plain decode; (b) takes the best setting per workload
    sweep = Table(title=f"(c) draft-length sweep (greedy), speedup = median of {repeats} alternated pairs")
    for column in ("workload", "drafter", "k", "tok/s", "vs plain", "accept length", "accept rate", "same tokens"):
        sweep.add_column(column)
    best = {name: ("none", 0, None, 1.0) for name in prompts}
    drafters = [d for d in args.drafters.split(",") if d]
    for drafter in drafters:
        engine = Engine(EngineConfig(drafter=drafter, early_exit_layers=6, **base))
        engine.start()
        for name, prompt in prompts.items():
            for k in lengths:
                engine.update_runtime(draft_length=k)
                plain_runs, spec_runs, speedup = paired(engine_run(plain_engine, prompt, tokens),
                                                        engine_run(engine, prompt, tokens), repeats)
                result = summary(spec_runs, tokens)
                same = result["tokens"] == plain_runs[0][1]
                sweep.add_row(name, drafter, str(k), f"{result['tok_s']:.1f}", f"{speedup:.2f}x",
                              f"{result['accept_length']:.2f}", f"{result['accept_rate']:.2f}", str(same))
                if same and speedup > best[name][3]:
                    best[name] = (drafter, k, result, speedup)
        engine.stop()
    plain_engine.stop()
    if not drafters:
        return
    console.print(sweep)

    table = Table(title="(b) best speculative setting vs plain decode (greedy outputs identical)")
    for column in ("workload", "best setting", "tok/s", "speedup vs plain (paired)"):
        table.add_column(column)
    for name, (drafter, k, result, speedup) in best.items():
        table.add_row(name, f"{drafter} k={k}", f"{result['tok_s']:.1f}" if result else "-", f"{speedup:.2f}x")
    console.print(table)


if __name__ == "__main__":
    main()
