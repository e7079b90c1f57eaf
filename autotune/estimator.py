"""The runtime draft-length estimator: per request, pick k from prompt features and temperature.

Data: one row per measured request (a study's `requests/trial-N.parquet`, or a collection pass run
here against a live embedded server with several fixed k): the prompt the model saw, temperature,
top_p, the engine's prompt_entropy, and the request's verify steps, proposed, accepted and rejected
tokens, draft and verify seconds.

Fit, per feature bucket x temperature band:
  alpha = accepted / (accepted + rejections)   maximum likelihood of the per-token acceptance under
          the geometric model: a step that accepts a < k proposals is a accepts and one rejection,
          a fully accepted step k accepts and none. (accepted / proposed is biased low: proposals
          after the first rejection were never tested.)
  c     = marginal cost of one more proposed token over the cost of a step without speculation,
          from the engine's draft + verify seconds per step regressed on k (with several k in the
          data); with one k, draft seconds per proposed token over verify seconds per step.
  cost  = where the data holds k = 0 requests (plain decode) and several k (a collection pass): the
          measured seconds of a step proposing k over a plain step, per k (step_costs: verify cost is
          not linear in width on CPU kernels); otherwise 1 + k c.
  k*    = argmax_k (1 - alpha^(k+1)) / ((1 - alpha) cost(k)), k = 0 included (speedup exactly 1: no
          speculation for requests where no k pays), k up to the largest k measured.
Cells with fewer than MIN_TRIALS Bernoulli trials borrow alpha from their bucket (all bands), then
from all data. Features: the engine's prompt_entropy and the model-free compression_ratio and
unigram_entropy; the one whose value ranks per-request alpha best (|Spearman|) is chosen, and the
best model-free one is fitted too as the fallback the standalone module uses.
"""
import inspect
import json
import math
from collections import Counter
from dataclasses import asdict, dataclass, field
from itertools import zip_longest
from pathlib import Path

import numpy as np
import pandas as pd

from autotune.embedded.draft_policy import TEXT_FEATURES, compression_ratio, table_k, unigram_entropy

ENGINE_FEATURE = "prompt_entropy"
CANDIDATES = (ENGINE_FEATURE, *TEXT_FEATURES)
TEMPERATURE_EDGES = (0.0, 0.5)  # bands: greedy, (0, 0.5], above 0.5
MIN_TRIALS = 30
N_BUCKETS = 3
COUNTS = ("spec_verify_steps", "spec_draft_tokens", "spec_accepted_tokens")


def expected_speedup(alpha: float, k: int, c: float, step_cost: dict[int, float] | None = None) -> float:
    """Tokens per unit of time relative to no speculation (Leviathan et al.'s formula). A step proposing k
    tokens costs 1 + k c plain steps, or step_cost[k] where the cost of each k was measured."""
    tokens = k + 1 if alpha >= 1 else (1 - alpha ** (k + 1)) / (1 - alpha)
    return tokens / (step_cost[k] if step_cost else 1 + k * c)


def best_k(alpha: float, c: float, max_k: int, step_cost: dict[int, float] | None = None) -> int:
    """The k (0 = no speculation: speedup exactly 1) of the highest expected speedup; with measured
    step costs, among the k measured."""
    ks = sorted(step_cost) if step_cost else range(max_k + 1)
    return max(ks, key=lambda k: (expected_speedup(alpha, k, c, step_cost), -k))


def alpha_mle(accepted: float, rejections: float) -> float | None:
    trials = accepted + rejections
    return accepted / trials if trials > 0 else None


def rejections_from_moments(steps: float, proposed: float, accepted: float) -> float:
    """Rejections when the data lacks them: solve mean accepts per step = a(1-a^k)/(1-a), k = proposed/steps."""
    if steps <= 0 or proposed <= 0:
        return 0.0
    k, mean = proposed / steps, accepted / steps
    if mean >= k - 1e-9:
        return 0.0
    lo, hi = 0.0, 1.0 - 1e-9
    for _ in range(60):  # the mean rises with a: bisection
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if mid * (1 - mid ** k) / (1 - mid) < mean else (lo, mid)
    return steps * (1 - lo ** k)


def feature_frame(rows: pd.DataFrame) -> pd.DataFrame:
    """rows (text, temperature, top_p, usage counters) -> the same with per-request features and alpha."""
    missing = [c for c in ("text", "temperature", *COUNTS, "spec_accepted_tokens") if c not in rows]
    if missing:
        raise ValueError(f"the request data lacks {', '.join(missing)}")
    out = rows.copy()
    out["top_p"] = out["top_p"] if "top_p" in out else 1.0
    if ENGINE_FEATURE not in out:
        out[ENGINE_FEATURE] = np.nan
    for name, fn in TEXT_FEATURES.items():
        out[name] = [fn(t) for t in out["text"]]
    if "spec_rejections" not in out or out["spec_rejections"].isna().any():
        estimated = [rejections_from_moments(s, p, a) for s, p, a in
                     zip(out["spec_verify_steps"], out["spec_draft_tokens"], out["spec_accepted_tokens"])]
        known = out["spec_rejections"] if "spec_rejections" in out else pd.Series(np.nan, index=out.index)
        out["rejections_estimated"] = known.isna()
        out["spec_rejections"] = known.fillna(pd.Series(estimated, index=out.index))
    out["alpha"] = [alpha_mle(a, r) for a, r in zip(out["spec_accepted_tokens"], out["spec_rejections"])]
    return out


def feature_quality(frame: pd.DataFrame) -> dict:
    """|Spearman| of each candidate feature (and top_p) against per-request alpha, within temperature bands."""
    usable = frame[(frame["spec_accepted_tokens"] + frame["spec_rejections"]) >= 3]
    bands = np.searchsorted(TEMPERATURE_EDGES, usable["temperature"], side="left")
    quality = {}
    for name in (*CANDIDATES, "top_p"):
        rhos, weights = [], []
        for band in np.unique(bands):
            part = usable[bands == band][[name, "alpha"]].dropna()
            if len(part) >= 5 and part[name].nunique() > 1 and part["alpha"].nunique() > 1:
                # Spearman as Pearson of ranks: pandas' method="spearman" needs scipy, a dev-only package
                rhos.append(part[name].rank().corr(part["alpha"].rank()))
                weights.append(len(part))
        rho = float(np.average(rhos, weights=weights)) if rhos else None
        quality[name] = {"spearman": None if rho is None else round(rho, 4), "requests": int(sum(weights))}
    return quality


@dataclass
class Table:
    """k per temperature band x feature bucket of one feature, and what it was fitted from."""

    feature: str
    thresholds: list[float]
    temperature_edges: list[float]
    k_table: list[list[int]]
    buckets: list[dict] = field(default_factory=list)  # one per cell: ranges, trials, alpha, k, expected speedup

    def k(self, value: float, temperature: float) -> int:
        return table_k(asdict(self), value, temperature)


def fit_table(frame: pd.DataFrame, feature: str, c: float, max_k: int, step_cost: dict | None = None) -> Table:
    values = frame[feature].astype(float)
    thresholds = sorted({round(float(q), 6) for q in values.quantile(np.arange(1, N_BUCKETS) / N_BUCKETS)})
    bucket = np.searchsorted(thresholds, values, side="right")
    band = np.searchsorted(TEMPERATURE_EDGES, frame["temperature"], side="left")
    acc, rej = frame["spec_accepted_tokens"].to_numpy(float), frame["spec_rejections"].to_numpy(float)

    def pooled(mask):
        return acc[mask].sum(), rej[mask].sum()

    edges = [-math.inf, *TEMPERATURE_EDGES, math.inf]
    cuts = [-math.inf, *thresholds, math.inf]
    k_table, cells = [], []
    for b in range(len(TEMPERATURE_EDGES) + 1):
        row = []
        for q in range(len(thresholds) + 1):
            for source, mask in (("cell", (band == b) & (bucket == q)), ("bucket", bucket == q), ("all", bucket >= 0)):
                a, r = pooled(mask)
                if a + r >= MIN_TRIALS or source == "all":
                    break
            alpha = alpha_mle(a, r)
            alpha = 0.0 if alpha is None else alpha
            k = best_k(alpha, c, max_k, step_cost)
            row.append(k)
            cells.append({"band": b, "temperature": finite([max(edges[b], 0.0), edges[b + 1]]), "bucket": q,
                          feature: finite([cuts[q], cuts[q + 1]]), "requests": int(((band == b) & (bucket == q)).sum()),
                          "accepted": int(a), "rejections": int(round(r)), "alpha": round(alpha, 4),
                          "alpha_from": source, "k": k, "expected_speedup": round(expected_speedup(alpha, k, c, step_cost), 4)})
        k_table.append(row)
    return Table(feature, thresholds, list(TEMPERATURE_EDGES), k_table, cells)


def finite(bounds: list[float]) -> list[float | None]:
    """JSON has no infinity: an open end of a range is null."""
    return [None if math.isinf(x) else x for x in bounds]


def draft_cost(frame: pd.DataFrame) -> dict:
    """c from the engine's draft and verify seconds (see the module docstring); without them (a study whose
    rows lack spec_*_seconds), from client-side decode seconds per verify step regressed on k."""
    ok = frame[frame["spec_verify_steps"] > 0]
    steps, k = ok["spec_verify_steps"], ok["spec_draft_tokens"] / ok["spec_verify_steps"]
    timed = {"spec_draft_seconds", "spec_verify_seconds"} <= set(ok) and ok["spec_verify_seconds"].notna().all()
    if timed:
        per_step = (ok["spec_draft_seconds"] + ok["spec_verify_seconds"]) / steps
        draft_per_token = ok["spec_draft_seconds"].sum() / max(ok["spec_draft_tokens"].sum(), 1)
        c_draft = float(draft_per_token / (ok["spec_verify_seconds"].sum() / steps.sum()))
    elif {"e2e_ms", "ttft_ms"} <= set(ok) and ok["e2e_ms"].notna().all():
        per_step, c_draft = (ok["e2e_ms"] - ok["ttft_ms"]) / 1000 / steps, None
    else:
        raise ValueError("the request data has no draft/verify times (spec_draft_seconds, spec_verify_seconds) "
                         "nor request latencies; give the draft cost ratio c explicitly")
    if k.std() > 0.5 and len(ok) >= 4:
        slope, intercept = np.polyfit(k, per_step, 1)
        if intercept > 0:
            return {"c": round(float(max(slope / intercept, 1e-3)), 5), "c_draft": c_draft and round(c_draft, 5),
                    "c_from": "step seconds regressed on k (" + ("engine draft + verify times)" if timed else
                                                               "client decode time per verify step)")}
    if c_draft is None:
        raise ValueError("the request data has one draft length only and no draft/verify times: c cannot be measured")
    return {"c": round(max(c_draft, 1e-3), 5), "c_draft": round(c_draft, 5),
            "c_from": "draft seconds per token / verify seconds per step"}


def step_costs(frame: pd.DataFrame) -> dict[int, float] | None:
    """Seconds of a verify step proposing k tokens over those of a step without proposals, per k measured:
    from rows at several fixed k including k = 0 (plain steps), with the engine's draft and verify seconds.
    None without such rows. The cost of a verify pass need not grow linearly in its width (CPU matrix
    kernels: a 2-token pass can cost far more than 2/1 of a 1-token one, a 5-token pass less than a
    3-token one), so each k's cost is measured rather than extrapolated from 1 + k c.

    A request at k > 0 mixes steps that proposed (about draft_tokens / k of them: a prompt-lookup match
    proposes its k tokens) with steps where the drafter found nothing, which cost a plain step."""
    needed = {"k", "spec_draft_seconds", "spec_verify_seconds"}
    if not needed <= set(frame) or frame[list(needed)].isna().any().any() or not (frame["k"] == 0).any():
        return None
    seconds = frame["spec_draft_seconds"] + frame["spec_verify_seconds"]
    plain = frame["k"] == 0
    base = seconds[plain].sum() / frame["spec_verify_steps"][plain].sum()
    costs = {0: 1.0}
    for k in sorted(int(k) for k in frame["k"].unique() if k > 0):
        rows = frame["k"] == k
        proposing = frame["spec_draft_tokens"][rows].sum() / k
        if proposing >= 1:
            plain_steps = frame["spec_verify_steps"][rows].sum() - proposing
            costs[k] = round(float((seconds[rows].sum() - base * plain_steps) / proposing / base), 4)
    return costs if len(costs) > 1 else None


@dataclass
class Estimator:
    primary: Table
    fallback: Table  # model-free: what the standalone module computes from the prompt alone
    c: float
    info: dict  # c's provenance, feature quality, the fitted data

    def draft_length(self, prompt: str, temperature: float = 0.0, top_p: float = 1.0,
                     prompt_entropy: float | None = None) -> int:
        """The fitted k; uses the primary feature when it can be computed, else the fallback."""
        if self.primary.feature == ENGINE_FEATURE and prompt_entropy is not None:
            return self.primary.k(prompt_entropy, temperature)
        table = self.fallback if self.primary.feature == ENGINE_FEATURE else self.primary
        return table.k(TEXT_FEATURES[table.feature](prompt), temperature)

    def to_json(self) -> dict:
        p = asdict(self.primary)
        return {"format": "autotune-draft-estimator/1", **{k: p[k] for k in ("feature", "thresholds",
                "temperature_edges", "k_table")}, "buckets": p["buckets"], "c": self.c,
                "fallback": asdict(self.fallback), **self.info}

    def write(self, out_dir: str | Path) -> Path:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "estimator.json").write_text(json.dumps(self.to_json(), indent=1, allow_nan=False) + "\n")
        (out / "draft_length_estimator.py").write_text(standalone_module(self))
        return out / "estimator.json"


def fit(rows: pd.DataFrame, *, c: float | None = None, max_k: int | None = None, source: str = "") -> Estimator:
    """Fit the estimator on per-request rows (see feature_frame). Raises ValueError on unusable data."""
    if rows is None or len(rows) == 0:
        raise ValueError("no request data to fit on")
    frame = feature_frame(rows)
    frame = frame[frame["spec_verify_steps"] > 0]
    if (frame["spec_accepted_tokens"] + frame["spec_rejections"]).sum() < MIN_TRIALS:
        raise ValueError(f"too little speculation in the data to fit on ({len(frame)} requests with verify steps; "
                         "was the drafter 'none'?)")
    cost = {"c": c, "c_from": "given"} if c is not None else draft_cost(frame)
    step_cost = None if c is not None else step_costs(frame)
    if max_k is None:  # never extrapolate the cost model past what was measured
        max_k = int(frame["k"].max()) if "k" in frame and frame["k"].notna().any() else 8
    if step_cost:
        step_cost = {k: v for k, v in step_cost.items() if k <= max_k}
    quality = feature_quality(frame)
    rank = {n: abs(q["spearman"]) if q["spearman"] is not None else -1.0 for n, q in quality.items()}
    usable = [n for n in CANDIDATES if frame[n].notna().all()]
    primary = max(usable, key=lambda n: rank[n])
    fallback = max(TEXT_FEATURES, key=lambda n: rank[n])
    tables = {n: fit_table(frame, n, cost["c"], max_k, step_cost) for n in {primary, fallback}}
    data_cols = ["text", "temperature", "top_p", *CANDIDATES, *COUNTS, "spec_rejections", "alpha",
                 *[col for col in ("k", "spec_draft_seconds", "spec_verify_seconds") if col in frame]]
    info = {**{k: v for k, v in cost.items() if k != "c"}, "max_k": max_k,
            "step_cost": step_cost and {str(k): v for k, v in step_cost.items()},
            "speedup_model": "tokens per step (alpha) / measured step_cost[k]" if step_cost else
            "tokens per step (alpha) / (1 + k c)", "feature_quality": quality,
            "fallback_feature": fallback, "source": source, "requests": len(frame),
            "rejections_from": "estimated from accepts per step (the rows lack spec_rejections)"
            if frame.get("rejections_estimated", pd.Series([False])).any() else "counted by the engine",
            "data": json.loads(frame[data_cols].to_json(orient="records"))}
    return Estimator(tables[primary], tables[fallback], cost["c"], info)


def standalone_module(est: Estimator) -> str:
    """draft_length_estimator.py: the fallback (model-free) table and its feature function, stdlib only."""
    table = asdict(est.fallback)
    table = {k: table[k] for k in ("feature", "thresholds", "temperature_edges", "k_table")}
    fn = TEXT_FEATURES[table["feature"]]
    uses = {compression_ratio: "import zlib", unigram_entropy: "import math\nimport re"}[fn]
    primary = est.primary.feature
    note = ("" if primary == table["feature"] else
            f"\nThe engine-side estimator.json keys on {primary} (the model's prompt entropy); this module cannot "
            f"compute\nthat, so it uses the fitted model-free fallback {table['feature']}.\n")
    return f'''"""Draft length per request, fitted by `autotune estimator fit` (no dependencies: copy it anywhere).

    estimate_draft_length(prompt, temperature=0.0, top_p=1.0) -> k

prompt: the text the model is given (for chat requests, after the chat template).
Feature: {table["feature"]} of the prompt; k from its bucket in the temperature's band; c = {est.c}.
{note}"""
import bisect
{uses}

TABLE = {json.dumps(table)}


{inspect.getsource(fn)}

{inspect.getsource(table_k)}

def estimate_draft_length(prompt: str, temperature: float = 0.0, top_p: float = 1.0) -> int:
    return table_k(TABLE, {fn.__name__}(prompt), temperature)


def draft_length(features: dict) -> int:
    """The embedded engine's Python-estimator hook (`autotune serve --draft-estimator this.py`)."""
    return estimate_draft_length(features.get("prompt_text") or "", features["temperature"], features["top_p"])
'''


# -- data: a study's per-request rows, or a collection pass against a live embedded server ---------------
RUNTIME = ("draft_length", "draft_policy")  # knobs that change k, not the drafter


def chat_renderer(model: str | None):
    """messages -> the text the embedded engine's model sees (its chat template), from the checkpoint's metadata."""
    from autotune.embedded.tokenizer import tokenizer_from_gguf, tokenizer_from_hf_dir
    from autotune.embedded.weights import bundled_gguf_path

    path = Path(model).expanduser() if model else bundled_gguf_path()
    if path.is_dir():
        tokenizer = tokenizer_from_hf_dir(path, json.loads((path / "config.json").read_text()))
    else:
        import gguf

        tokenizer = tokenizer_from_gguf({k: f.contents() for k, f in gguf.GGUFReader(path).fields.items()})
    return tokenizer.apply_chat_template


def study_rows(study_dir: str | Path) -> tuple[pd.DataFrame, dict]:
    """The speculative rows of a study's requests/trial-N.parquet of its most measured drafter setup, and that setup.

    Raises ValueError when the study holds no per-request data with speculation."""
    files = sorted(Path(study_dir, "requests").glob("trial-*.parquet"))
    if not files:
        raise ValueError(f"{study_dir} has no per-request data (requests/trial-N.parquet)")
    frame = pd.concat([pd.read_parquet(f) for f in files], ignore_index=True)
    frame = frame[frame["ok"].astype(bool) & (frame["spec_verify_steps"].fillna(0) > 0)]
    if frame.empty or "config" not in frame:
        raise ValueError(f"{study_dir}: no request in its per-request data used speculative decoding")
    configs = frame["config"].map(json.loads)
    setups = configs.map(lambda c: json.dumps({k: v for k, v in sorted(c.items()) if k not in RUNTIME}))
    setup = setups.value_counts().index[0]
    frame, configs = frame[setups == setup], configs[setups == setup]
    # H10's rows keep the user's text; the engine's features see the chat template around it
    render = chat_renderer(json.loads(setup).get("model")) if (frame["api"] == "chat").any() else None
    rows = frame.assign(
        text=[render([{"role": "user", "content": p}]) if api == "chat" else p for p, api in zip(frame["prompt"], frame["api"])],
        k=configs.map(lambda c: c.get("draft_length", 4)))
    config = dict(json.loads(setup), draft_length=int(rows["k"].mode()[0]))
    return rows.reset_index(drop=True), config


class Server:
    """An embedded server launched for collection or evaluation (stopped on exit)."""

    def __init__(self, config: dict, log_dir: Path, model: str | None = None, extra: tuple = ()):
        from autotune.engines.embedded import EmbeddedAdapter
        from autotune.engines.launcher import Launcher, free_port

        port = free_port()
        settings = {k: v for k, v in config.items() if k != "model"}
        argv, env = EmbeddedAdapter().command(settings, model=model or config.get("model"), draft_model=None,
                                              host="127.0.0.1", port=port, extra_args=extra)
        self.url = f"http://127.0.0.1:{port}"
        self.launcher = Launcher(argv, log_path=log_dir / "server.log", health_url=self.url + "/health", env=env)

    def __enter__(self):
        self.launcher.start(timeout=300)
        return self

    def __exit__(self, *exc):
        self.launcher.stop()


def send(client, url: str, request: dict, **extra) -> dict:
    """One request, non-streamed: its usage, text and wall seconds."""
    import time

    body = {k: v for k, v in request.items() if k != "api"} | extra
    path = "/v1/chat/completions" if request["api"] == "chat" else "/v1/completions"
    t0 = time.perf_counter()
    response = client.post(url + path, json=body)
    seconds = time.perf_counter() - t0
    response.raise_for_status()
    doc = response.json()
    choice = doc["choices"][0]
    text = choice["message"]["content"] if request["api"] == "chat" else choice["text"]
    return {**doc["usage"], "output": text, "seconds": seconds}


def requests_of(workloads: list[str], *, exclude: list[dict] = (), max_tokens: int, temperatures=None) -> list[dict]:
    """Shipped or file workloads as request bodies (minus `exclude`'s prompts), capped at max_tokens;
    temperatures, when given, are assigned round robin (the shipped code/chat/repetitive sets are greedy only)."""
    from autotune.bench import load_workload

    seen = {json.dumps(r.get("messages") or r.get("prompt")) for r in exclude}
    out = []
    for name in workloads:
        for r in load_workload(name).requests:
            if json.dumps(r.get("messages") or r.get("prompt")) not in seen:
                out.append(dict(r, max_tokens=min(r.get("max_tokens", max_tokens), max_tokens), ignore_eos=True))
    for i, r in enumerate(out):
        if temperatures:
            r["temperature"] = temperatures[i % len(temperatures)]
        r.setdefault("temperature", 1.0)
        r["seed"] = i
    return out


def progress(total: int, label: str):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    bar = Progress(TextColumn(label), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), transient=True)
    return bar, bar.add_task(label, total=total)


def collect(config: dict, log_dir: Path, *, workloads=("code", "chat", "repetitive"), exclude: str = "mixed",
            ks=(0, 1, 2, 4, 8), temperatures=(0.0, 0.3, 0.7, 1.0), max_tokens: int = 48,
            limit: int | None = None, start: int = 0) -> pd.DataFrame:
    """Rows to fit on, measured here: the workloads' prompts (minus the held-out `exclude` set; the workloads
    interleaved, so `limit` takes from each; `start` skips that many, to extend an earlier pass) at
    temperatures round robin, each prompt run at every k in `ks` back to back in rotating order (paired: the same prompt at each k, minutes apart at most), one at a time
    on a fresh server. k = 0 rows (no speculation) anchor the cost model's step without proposals."""
    import httpx

    from autotune.bench import load_workload

    held_out = load_workload(exclude).requests if exclude else []
    per_workload = [requests_of([name], exclude=held_out, max_tokens=max_tokens) for name in workloads]
    todo = [r for group in zip_longest(*per_workload) for r in group if r is not None]
    for i, r in enumerate(todo):
        r["temperature"], r["seed"], r["index"] = temperatures[i % len(temperatures)], i, i
    todo = todo[start:][:limit]
    render = chat_renderer(config.get("model"))
    rows = []
    bar, task = progress(len(todo) * len(ks), "collect")
    with Server(config, log_dir) as server, httpx.Client(timeout=300) as client, bar:
        for request in todo:
            i = request.pop("index")
            text = render(request["messages"]) if request["api"] == "chat" else request["prompt"]
            turn = i % len(ks)
            for k in ks[turn:] + ks[:turn]:
                usage = send(client, server.url, request, draft_length=k)
                rows.append({**usage, "text": text, "temperature": request["temperature"],
                             "top_p": request.get("top_p", 1.0), "k": k, "prompt_index": i})
                bar.advance(task)
    return pd.DataFrame(rows)


def fit_from_study(study_dir: str | Path, out: str | Path | None = None, *, collect_if_missing: bool = False,
                   config: dict | None = None) -> Path:
    """The end-of-run hook: fit on the study's per-request data; writes estimator.json and
    draft_length_estimator.py into `out` (default: the study directory). Returns estimator.json's path.

    Without per-request data, collect_if_missing runs a collection pass with `config` (default: ngram, k=4)."""
    study_dir = Path(study_dir)
    out = Path(out) if out else study_dir
    try:
        rows, setup = study_rows(study_dir)
        source = f"study {study_dir}"
    except ValueError:
        if not collect_if_missing:
            raise
        out.mkdir(parents=True, exist_ok=True)
        setup = config or {"drafter": "ngram", "draft_length": 4}
        rows, source = collect(setup, out), "collection pass (code, chat, repetitive; k 1..8; temperatures 0..1)"
        rows.to_parquet(out / "estimator-data.parquet", index=False)
    estimator = fit(rows, source=source)
    estimator.info["engine_config"] = setup
    return estimator.write(out)


# -- evaluation: the estimator against the best single fixed k, same server, interleaved ----------------
def evaluate(estimator_path: str | Path, log_dir: Path, *, workload: str = "mixed", fixed: list[int] | None = None,
             repeats: int = 2, max_tokens: int = 32, limit: int | None = None, engine: dict | None = None,
             reference: bool = False, rotation: int = 0) -> dict:
    """Throughput (completion tokens / request seconds, one request at a time) of the estimator policy and of
    each fixed k >= 1 on one server; per request the arms run back to back in rotating order, each repeat a
    full pass. With `reference` (or 0 in `fixed`), k = 0 (speculation off) runs too: reported, never the best
    fixed arm. An arm's throughput pools all its requests and repeats; the best fixed k is the fixed arm with
    the highest. Beside that: the median of paired per-request ratios (estimator tok/s / best fixed tok/s on
    the same request and repeat, run back to back) and a bootstrap 90 % interval of the throughput ratio
    (requests resampled). Greedy (temperature 0) outputs of every arm are compared with the estimator's.
    `engine` overrides the estimator file's engine settings (e.g. {"threads": 1}); `rotation` shifts which
    arm goes first on each request (a second run with another rotation changes every arm's neighbours)."""
    import httpx

    from autotune.embedded.draft_policy import load_estimator

    estimate = load_estimator(str(estimator_path))  # the engine's own reading of the file: one-line ValueError
    doc = json.loads(Path(estimator_path).read_text())
    config = dict(doc.get("engine_config") or {"drafter": "ngram", "draft_length": 4}, **(engine or {}),
                  draft_policy="fixed")
    fixed = fixed or sorted({k for row in doc["k_table"] for k in row} | {config["draft_length"]})
    reference = reference or 0 in fixed
    fixed = sorted({k for k in fixed if k >= 1})
    if not fixed:
        raise ValueError("give at least one fixed draft length >= 1 to compare with")
    todo = requests_of([workload], max_tokens=max_tokens)[:limit]
    arms = ["estimator", *(f"k={k}" for k in fixed), *(["k=0"] if reference else [])]
    runs = {arm: [] for arm in arms}
    bar, task = progress(len(todo) * len(arms) * repeats, "eval")
    log_dir.mkdir(parents=True, exist_ok=True)
    with Server(config, log_dir, extra=("--draft-estimator", str(estimator_path))) as server, \
            httpx.Client(timeout=300) as client, bar:
        client.post(server.url + "/admin/runtime", json={"draft_policy": "estimator"}).raise_for_status()
        for rep in range(repeats):
            results = {arm: [] for arm in arms}
            for i, request in enumerate(todo):
                turn = (i + rep + rotation) % len(arms)
                for arm in arms[turn:] + arms[:turn]:
                    extra = {} if arm == "estimator" else {"draft_length": int(arm[2:])}
                    results[arm].append(send(client, server.url, request, **extra))
                    bar.advance(task)
            for arm in arms:
                runs[arm].append(results[arm])

    render = chat_renderer(config.get("model"))
    texts = [render(r["messages"]) if r["api"] == "chat" else r["prompt"] for r in todo]
    frame = pd.DataFrame([dict(r, arm=arm, repeat=rep, request=i, temperature=todo[i]["temperature"],
                               top_p=todo[i].get("top_p", 1.0), text=texts[i])
                          for arm in arms for rep, results in enumerate(runs[arm]) for i, r in enumerate(results)])
    report = {"estimator": str(estimator_path), "workload": workload, "requests": len(todo), "repeats": repeats,
              "max_tokens": max_tokens, "rotation": rotation, "engine_config": config,
              **summarize(frame, doc, estimate)}
    (log_dir / "eval.json").write_text(json.dumps(report, indent=1) + "\n")
    frame.to_parquet(log_dir / "eval-requests.parquet", index=False)
    return report


def request_cells(frame: pd.DataFrame, doc: dict, estimate) -> dict[int, tuple[int, int, int]]:
    """request -> (temperature band, feature bucket, the estimator's k), from its estimator-arm row."""
    cells = {}
    for row in frame[frame["arm"] == "estimator"].drop_duplicates("request").itertuples():
        features = {"prompt_entropy": row.prompt_entropy or 0.0, "prompt_text": row.text,
                    "prompt_tokens": row.prompt_tokens, "prompt_chars": len(row.text),
                    "temperature": row.temperature, "top_p": getattr(row, "top_p", 1.0)}
        value = features[doc["feature"]] if doc["feature"] in features else TEXT_FEATURES[doc["feature"]](row.text)
        cells[row.request] = (int(np.searchsorted(doc["temperature_edges"], row.temperature, side="left")),
                              int(np.searchsorted(doc["thresholds"], value, side="right")), estimate(features))
    return cells


def summarize(frame: pd.DataFrame, doc: dict, estimate) -> dict:
    """The comparison from per-request rows (arm, repeat, request, temperature, text, usage, output, seconds),
    one run's or several runs' pooled (repeat then tells the runs apart)."""
    arms = list(dict.fromkeys(frame["arm"]))
    fixed = [arm for arm in arms if arm.startswith("k=") and arm != "k=0"]
    cells = request_cells(frame, doc, estimate)
    frame = frame.assign(k=[cells[q][2] if arm == "estimator" else int(arm[2:]) for arm, q in zip(frame["arm"], frame["request"])])
    step_cost = {int(k): v for k, v in (doc.get("step_cost") or {}).items()}

    def tok_s(rows):
        return rows["completion_tokens"].sum() / rows["seconds"].sum()

    def modelled(rows):  # tokens per plain-step time under the fitted cost model: free of machine noise
        if step_cost:  # steps that proposed (about draft_tokens / k) cost step_cost[k], the rest a plain step
            proposing = rows["spec_draft_tokens"] / rows["k"].clip(lower=1)
            cost = rows["spec_verify_steps"] - proposing + proposing * rows["k"].map(lambda k: step_cost.get(k, np.nan))
        else:
            cost = rows["spec_verify_steps"] + doc["c"] * rows["spec_draft_tokens"]
        return None if cost.isna().any() else float(rows["completion_tokens"].sum() / cost.sum())  # k not measured

    by_arm = {arm: frame[frame["arm"] == arm] for arm in arms}
    speed = {arm: tok_s(rows) for arm, rows in by_arm.items()}
    best = max(fixed, key=speed.get)
    requests = sorted(cells)
    per = {arm: rows.groupby("request")[["completion_tokens", "seconds"]].sum() for arm, rows in by_arm.items()}
    rng = np.random.default_rng(0)
    boot = []
    for _ in range(2000):
        idx = rng.choice(requests, len(requests))
        mine, theirs = per["estimator"].loc[idx].sum(), per[best].loc[idx].sum()
        boot.append(mine["completion_tokens"] / mine["seconds"] / (theirs["completion_tokens"] / theirs["seconds"]))
    boot.sort()
    pair = by_arm["estimator"].merge(by_arm[best], on=["repeat", "request"], suffixes=("", "_best"))
    paired = (pair["completion_tokens"] / pair["seconds"]) / (pair["completion_tokens_best"] / pair["seconds_best"])
    greedy = [q for q in requests if frame[(frame["request"] == q)]["temperature"].iloc[0] == 0]
    mine_out = by_arm["estimator"].set_index(["repeat", "request"])["output"]
    differ = {arm: sorted({int(q) for (rep, q), out in by_arm[arm].set_index(["repeat", "request"])["output"].items()
                           if q in greedy and out != mine_out[(rep, q)]}) for arm in arms[1:]}
    rows = []
    for cell in sorted({v[:2] for v in cells.values()}):
        idx = [q for q, v in cells.items() if v[:2] == cell]
        part = {arm: rows_[rows_["request"].isin(idx)] for arm, rows_ in by_arm.items()}
        mine, theirs = part["estimator"], part[best]
        mine_modelled, theirs_modelled = modelled(mine), modelled(theirs)
        rows.append({"band": cell[0], "bucket": cell[1], "requests": len(idx), "k": cells[idx[0]][2],
                     "alpha": alpha_mle(mine["spec_accepted_tokens"].sum(), mine["spec_rejections"].sum()),
                     "estimator_tok_s": tok_s(mine), f"{best}_tok_s": tok_s(theirs),
                     **({"k=0_tok_s": tok_s(part["k=0"])} if "k=0" in part else {}),
                     "ratio": tok_s(mine) / tok_s(theirs),
                     "paired_median": float(paired[pair["request"].isin(idx)].median()),
                     "modelled_ratio": mine_modelled / theirs_modelled if mine_modelled and theirs_modelled else None,
                     "best_fixed_here": max(fixed, key=lambda arm: tok_s(part[arm]))})
    return {"arms": arms, "tok_s": speed, "best_fixed": best, "gain": speed["estimator"] / speed[best] - 1,
            "gain_interval_90": [boot[int(0.05 * len(boot))] - 1, boot[int(0.95 * len(boot)) - 1] - 1],
            "paired_ratio_median": float(paired.median()),
            "tok_s_per_repeat": {arm: [tok_s(g) for _, g in rows_.groupby("repeat")] for arm, rows_ in by_arm.items()},
            "modelled_speed": {arm: modelled(rows_) for arm, rows_ in by_arm.items()},
            "estimator_k_counts": {str(k): n for k, n in sorted(Counter(v[2] for v in cells.values()).items())},
            "greedy_requests": len(greedy), "greedy_outputs_differ": differ[best],
            "greedy_outputs_differ_any_arm": differ, "buckets": rows}
