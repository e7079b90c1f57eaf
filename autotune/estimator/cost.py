"""What a step costs, in plain (no-speculation) steps: c, the marginal cost of one more proposed token,
and, where the data allows, the measured cost of a step at each k.

  c     = from the engine's draft + verify seconds per step regressed on k (with several k in the
          data); with one k, draft seconds per proposed token over verify seconds per step.
  cost  = where the data holds k = 0 requests (plain decode) and several k (a collection pass): the
          measured seconds of a step proposing k over a plain step, per k (step_costs: verify cost is
          not linear in width on CPU kernels); otherwise 1 + k c.
"""
import numpy as np
import pandas as pd


def draft_cost(frame: pd.DataFrame) -> dict:
    """c from the engine's draft and verify seconds (see this module's docstring); without them (a study whose
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
