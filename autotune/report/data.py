"""What the report reads from a study, and what it works out from that: the trials as one table, the validation
document, the per-request tables, Pareto fronts, the GPU count and a configuration's launch command."""
from __future__ import annotations

import shlex

import pandas as pd

from autotune.study.record import is_ok
from autotune.study.storage import StudyContext
from autotune.validate.record import Validation


def trials_frame(ctx: StudyContext) -> pd.DataFrame:
    """One row per trial: number, status, reason, config, and the benchmark metrics where measured."""
    rows = []
    for t in ctx.study.get_trials(deepcopy=False):
        a = t.user_attrs
        m = a.get("metrics") or {}
        status = a.get("status", t.state.name.lower())
        if status == "duplicate":
            status = f"duplicate ({a.get('original_status')})"
        rows.append({"number": t.number, "state": t.state.name, "status": status, "ok": is_ok(t),
                     "reason": a.get("failure") or "", "config": a.get("config") or dict(t.params),
                     "warmup_s": a.get("warmup_s"), "value": t.values[0] if t.values else None, **{k: v for k, v in m.items() if
                                                                      isinstance(v, (int, float)) and not isinstance(v, bool)}})
    return pd.DataFrame(rows, columns=None if rows else ["number", "state", "status", "ok", "reason", "config", "value"])


def validation_doc(ctx: StudyContext) -> Validation | None:
    return Validation.load(ctx.best_dir)


def request_frames(ctx: StudyContext) -> dict[str, pd.DataFrame]:
    """Per-request tables by label: "trial-N" (the study's own runs) and "validation trial-N" / "validation baseline"."""
    out = {}
    for path in sorted((ctx.directory / "requests").glob("trial-*.parquet")):
        out[path.stem] = pd.read_parquet(path)
    for path in sorted((ctx.directory / "validation").glob("*-repeat-*.parquet")):
        label = "validation " + path.stem.rsplit("-repeat-", 1)[0]
        out[label] = pd.concat([out[label], pd.read_parquet(path)]) if label in out else pd.read_parquet(path)
    return out


def pareto_front(points: list[tuple[float, float, int]], x_max: bool, y_max: bool) -> list[tuple[float, float, int]]:
    """Points no other point beats on both axes, sorted by x."""
    def beats(a, b):
        ge = (a[0] >= b[0] if x_max else a[0] <= b[0]) and (a[1] >= b[1] if y_max else a[1] <= b[1])
        return ge and (a[0], a[1]) != (b[0], b[1])
    return sorted((p for p in points if not any(beats(q, p) for q in points)), key=lambda p: p[0])


def gpu_count(ctx: StudyContext) -> int:
    return max(1, len((ctx.provenance.get("hardware") or {}).get("gpus") or []))


def launch_text(ctx: StudyContext, config: dict) -> str:
    adapter = ctx.adapter
    try:
        argv, env = adapter.command(config, model=ctx.model, draft_model=ctx.draft_model,
                                    host="127.0.0.1", port=adapter.facts.default_port)
    except ValueError as e:
        return f"(no command: {e})"
    return " ".join([*(f"{k}={shlex.quote(v)}" for k, v in env.items()), shlex.join(argv)])
