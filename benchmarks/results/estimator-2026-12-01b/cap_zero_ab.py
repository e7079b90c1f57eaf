"""Does a request the estimator gives cap 0 run what a `draft_length: 0` request runs? (issue 17)

One embedded server loaded with an estimator file (its engine_config, as bench_estimator.py's eval), the
held-out `mixed` requests; per request the two arms back to back, the order alternating (ABBA across
repeats). Per request: the usage counters (verify steps, draft tokens, draft/verify seconds), the /metrics
deltas around it, and wall seconds. Prints work identity and time ratios (pooled, paired median, bootstrap
90 % over requests); writes rows.json. Also times the estimator's own per-request decision in-process.

    python3 benchmarks/results/estimator-2026-12-01b/cap_zero_ab.py \
        --estimator benchmarks/results/estimator-2026-12-01/cpu/early_exit/estimator.json --limit 16 --repeats 2
"""
import argparse
import json
import re
import time
from pathlib import Path

import httpx
import numpy as np

from autotune.embedded.draft_policy import load_estimator
from autotune.estimator.live import chat_renderer, requests_of, send, serve

COUNTERS = ("autotune_spec_verify_steps_total", "autotune_spec_draft_tokens_total",
            "autotune_spec_draft_seconds_total", "autotune_spec_verify_seconds_total")


def scrape(client, url) -> dict:
    text = client.get(url + "/metrics").text
    return {name: float(re.search(rf"^{name} (\S+)$", text, re.MULTILINE).group(1)) for name in COUNTERS}


def decision_seconds(path: str, todo: list[dict], model) -> dict:
    """The estimator's per-request decision (features it reads + k + stop threshold), timed in-process."""
    estimate, render = load_estimator(path), chat_renderer(model)
    out = {}
    for i, r in enumerate(todo):
        text = render(r["messages"]) if r["api"] == "chat" else r["prompt"]
        features = {"prompt_entropy": 1.0, "prompt_tokens": len(text) // 4, "prompt_chars": len(text),
                    "temperature": r["temperature"], "top_p": r.get("top_p", 1.0), "prompt_text": text}
        t0 = time.perf_counter()
        for _ in range(20):
            estimate(features), estimate.stop_above and estimate.stop_above(features)
        out[i] = ((time.perf_counter() - t0) / 20, len(text))
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--estimator", required=True)
    parser.add_argument("--limit", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--out", default=str(Path(__file__).parent / "cap-zero-ab"))
    args = parser.parse_args()
    doc = json.loads(Path(args.estimator).read_text())
    config = dict(doc["engine_config"], draft_policy="fixed", draft_estimator=str(Path(args.estimator).resolve()))
    todo = requests_of(["mixed"], max_tokens=args.max_tokens)[: args.limit]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    arms = {"estimator": {}, "k=0": {"draft_length": 0}}
    rows = []
    with serve(config, out) as server, httpx.Client(timeout=300) as client:
        url = server.base_url
        client.post(url + "/admin/runtime", json={"draft_policy": "estimator"}).raise_for_status()
        for rep in range(args.repeats):
            for i, request in enumerate(todo):
                order = list(arms) if (i + rep) % 2 == 0 else list(arms)[::-1]
                for arm in order:
                    before = scrape(client, url)
                    row = send(client, url, request, **arms[arm])
                    after = scrape(client, url)
                    rows.append(dict(row, arm=arm, repeat=rep, request=i, first=arm == order[0],
                                     metrics={k: after[k] - before[k] for k in COUNTERS}))
    decisions = decision_seconds(args.estimator, todo, doc["engine_config"].get("model"))
    (out / "rows.json").write_text(json.dumps({"rows": rows, "decision_seconds": decisions}, indent=1) + "\n")
    report(rows, decisions)


def report(rows, decisions):
    key = lambda r: (r["repeat"], r["request"])
    est = {key(r): r for r in rows if r["arm"] == "estimator"}
    zero = {key(r): r for r in rows if r["arm"] == "k=0"}
    same_work = all(est[q][f] == zero[q][f] for q in est for f in ("spec_verify_steps", "spec_draft_tokens",
                                                                    "completion_tokens", "output"))
    same_metrics = all(est[q]["metrics"][c] == zero[q]["metrics"][c] for q in est
                       for c in ("autotune_spec_verify_steps_total", "autotune_spec_draft_tokens_total"))
    print(f"pairs {len(est)}; identical steps, draft tokens, completion tokens and text in every pair: {same_work}; "
          f"/metrics step and draft-token deltas identical: {same_metrics}")
    print("estimator arm draft tokens:", sum(r["spec_draft_tokens"] for r in est.values()),
          "k=0 arm draft tokens:", sum(r["spec_draft_tokens"] for r in zero.values()))
    qs = sorted(est)
    for r in rows:  # prefill, HTTP and the per-request decision: what the engine's step timers leave out
        r["rest_seconds"] = r["seconds"] - r["spec_verify_seconds"] - r["spec_draft_seconds"]
    for field in ("seconds", "spec_verify_seconds", "spec_draft_seconds", "rest_seconds"):
        a = np.array([est[q][field] for q in qs])
        b = np.array([zero[q][field] for q in qs])
        draws = np.random.default_rng(0).integers(0, len(qs), size=(2000, len(qs)))
        boot = np.sort(a[draws].sum(1) / b[draws].sum(1))
        print(f"{field}: estimator / k=0 pooled {a.sum() / b.sum():.3f} (90 % bootstrap {boot[100]:.3f}.."
              f"{boot[1899]:.3f}), paired median {np.median(a / b):.3f}; totals {a.sum():.2f} s vs {b.sum():.2f} s")
    first = [r["seconds"] / (est if r["arm"] == "k=0" else zero)[key(r)]["seconds"] for r in rows if r["first"]]
    print(f"whichever arm ran first / the other, paired median: {np.median(first):.3f} (order effect)")
    per = [s for s, _ in decisions.values()]
    longest = max(decisions.values(), key=lambda v: v[1])
    print(f"estimator decision per request: median {np.median(per) * 1e3:.3f} ms, max {max(per) * 1e3:.3f} ms "
          f"(longest prompt {longest[1]} chars: {longest[0] * 1e3:.3f} ms)")


if __name__ == "__main__":
    main()
