"""`autotune estimate`: resolve the inputs, rank, and render the PREDICTED table (or JSON)."""
from __future__ import annotations

import io
import json

from rich.console import Console
from rich.table import Table

from autotune.hardware import probe
from autotune.predict.checkpoints import checkpoint_for
from autotune.predict.drafts import read_draft
from autotune.predict.knobs import Engine
from autotune.predict.models import load_model
from autotune.predict.rank import changed, launch_command, model_argument, rank_configs
from autotune.space import load_space
from autotune.space.fit import fit_space

REFUSED_SHOWN = 10  # pinned configurations refused, listed with their reasons


def estimate_report(*, model: str, gpu: str, num_gpus: int | None, engine: Engine, draft_model: str | None,
                    alpha: float | None, concurrency: int, context_len: int | None, top: int, as_json: bool,
                    space=None, draft_kind: str | None = None) -> str:
    """`engine`: the engine's adapter; `space`: its search space as the user narrowed it (`--space`,
    `--set`: study.plan.user_space), default the engine's own. Every configuration ranked satisfies the
    pins; those the rules, checkpoints or memory refuse are listed with the reason when the user pinned
    anything (what they asked about, however it ranks). The draft checkpoint is offered only as what its
    config (or `draft_kind`, --draft-kind, where none can be read) says it is. Raises ValueError (one line) for
    anything unusable."""
    if alpha is not None and not 0 < alpha < 1:
        raise ValueError(f"--alpha must be in (0, 1), got {alpha}")
    if concurrency < 1 or top < 1 or (num_gpus is not None and num_gpus < 1) or (context_len is not None and context_len < 1):
        raise ValueError("--concurrency, --top, --num-gpus and --context-len must be at least 1")
    spec = load_model(model)
    checkpoint = read_draft(draft_model, draft_kind) if draft_model else None
    draft = None  # its weights, where its files are here (a directory, a GGUF, a hub id's cached snapshot)
    if checkpoint and checkpoint.files:
        try:
            draft = load_model(checkpoint.files)
        except ValueError:  # a head whose config has no model shapes: sized by the model's rules
            draft = None
    hardware = probe(gpu)
    profile = hardware.profile
    gpus = num_gpus or max(1, hardware.gpu_count)
    if profile is None:
        raise ValueError("no hardware profile matches this machine's GPU; pass --gpu <profile>")
    # launch lines for the profile's machine, not this one's build; a planned machine's name no path of this one
    engine = engine.for_target(profile.is_gpu, this_machine=hardware.source == "measured")
    space = space or load_space(engine.name)
    pins = {name: p.fixed for name, p in space.params.items() if p.pinned}
    # what the engine offers on the profile's device and units (a GPU's knobs off on a CPU and the other way)
    space = fit_space(space, hardware, concurrency)
    refused: list = []
    ranked = rank_configs(space, spec, profile, gpus, top, engine=engine, concurrency=concurrency,
                          context_len=context_len, alpha=alpha, draft=draft, has_draft_model=bool(draft_model),
                          draft_checkpoint=checkpoint, keep=refused)
    target = model_argument(spec, model, engine)
    defaults = load_space(engine.name)
    rows = []
    for i, (config, prediction) in enumerate(ranked):
        checkpoint = checkpoint_for(spec.name, engine.knobs(config, profile.is_gpu), target)
        load = target
        if checkpoint:  # a GGUF file of the row's type is named after the preset, for the user to replace
            load = checkpoint.load_as or spec.name
        rows.append({"rank": i + 1, "config": config, "changed": changed(config, defaults), **prediction.to_dict(),
                     "checkpoint": checkpoint.describe() if checkpoint else None,
                     "user_supplies_checkpoint": bool(checkpoint and checkpoint.user_supplied),
                     "launch": launch_command(engine, config, load, draft_model)})
    refused_rows = [{"changed": changed(config, defaults), "reasons": reasons}
                    for config, reasons in refused[:REFUSED_SHOWN]] if pins else []
    where = f"{gpus} x {profile.name}"
    if as_json:
        return json.dumps({"predicted": True, "model": spec.name, "hardware": where, "engine": engine.name,
                           "concurrency": concurrency, "pinned": pins, "configs": rows, "refused": refused_rows},
                          indent=2, default=str)
    return _table(rows, spec.name, where, engine.name, concurrency, profile, pins, refused_rows)


def _table(rows: list[dict], model: str, where: str, engine: str, concurrency: int, profile, pins: dict,
           refused: list[dict]) -> str:
    title = (f"PREDICTED (not measured): {model} on {where}, {engine}, ranked by "
             + (f"tok/s at concurrency {concurrency}" if concurrency > 1 else "single-stream tok/s"))
    table = Table(title=title)
    for col in ("#", "configuration (changed from defaults)", "tok/s 1 stream", f"tok/s @{concurrency}",
                "tok/step", "GB/GPU", "KV tokens", "seqs", "bound", "weights"):
        table.add_column(col, justify="left" if col.startswith("config") else "right")
    for r in rows:
        s, m = r["speed"], r["memory"]
        knobs = ", ".join(f"{k}={v}" for k, v in r["changed"].items()) or "(engine defaults)"
        table.add_row(str(r["rank"]), knobs, f"{s['single_tok_s']:.1f}", f"{s['concurrent_tok_s']:.1f}",
                      f"{s['tokens_per_step']:.2f}", f"{m['weights_gb'] + m['draft_gb']:.1f}", str(m["kv_tokens"]),
                      str(s["batch"]), s["bound"], _weights_mark(r))
    out = io.StringIO()
    console = Console(file=out, width=160, force_terminal=False)
    console.print(table)
    if pins:
        console.print("pinned: " + ", ".join(f"{k}={v}" for k, v in pins.items()))
    for r in refused:
        knobs = ", ".join(f"{k}={v}" for k, v in r["changed"].items()) or "(engine defaults)"
        console.print(f"  refused: {knobs}: {'; '.join(r['reasons'])}", soft_wrap=True)
    if not rows:
        console.print("no configuration fits: see `autotune estimate --help` for --num-gpus, --gpu, --set")
    for checkpoint in dict.fromkeys(r["checkpoint"] for r in rows if r["checkpoint"]):
        ranks = ", ".join(str(r["rank"]) for r in rows if r["checkpoint"] == checkpoint)
        console.print(f"rows {ranks} load {checkpoint}", soft_wrap=True)
    note = "" if profile.is_gpu else " (CPU: no bandwidth on the profile; assumed, see autotune/predict/speed.py)"
    console.print(f"PREDICTED launch commands{note}:")
    for r in rows:
        console.print(f"  {r['rank']}. {r['launch']}", soft_wrap=True)
    return out.getvalue().rstrip()


def _weights_mark(row: dict) -> str:
    """The weights column: "you supply" where no published checkpoint of that format is known."""
    if not row["checkpoint"]:
        return ""
    return "you supply" if row["user_supplies_checkpoint"] else "published"
