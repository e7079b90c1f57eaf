"""Per-request table and run summary from client-side timestamps, as public serving benchmarks define them.

- TTFT: send -> first chunk with text. E2E: send -> end of stream.
- ITL: gaps between content chunks after the first (vLLM's definition). Where the server reports each
  chunk's token count (usage on every chunk), a chunk of n tokens (speculative decoding emits several
  at once) counts as n gaps of gap/n, as sglang.bench_serving does; summary["itl_basis"] says which.
- TPOT = (E2E - TTFT) / (output tokens - 1); decode tok/s per request = its inverse.
- Output tok/s = output tokens of completed requests / wall time of the measured phase (vLLM, SGLang).
- Percentiles: numpy linear interpolation (as both tools); ITL percentiles over all gaps of all requests.
- Goodput: completed requests per second that meet every latency term of the SLO on their own values.
- output_tok_s_ci: the relative half-width of output tok/s's 90% interval, from the requests as a sample (the
  ratio estimate sum(tokens) / sum(e2e), delta method): what another as many requests could move it by.
"""
import math
from collections import Counter

import numpy as np
import pandas as pd

from .client import RequestRecord
from .metric_registry import STATS
from .slo import SLO

SPEC_FIELDS = ("spec_verify_steps", "spec_draft_tokens", "spec_accepted_tokens", "spec_rejections",
               "spec_draft_seconds", "spec_verify_seconds", "accept_length", "accept_rate", "prompt_entropy",
               "spec_verify_ct")


def request_itls(rec: RequestRecord) -> list[float]:
    itls = []
    for prev, now, n in zip(rec.chunk_times_s, rec.chunk_times_s[1:], rec.chunk_tokens[1:]):
        itls += [(now - prev) / n] * n
    return itls


def requests_frame(records: list[RequestRecord]) -> pd.DataFrame:
    rows = []
    for rec in sorted(records, key=lambda r: r.start_s):
        ok = rec.error_kind is None
        usage = rec.usage
        from_usage = isinstance(usage.get("completion_tokens"), int)
        out = usage["completion_tokens"] if from_usage else sum(rec.chunk_tokens)
        row = {"index": rec.index, "api": rec.api, "ok": ok, "error_kind": rec.error_kind, "error": rec.error,
               "http_status": rec.http_status, "finish_reason": rec.finish_reason, "start_s": rec.start_s,
               "prompt_tokens": usage.get("prompt_tokens"), "output_tokens": out,
               "tokens_from_usage": from_usage, "chunks": len(rec.chunk_times_s),
               "chunk_tokens_reported": rec.chunk_tokens_reported,
               "ttft_ms": ms(rec.ttft_s) if ok else None, "e2e_ms": ms(rec.e2e_s) if ok else None,
               "itl_ms": [ms(x) for x in request_itls(rec)] if ok else []}
        decode_s = (rec.e2e_s - rec.ttft_s) if ok else 0.0
        row["tpot_ms"] = ms(decode_s / (out - 1)) if ok and out > 1 else None
        row["decode_tok_s"] = (out - 1) / decode_s if ok and out > 1 and decode_s > 0 else None
        for key in SPEC_FIELDS:
            row[key] = usage.get(key)
        rows.append(row)
    columns = ["index", "api", "ok", "error_kind", "error", "http_status", "finish_reason", "start_s",
               "prompt_tokens", "output_tokens", "tokens_from_usage", "chunks", "chunk_tokens_reported",
               "ttft_ms", "e2e_ms", "itl_ms", "tpot_ms", "decode_tok_s", *SPEC_FIELDS]
    frame = pd.DataFrame(rows, columns=columns)
    for col in ("prompt_tokens", "ttft_ms", "e2e_ms", "tpot_ms", "decode_tok_s", *SPEC_FIELDS):
        frame[col] = pd.to_numeric(frame[col], errors="coerce").astype(float)
    return frame


def ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000.0


def stats(values, prefix: str) -> dict:
    values = np.asarray([v for v in values if v is not None and not math.isnan(v)], dtype=float)
    if values.size == 0:
        return {f"{prefix}_{s}": None for s in STATS}
    out = {f"{prefix}_p{q}": float(np.percentile(values, q)) for q in (50, 90, 95, 99)}
    out[f"{prefix}_mean"] = float(values.mean())
    return out


def stat_of(values: list[float], stat: str) -> float | None:
    if not values:
        return None
    return float(np.mean(values)) if stat == "mean" else float(np.percentile(values, int(stat[1:])))


def summarize(frame: pd.DataFrame, duration_s: float, slo: SLO | None = None) -> dict:
    ok = frame[frame["ok"].astype(bool)]  # boolean mask even when empty (an object column selects columns)
    duration_s = max(duration_s, 1e-9)
    completed, failed = len(ok), len(frame) - len(ok)
    summary = {"completed": completed, "failed": failed,
               "error_rate": failed / len(frame) if len(frame) else 0.0,
               "errors_by_kind": {k: v for k, v in Counter(frame["error_kind"].dropna()).items()},
               "duration_s": duration_s, "request_throughput": completed / duration_s,
               "total_output_tokens": int(ok["output_tokens"].sum()),
               "total_prompt_tokens": int(ok["prompt_tokens"].fillna(0).sum()),
               "output_tok_s": float(ok["output_tokens"].sum()) / duration_s,
               "input_tok_s": float(ok["prompt_tokens"].fillna(0).sum()) / duration_s,
               "output_tokens_mean": float(ok["output_tokens"].mean()) if completed else None,
               "prompt_tokens_mean": float(ok["prompt_tokens"].mean()) if ok["prompt_tokens"].notna().any() else None,
               "prompt_tokens_max": float(ok["prompt_tokens"].max()) if ok["prompt_tokens"].notna().any() else None}
    for col in ("ttft_ms", "tpot_ms", "e2e_ms", "decode_tok_s"):
        summary.update(stats(ok[col], col))
    summary.update(stats([x for itls in ok["itl_ms"] for x in itls], "itl_ms"))
    summary["itl_basis"] = "token" if completed and ok["chunk_tokens_reported"].all() else "chunk"
    summary.update(acceptance_from_usage(ok))
    entropy = ok["prompt_entropy"].dropna()
    summary["prompt_entropy_mean"] = float(entropy.mean()) if len(entropy) else None
    summary["goodput"] = goodput(ok, slo) / duration_s if slo is not None else None
    summary["output_tok_s_ci"] = throughput_ci(ok)
    return summary


def throughput_ci(ok: pd.DataFrame, z: float = 1.645) -> float | None:
    """Relative half-width of the 90% interval of the requests' pace sum(tokens) / sum(e2e): a closed loop's
    output tok/s is that pace times the streams, so this is its sampling noise (prompts that draft well or
    badly, a slow spell of the machine). None under 3 requests."""
    if len(ok) < 3:
        return None
    tokens, seconds = ok["output_tokens"].to_numpy(float), ok["e2e_ms"].to_numpy(float) / 1000.0
    if not tokens.sum() or not seconds.sum():
        return None
    pace = tokens.sum() / seconds.sum()
    se = np.std(tokens - pace * seconds, ddof=1) / math.sqrt(len(ok)) / seconds.mean()
    return float(z * se / pace)


def acceptance_from_usage(ok: pd.DataFrame) -> dict:
    """Accept length = tokens per verify step (accepted drafts + the target's own token), summed over requests.

    Embedded/vLLM-style counters: 1 + accepted/steps; SGLang meta_info: output tokens / spec_verify_ct.
    """
    steps = ok["spec_verify_steps"].sum()
    if steps > 0:
        drafted = ok["spec_draft_tokens"].sum()
        accepted = ok["spec_accepted_tokens"].sum()
        return {"accept_length": float(1 + accepted / steps), "accept_rate": float(accepted / drafted) if drafted else None,
                "accept_source": "usage"}
    verify_ct = ok["spec_verify_ct"].sum()
    if verify_ct > 0:
        return {"accept_length": float(ok["output_tokens"][ok["spec_verify_ct"].notna()].sum() / verify_ct),
                "accept_rate": None, "accept_source": "meta_info"}
    return {"accept_length": None, "accept_rate": None, "accept_source": None}


def goodput(ok: pd.DataFrame, slo: SLO) -> int:
    """Completed requests whose own TTFT/TPOT/E2E/ITL/decode speed meet the SLO's latency terms."""
    terms = slo.request_terms()
    good = 0
    for _, row in ok.iterrows():
        meets = True
        for column, stat, term in terms:
            value = stat_of(list(row["itl_ms"]), stat) if column == "itl_ms" else row[column]
            if value is not None and not (isinstance(value, float) and math.isnan(value)):
                meets = meets and term.holds(value)
        good += meets
    return good
