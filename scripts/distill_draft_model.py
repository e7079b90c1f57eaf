"""Distil a small draft model from the embedded engine's target (SmolLM2-135M) for `--drafter draft_model`.

    python3 scripts/distill_draft_model.py --out DIR [--device cuda] [--layers 2] [--vocab 8192]
        [--samples 32] [--new-tokens 128] [--train-seconds 120] [--limit-prompts N]

1. Data: the target generates --new-tokens per sample (sample 0 of a prompt greedy, the others at
   temperatures spread evenly over (0, 1]; past EOS, as the estimator's requests do) from the shipped
   workloads' prompts minus the estimator's held-out `mixed` set (the rule of
   autotune.estimator.live.requests_of, which its collection pass uses); every VALIDATION_EVERY-th
   prompt is held out of training, for the agreement numbers.
2. Model: a llama decoder of the target's width with --layers layers, initialised from the target's first
   layers and final norm; its head scores only the --vocab tokens most frequent in the generated text of
   the training prompts (FR-Spec, arXiv 2502.14856: a smaller draft head for a cheaper draft pass),
   initialised from the target's rows. Its input embedding is the target's, frozen and not stored.
3. Training: at every generated position, KL(p_S || q) weighted by p(S), with p_S the target's law
   restricted to the subset S and renormalised (KL(p || q) itself is infinite: q is 0 outside S),
   AdamW, linear decay over --train-seconds.
   Every ~10 s the held-out-of-training prompts are scored and the weights of the lowest subset KL there
   are the ones written (early stopping on a validation set; the estimator's eval prompts are never used).
4. Output: DIR/draft.gguf (Q8_0 blocks: the C kernel runs them with --quantization gguf) and
   DIR/distill.json: settings, data sizes, the loss curve, and on the held-out-of-training prompts the draft's
   top-1 agreement with the target, its expected acceptance sum_x min(p, q) at temperature 1 and its subset
   KL, before training, at every check, and for the written checkpoint as it loads.
"""
import argparse
import json
import shutil
import subprocess
import time
from pathlib import Path

import numpy as np
import torch

from autotune.bench import load_workload
from autotune.embedded.model import KVCache, ModelArgs
from autotune.embedded.weights import (
    DRAFT_SUBSET_KEY,
    DRAFT_VOCAB_KEY,
    build_model,
    load_draft_model,
    load_model,
)
from autotune.estimator.live import requests_of

TRAINING_WORKLOADS = ("chat", "code", "repetitive", "long-prefill")
HELD_OUT = "mixed"  # the estimator's eval set (bench_estimator.py, estimator.evaluate)
VALIDATION_EVERY = 8
GGML_Q8_0 = 8  # ggml type id; a block is an fp16 scale and 32 int8 weights


def main():
    args = parse()
    start = time.perf_counter()
    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True  # a teacher in TF32 is plenty for training targets
    out, timeline = Path(args.out), []
    out.mkdir(parents=True, exist_ok=True)
    target = load_model(None, "float32", str(device))
    prompts = training_prompts(target.tokenizer, args.limit_prompts)
    validation = set(range(0, len(prompts), VALIDATION_EVERY))
    timeline.append(log(start, f"target loaded; {len(prompts)} prompts ({len(validation)} held out of training)"))

    sequences = generate(target, prompts, args, device)
    train = [s for s in sequences if s["prompt"] not in validation]
    held = [s for s in sequences if s["prompt"] in validation]
    timeline.append(log(start, f"generated {len(sequences)} sequences x {args.new_tokens} tokens"))

    counts = np.bincount(np.concatenate([s["tokens"][s["prompt_len"]:] for s in train]),
                         minlength=target.args.vocab_size)
    subset = torch.from_numpy(np.argsort(-counts, kind="stable")[: args.vocab]).to(device)
    coverage = {name: float(np.isin(np.concatenate([s["tokens"][s["prompt_len"]:] for s in group]),
                                    subset.cpu().numpy()).mean()) for name, group in (("train", train), ("held_out", held))}
    teach(target, sequences, prompts, subset, args.batch, device)
    timeline.append(log(start, f"teacher laws over the {args.vocab}-token subset (covers {coverage['held_out']:.3f} of held-out tokens)"))

    draft = initial_draft(target, subset, args.layers, device)
    before = agreement(draft, held, subset, args.batch, device)
    timeline.append(log(start, f"before training, held out: {json.dumps(before)}"))
    curve, kept = train_draft(draft, train, held, subset, args, device, start)
    path = write_gguf(out / "draft.gguf", draft, subset.cpu(), target)
    served = load_draft_model(str(path), target, "float32", str(device))
    after = agreement(served.model, held, served.vocab_subset, args.batch, device)
    timeline.append(log(start, f"written {path} ({path.stat().st_size / 1e6:.1f} MB); held out, as it loads: {json.dumps(after)}"))

    report = {
        "settings": vars(args), "commit": commit(), "device": device_name(device), "torch": torch.__version__,
        "prompts": {"train": len(prompts) - len(validation), "held_out_of_training": len(validation),
                    "excluded": f"the {HELD_OUT} workload's prompts", "workloads": TRAINING_WORKLOADS},
        "sequences": {"train": len(train), "held_out_of_training": len(held)},
        "generated_tokens": {"train": sum(args.new_tokens for _ in train), "held_out_of_training": len(held) * args.new_tokens},
        "temperatures": "sample 0 greedy, sample s at s / (samples - 1)", "subset_coverage": coverage,
        "loss": {"first": curve[0]["loss"], "last": curve[-1]["loss"], "steps": curve[-1]["step"], "curve": curve},
        "held_out_before_training": before, "kept_step": kept["step"], "held_out_checkpoint": after,
        "checkpoint": {"path": path.name, "bytes": path.stat().st_size, "layers": args.layers, "vocab_subset": args.vocab,
                       "format": "GGUF, Q8_0 matrices; token embedding and tokenizer borrowed from the target"},
        "seconds": round(time.perf_counter() - start, 1), "timeline": timeline,
    }
    (out / "distill.json").write_text(json.dumps(report, indent=1) + "\n")
    log(start, f"done: {out / 'distill.json'}")


def parse():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="directory for draft.gguf and distill.json")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--layers", type=int, default=2, help="decoder layers (from the target's first)")
    parser.add_argument("--vocab", type=int, default=8192, help="tokens the draft head scores")
    parser.add_argument("--samples", type=int, default=32, help="generations per prompt")
    parser.add_argument("--new-tokens", type=int, default=128, help="tokens generated per sample")
    parser.add_argument("--gen-batch", type=int, default=256, help="sequences generated together")
    parser.add_argument("--batch", type=int, default=32, help="sequences per training step")
    parser.add_argument("--train-seconds", type=float, default=120.0)
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--limit-prompts", type=int, help="only the first N prompts (a smoke run)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if (not 1 <= args.layers <= 30 or args.vocab < 2 or args.samples < 1 or args.new_tokens < 2
            or args.train_seconds <= 0 or (args.limit_prompts is not None and args.limit_prompts < 2)):
        parser.error("need --layers in 1..30, --vocab >= 2, --samples >= 1, --new-tokens >= 2, --train-seconds > 0, "
                     "--limit-prompts >= 2 (one is held out)")
    return args


def log(start: float, message: str) -> str:
    line = f"[{time.perf_counter() - start:6.1f} s] {message}"
    print(line, flush=True)
    return line


def training_prompts(tokenizer, limit: int | None) -> list[list[int]]:
    """Token ids of every training prompt, rendered as the server renders chat and completion requests."""
    bodies = requests_of(list(TRAINING_WORKLOADS), exclude=load_workload(HELD_OUT).requests, max_tokens=1)
    texts = [tokenizer.apply_chat_template(b["messages"]) if b["api"] == "chat" else b["prompt"] for b in bodies]
    return [tokenizer.encode(t) for t in texts[:limit]]


@torch.no_grad()
def generate(target, prompts: list[list[int]], args, device) -> list[dict]:
    """args.samples continuations of each prompt, args.new_tokens each, generated args.gen_batch at a time."""
    jobs = [(p, s) for p in sorted(range(len(prompts)), key=lambda p: len(prompts[p])) for s in range(args.samples)]
    generator = torch.Generator(device).manual_seed(args.seed)
    sequences = []
    for first in range(0, len(jobs), args.gen_batch):
        chunk = jobs[first : first + args.gen_batch]
        lengths = torch.tensor([len(prompts[p]) for p, _ in chunk], device=device)
        cache = KVCache(target.args, len(chunk), int(lengths.max()) + args.new_tokens, torch.float32, device)
        logits = prefill(target, [p for p, _ in chunk], prompts, cache, device)
        temperature = torch.tensor([s / max(1, args.samples - 1) for _, s in chunk], device=device)
        new = []
        for step in range(args.new_tokens):
            law = torch.softmax(logits / temperature.clamp_min(1e-6)[:, None], -1)
            token = torch.where(temperature > 0, torch.multinomial(law, 1, generator=generator)[:, 0], logits.argmax(-1))
            new.append(token)
            if step + 1 < args.new_tokens:
                positions = (lengths + step)[:, None]
                logits = target.model(token[:, None], positions, cache, kv_len=int(positions.max()) + 1)[:, -1]
        new = torch.stack(new, 1).cpu().numpy()
        for row, (p, s) in enumerate(chunk):
            sequences.append({"prompt": p, "prompt_len": len(prompts[p]), "temperature": float(temperature[row]),
                              "tokens": np.concatenate([prompts[p], new[row]])})
    return sequences


def prefill(target, row_prompts: list[int], prompts: list[list[int]], cache: KVCache, device) -> torch.Tensor:
    """Row i's prompt, prompts[row_prompts[i]], into cache slot i; the logits [B, V] at each prompt's last position.
    A row of the same prompt as the row before copies that row's cache."""
    logits = torch.empty((len(row_prompts), target.args.vocab_size), device=device)
    for row, p in enumerate(row_prompts):
        if row and row_prompts[row - 1] == p:
            for layer in range(target.args.n_layers):
                cache.k[layer][row], cache.v[layer][row] = cache.k[layer][row - 1], cache.v[layer][row - 1]
            logits[row] = logits[row - 1]
            continue
        ids = torch.tensor([prompts[p]], device=device)
        logits[row] = target.model(ids, torch.arange(ids.shape[1], device=device)[None], cache,
                                   rows=torch.tensor([row], device=device), kv_len=ids.shape[1],
                                   logits_from=ids.shape[1] - 1)[0, -1]
    return logits


def padded(group: list[dict], device) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids [B, T], padded on the left so that every row's generated tokens fill its last G columns, and their
    positions: a row's own tokens at 0..len-1, its padding after them (len..T-1), which causal attention never
    lets a real token see. The head then runs on the last G + 1 columns only."""
    width = max(len(s["tokens"]) for s in group)
    ids = torch.zeros((len(group), width), dtype=torch.long)
    positions = torch.empty((len(group), width), dtype=torch.long)
    for row, s in enumerate(group):
        length = len(s["tokens"])
        ids[row, width - length :] = torch.from_numpy(s["tokens"])
        positions[row] = torch.cat([torch.arange(length, width), torch.arange(length)])
    return ids.to(device), positions.to(device)


def forward(model, group: list[dict], device) -> torch.Tensor:
    """The model's logits [B, G, V'] at the positions predicting each sequence's G generated tokens."""
    ids, positions = padded(group, device)
    generated = len(group[0]["tokens"]) - group[0]["prompt_len"]
    cache = KVCache(model.args, len(group), ids.shape[1], torch.float32, device)
    return model(ids, positions, cache, kv_len=ids.shape[1], logits_from=ids.shape[1] - generated - 1)[:, :generated]


@torch.no_grad()
def teach(target, sequences: list[dict], prompts: list[list[int]], subset: torch.Tensor, batch: int, device):
    """Each sequence's teacher laws: p over the subset [G, N] (bfloat16) and the target's full-vocabulary argmax [G].
    Each prompt is fed once per batch (generation order keeps a prompt's samples together), then every row's
    generated tokens in one pass: the laws they were drawn from, recomputed."""
    for first in range(0, len(sequences), batch):
        group = sequences[first : first + batch]
        lengths = torch.tensor([s["prompt_len"] for s in group], device=device)
        generated = torch.from_numpy(np.stack([s["tokens"][s["prompt_len"]:] for s in group])).to(device)
        cache = KVCache(target.args, len(group), int(lengths.max()) + generated.shape[1], torch.float32, device)
        last = prefill(target, [s["prompt"] for s in group], prompts, cache, device)
        positions = lengths[:, None] + torch.arange(generated.shape[1] - 1, device=device)
        rest = target.model(generated[:, :-1], positions, cache, kv_len=int(positions.max()) + 1)
        logp = torch.log_softmax(torch.cat([last[:, None], rest], 1), -1)
        for s, row_logp in zip(group, logp):
            s["p"], s["argmax"] = row_logp[:, subset].exp().to(torch.bfloat16), row_logp.argmax(-1)


def initial_draft(target, subset: torch.Tensor, layers: int, device):
    """The target's first layers, its final norm, its head's rows for the subset; the embedding is the target's own."""
    state = {name: tensor.detach().clone() for name, tensor in target.model.state_dict().items()
             if name.startswith(tuple(f"layers.{i}." for i in range(layers))) or name == "norm.weight"}
    state["output.weight"] = target.model.output.weight.detach()[subset].clone()
    state["tok_embeddings.weight"] = target.model.tok_embeddings.weight
    args = ModelArgs(**{**vars(target.args), "n_layers": layers, "tie_embeddings": False})
    return build_model(args, state, torch.float32, device)


def subset_kl(draft_logits: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """p(S) KL(p_S || q) = sum_{x in S} p(x) log(p(x) / (p(S) q(x))), p_S the target's law restricted to S and
    renormalised, averaged over positions: >= 0, and 0 where q = p_S."""
    p = p.float()
    mass = p.sum(-1)
    return ((torch.xlogy(p, p) - p * torch.log_softmax(draft_logits.float(), -1)).sum(-1) - torch.xlogy(mass, mass)).mean()


def train_draft(draft, train: list[dict], held: list[dict], subset: torch.Tensor, args, device, start: float):
    """Train for args.train_seconds; every ~10 s (and at the end) the held-out-of-training prompts' numbers are taken,
    and the weights of the check with the lowest subset KL there are kept (early stopping on a validation set that
    shares no prompt with the estimator's eval). Returns the loss curve and the kept check."""
    params = [p for name, p in draft.named_parameters() if not name.startswith("tok_embeddings")]
    draft.train()
    for p in params:
        p.requires_grad_(True)
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    rng = np.random.default_rng(args.seed)
    curve, best, kept, step, began, last_check = [], None, None, 0, time.perf_counter(), 0.0

    def check(elapsed: float, loss: float):
        nonlocal best, kept
        curve.append({"step": step, "seconds": round(elapsed, 1), "loss": round(loss, 4),
                      "held_out": agreement(draft, held, subset, args.batch, device)})
        log(start, f"step {step}: loss {curve[-1]['loss']}, held out {json.dumps(curve[-1]['held_out'])}")
        if best is None or curve[-1]["held_out"]["subset_kl"] < best["held_out"]["subset_kl"]:
            best = curve[-1]
            kept = {name: t.detach().clone() for name, t in draft.state_dict().items() if not name.startswith("tok_embeddings")}

    while (elapsed := time.perf_counter() - began) < args.train_seconds:
        for group in optimizer.param_groups:  # linear decay to 0 at the time budget, after a short warm-up
            group["lr"] = args.lr * min(1.0, (step + 1) / 20) * (1 - elapsed / args.train_seconds)
        group = [train[i] for i in rng.choice(len(train), size=min(args.batch, len(train)), replace=False)]
        loss = subset_kl(forward(draft, group, device), torch.stack([s["p"] for s in group]))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        step += 1
        if step == 1 or elapsed - last_check > 10:
            check(elapsed, loss.item())
            last_check = time.perf_counter() - began
    check(time.perf_counter() - began, loss.item())
    draft.load_state_dict(kept, strict=False)
    draft.eval().requires_grad_(False)
    return curve, best


@torch.no_grad()
def agreement(draft, held: list[dict], subset: torch.Tensor, batch: int, device) -> dict:
    """Top-1 agreement with the target (draft argmax mapped to its full id == target argmax) and the expected
    acceptance of a temperature-1 proposal, sum_x min(p(x), q(x)), over the held-out generated positions."""
    agree = accept = kl = positions = 0.0
    for first in range(0, len(held), batch):
        group = held[first : first + batch]
        logits = forward(draft, group, device)
        p = torch.stack([s["p"] for s in group]).float()
        agree += (subset[logits.argmax(-1)] == torch.stack([s["argmax"] for s in group])).sum().item()
        accept += torch.minimum(p, torch.softmax(logits, -1)).sum().item()
        kl += subset_kl(logits, p).item() * p.shape[0] * p.shape[1]
        positions += p.shape[0] * p.shape[1]
    return {"top1_agreement": round(agree / positions, 4), "expected_acceptance_t1": round(accept / positions, 4),
            "subset_kl": round(kl / positions, 4), "positions": int(positions)}


def q8_0(weight: torch.Tensor) -> np.ndarray:
    """ggml's Q8_0 rows: per block of 32 weights an fp16 scale d = max|w| / 127 and round(w / d) as int8."""
    w = weight.detach().float().cpu().numpy().reshape(weight.shape[0], -1, 32)
    scale = (np.abs(w).max(-1, keepdims=True) / 127).astype(np.float16)
    step = scale.astype(np.float32)
    q = np.round(np.divide(w, step, out=np.zeros_like(w), where=step > 0)).clip(-127, 127).astype(np.int8)
    return np.concatenate([scale.view(np.uint8), q.view(np.uint8)], -1).reshape(weight.shape[0], -1)


def llama_permuted(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Our rotate-half q/k rows in llama.cpp's interleaved order (the inverse of weights._unpermute)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def write_gguf(path: Path, draft, subset: torch.Tensor, target) -> Path:
    import gguf

    a = draft.args
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_name("SmolLM2-135M distilled draft")
    writer.add_context_length(target.args.max_seq_len)
    writer.add_embedding_length(a.dim)
    writer.add_block_count(a.n_layers)
    writer.add_feed_forward_length(a.intermediate_size)
    writer.add_head_count(a.n_heads)
    writer.add_head_count_kv(a.n_kv_heads)
    writer.add_rope_freq_base(a.rope_base)
    writer.add_layer_norm_rms_eps(a.norm_eps)
    writer.add_vocab_size(a.vocab_size)
    writer.add_array(DRAFT_SUBSET_KEY, subset.tolist())
    writer.add_string(DRAFT_VOCAB_KEY, target.tokenizer.vocab_fingerprint())
    matrices = {"output.weight": draft.output.weight}
    for i, layer in enumerate(draft.layers):
        q, k, v = layer.attention.wqkv.weight.split(layer.attention.split)
        gate, up = layer.feed_forward.w13.weight.chunk(2)
        matrices.update({f"blk.{i}.attn_q.weight": llama_permuted(q, a.n_heads),
                         f"blk.{i}.attn_k.weight": llama_permuted(k, a.n_kv_heads), f"blk.{i}.attn_v.weight": v,
                         f"blk.{i}.attn_output.weight": layer.attention.wo.weight, f"blk.{i}.ffn_gate.weight": gate,
                         f"blk.{i}.ffn_up.weight": up, f"blk.{i}.ffn_down.weight": layer.feed_forward.w2.weight})
        for name, norm in (("attn_norm", layer.attention_norm), ("ffn_norm", layer.ffn_norm)):
            writer.add_tensor(f"blk.{i}.{name}.weight", norm.weight.detach().float().cpu().numpy())
    writer.add_tensor("output_norm.weight", draft.norm.weight.detach().float().cpu().numpy())
    for name, weight in matrices.items():
        writer.add_tensor(name, q8_0(weight), raw_dtype=gguf.GGMLQuantizationType(GGML_Q8_0))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def commit() -> str | None:
    """The commit this ran from, where the tree is a git checkout (a copied tree may have no .git)."""
    if not shutil.which("git"):
        return None
    done = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=False,
                          cwd=Path(__file__).parent)
    return done.stdout.strip() or None


def device_name(device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


if __name__ == "__main__":
    main()
