"""The draft-length estimator: fit on synthetic acceptance with known alpha, the standalone module, the
engine applying a produced estimator.json per request, one-line errors; the runtime stop rule fitted on
synthetic traces with a known cut, exported, and applied by a live engine."""
import importlib.util
import json
import math
import random
import subprocess
import sys

import httpx
import numpy as np
import pandas as pd
import pytest

from autotune.embedded.draft_policy import load_estimator
from autotune.estimator import best_k, fit, fit_from_study
from autotune.estimator.collect import study_rows

C = 0.1
# Prompts far apart on both model-free features: a loop, plain prose, text without a repeated word.
PROMPTS = ["1 2 3 4 5 " * 40, "The quick brown fox jumps over the lazy dog while the cat sleeps. " * 2,
           "Explain tide pools to a curious twelve-year-old, with three creatures found there."]
TEMPERATURES = (0.0, 0.3, 0.9)  # one per band
ALPHA = {(0, 0): 0.9, (0, 1): 0.6, (0, 2): 0.3, (1, 0): 0.8, (1, 1): 0.5, (1, 2): 0.2,
         (2, 0): 0.7, (2, 1): 0.4, (2, 2): 0.15}  # (band, bucket) -> true per-token acceptance


def synthetic_rows(seed=0, requests=20, steps=100, k=6, alphas=None) -> pd.DataFrame:
    """Verify steps simulated as the engine runs them: proposals accepted with prob alpha, stop at the first rejection."""
    rng = np.random.default_rng(seed)
    rows = []
    for (band, bucket), alpha in (alphas or ALPHA).items():
        for r in range(requests):
            accepts = [next((n for n in range(k) if rng.random() >= alpha), k) for _ in range(steps)]
            rows.append({"text": PROMPTS[bucket] + " " * r, "temperature": TEMPERATURES[band], "top_p": 1.0,
                         "spec_verify_steps": steps, "spec_draft_tokens": steps * k, "k": k,
                         "spec_accepted_tokens": sum(accepts), "spec_rejections": sum(a < k for a in accepts)})
    return pd.DataFrame(rows)


@pytest.fixture(scope="module")
def fitted():
    return fit(synthetic_rows(), c=C, max_k=8)


def test_fit_recovers_alpha_and_optimal_k(fitted):
    assert fitted.primary.feature in ("compression_ratio", "unigram_entropy")  # no engine entropy in the data
    assert len(fitted.primary.thresholds) == 2
    for cell in fitted.primary.buckets:
        true = ALPHA[(cell["band"], cell["bucket"])]
        assert cell["alpha_from"] == "cell" and abs(cell["alpha"] - true) < 0.03, cell
        assert cell["k"] == best_k(true, C, 8), cell
    assert {cell["k"] for cell in fitted.primary.buckets} >= {1, 4, 8}  # the table really varies
    # accepted / proposed is biased low (proposals after a rejection are never tested): not what the fit uses
    rows = synthetic_rows()
    top = rows[(rows["temperature"] == 0.0) & rows["text"].str.startswith("1 2")]
    assert top["spec_accepted_tokens"].sum() / top["spec_draft_tokens"].sum() < ALPHA[(0, 0)] - 0.1
    # rows without rejection counts (a study's bench rows): estimated from accepts per step, still close
    moments = fit(rows.drop(columns=["spec_rejections"]), c=C, max_k=8)
    assert moments.info["rejections_from"].startswith("estimated")
    assert all(abs(cell["alpha"] - ALPHA[(cell["band"], cell["bucket"])]) < 0.05 for cell in moments.primary.buckets)


def test_standalone_module_and_engine_agree_with_the_fit(fitted, tmp_path):
    path = fitted.write(tmp_path)
    doc = json.loads(path.read_text())
    assert {"thresholds", "k_table", "buckets", "c", "feature_quality", "data", "fallback"} <= set(doc)
    spec = importlib.util.spec_from_file_location("standalone", tmp_path / "draft_length_estimator.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    imports = [line for line in (tmp_path / "draft_length_estimator.py").read_text().splitlines()
               if line.startswith(("import ", "from "))]
    assert all(line.split()[1] in ("bisect", "math", "re", "zlib") for line in imports), imports
    engine = load_estimator(str(path))
    words = "def return the of a 1 2 3 x = ( ) : print tide pools fox dog".split()
    seen = set()
    for i in range(300):
        rnd = random.Random(i)
        prompt = " ".join(rnd.choice(words) for _ in range(rnd.randint(1, 120)))
        temperature = rnd.choice([0.0, 0.1, 0.5, 0.7, 1.0])
        k = fitted.draft_length(prompt, temperature)
        assert module.estimate_draft_length(prompt, temperature) == k
        assert engine({"prompt_text": prompt, "temperature": temperature, "top_p": 1.0}) == k
        seen.add(k)
    assert len(seen) >= 3


def load_standalone(directory):
    spec = importlib.util.spec_from_file_location("standalone", directory / "draft_length_estimator.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_k0_where_no_draft_length_pays(tmp_path):
    """alpha <= c: no k >= 1 has an expected speedup above 1 (k = 0 has exactly 1), so that cell turns
    speculation off; the standalone module and the engine's reading of estimator.json say the same."""
    low = {**ALPHA, (2, 1): 0.07, (2, 2): 0.03}  # hot prose and hot free text: the n-grams rarely hold
    fitted = fit(synthetic_rows(alphas=low), c=C, max_k=8)
    cells = {(cell["band"], cell["bucket"]): cell for cell in fitted.primary.buckets}
    for key, cell in cells.items():
        assert cell["k"] == best_k(low[key], C, 8), cell
        assert (cell["k"] == 0) == (key in ((2, 1), (2, 2))), cell
    assert cells[(2, 2)]["expected_speedup"] == 1.0 and cells[(0, 0)]["k"] == 8
    fitted.write(tmp_path)
    module, engine = load_standalone(tmp_path), load_estimator(str(tmp_path / "estimator.json"))
    for prompt, temperature, k in ((PROMPTS[2], 0.9, 0), (PROMPTS[1], 1.0, 0), (PROMPTS[2], 0.3, cells[(1, 2)]["k"]),
                                   (PROMPTS[0], 0.0, 8)):
        assert fitted.draft_length(prompt, temperature) == k
        assert module.estimate_draft_length(prompt, temperature) == k
        assert engine({"prompt_text": prompt, "temperature": temperature, "top_p": 1.0}) == k


def timed_rows(costs: dict, base=0.05, plain_steps=60) -> pd.DataFrame:
    """synthetic_rows at each k of `costs` (0 = plain decode), with engine draft/verify seconds: a step proposing
    k tokens costs costs[k] plain steps of `base` seconds; each request also has plain_steps steps where the
    drafter found nothing (a plain step's cost)."""
    parts = []
    for k in costs:
        part = synthetic_rows(seed=k, requests=6, k=max(k, 1))
        if k == 0:
            part = part.assign(spec_draft_tokens=0, spec_accepted_tokens=0, spec_rejections=0)
        proposing = part["spec_verify_steps"] if k else 0
        parts.append(part.assign(k=k, spec_verify_steps=part["spec_verify_steps"] + plain_steps,
                                 spec_draft_seconds=0.0,
                                 spec_verify_seconds=base * (proposing * costs[k] + plain_steps + (0 if k else 100))))
    return pd.concat(parts, ignore_index=True)


def test_measured_step_costs_choose_k():
    """With k = 0 rows and several k, each k's step cost is measured (not 1 + k c): on CPU kernels a 2-token
    verify pass can cost 1.7 plain steps and a 5-token one less than a 3-token one. k follows those costs."""
    costs = {0: 1.0, 1: 1.7, 2: 2.1, 4: 1.6, 8: 2.0}
    fitted = fit(timed_rows(costs))
    assert fitted.info["speedup_model"].endswith("measured step_cost[k]")
    assert {int(k): v for k, v in fitted.info["step_cost"].items()} == pytest.approx(costs, abs=1e-3)
    linear = 0
    for cell in fitted.primary.buckets:
        assert abs(cell["alpha"] - ALPHA[(cell["band"], cell["bucket"])]) < 0.03, cell
        assert cell["k"] == best_k(cell["alpha"], fitted.c, 8, costs) and cell["k"] in costs, cell
        linear += cell["k"] != best_k(cell["alpha"], fitted.c, 8)
    assert linear >= 3  # the linear model would have chosen otherwise in several cells
    table = fitted.primary.k_table
    assert table[0][0] == 8 and table[0][2] == 0 and table[2][2] == 0  # alpha 0.9: long drafts; 0.3, 0.15: none


def eval_rows(seconds, requests=6, repeats=2) -> pd.DataFrame:
    """Per-request eval rows of 10 tokens each; seconds[arm](request, repeat) is that run's time."""
    return pd.DataFrame([{"arm": arm, "repeat": rep, "request": q, "temperature": (0.0, 0.9)[q % 2], "top_p": 1.0,
                          "text": PROMPTS[q % 3], "prompt_entropy": None, "prompt_tokens": 10, "completion_tokens": 10,
                          "seconds": sec(q, rep), "output": "x" if (arm, q) != ("k=1", 2) else "y",
                          "spec_verify_steps": 5, "spec_draft_tokens": 4, "spec_accepted_tokens": 2, "spec_rejections": 2}
                         for arm, sec in seconds.items() for rep in range(repeats) for q in range(requests)])


def test_eval_summary_pools_arms_and_k0_competes_as_a_fixed_arm(fitted, tmp_path):
    """The eval's comparison from per-request rows: arms pooled (tokens / seconds), the gain against the best
    fixed arm, greedy outputs compared. k = 0 (speculation off) is a fixed policy like any other: where it is
    the fastest it is the best fixed arm the estimator has to beat (it used to be a reference only)."""
    from autotune.estimator import summarize

    fitted.write(tmp_path)
    doc = json.loads((tmp_path / "estimator.json").read_text())
    estimate = load_estimator(str(tmp_path / "estimator.json"))
    per_request = {"estimator": 1.0, "k=1": 1.5, "k=4": 1.25, "k=0": 0.9}  # seconds per request, 10 tokens each
    rows = eval_rows({arm: (lambda q, rep, sec=sec: sec * (1 + 0.1 * rep)) for arm, sec in per_request.items()})
    out = summarize(rows, doc, estimate)
    assert out["best_fixed"] == "k=0" and out["tok_s"]["k=0"] > out["tok_s"]["k=4"]
    assert out["gain"] == pytest.approx(0.9 - 1) and out["paired_ratio_median"] == pytest.approx(0.9)
    assert out["gain_interval_90"] == pytest.approx([-0.1, -0.1]) and out["best_fixed_bootstrap_share"]["k=0"] == 1
    assert out["greedy_requests"] == 3 and out["greedy_outputs_differ_any_arm"]["k=1"] == [2]
    assert out["greedy_outputs_differ"] == [] and sum(r["requests"] for r in out["buckets"]) == 6
    assert all(r["ratio"] == pytest.approx(r["estimator_tok_s"] / r["k=0_tok_s"]) and r["best_fixed_here"] == "k=0"
               for r in out["buckets"])  # the per-bucket table (the CLI prints r[best + "_tok_s"]) against k = 0

    # Without the k = 0 arm the best fixed is k = 4 again. Step costs measured at k = 0, 1 and 8 only: no
    # modelled speed for k = 4 (nor ratios against it), not a crash.
    rows = rows[rows["arm"] != "k=0"]
    out = summarize(rows, doc, estimate)
    assert out["best_fixed"] == "k=4" and out["gain"] == pytest.approx(0.25)
    doc["step_cost"] = {"0": 1.0, "1": 1.3, "8": 2.0}
    out = summarize(rows, doc, estimate)
    assert out["modelled_speed"]["k=4"] is None and out["modelled_speed"]["k=1"] > 0
    assert all(r["modelled_ratio"] is None for r in out["buckets"])


def test_eval_bootstrap_chooses_the_best_fixed_arm_again_on_each_resample(fitted, tmp_path):
    """k = 4 takes exactly the estimator's time on every request; k = 1 is a little slower pooled but fast on
    half the requests. With k = 4 frozen as the best fixed arm every resample gives a ratio of exactly 1; chosen
    again per resample, k = 1 wins the resamples that drew more of its fast requests, so the interval of
    estimator / best fixed reaches below 1 -- the noise of choosing the arm on the same data."""
    from autotune.estimator import summarize

    fitted.write(tmp_path)
    doc = json.loads((tmp_path / "estimator.json").read_text())
    rows = eval_rows({"estimator": lambda q, rep: 1.0, "k=4": lambda q, rep: 1.0,
                      "k=1": lambda q, rep: (0.6, 1.5)[q % 2]}, requests=20, repeats=1)
    out = summarize(rows, doc, load_estimator(str(tmp_path / "estimator.json")))
    assert out["best_fixed"] == "k=4" and out["gain"] == pytest.approx(0)
    assert out["gain_interval_90_frozen_arm"] == pytest.approx([0, 0])
    low, high = out["gain_interval_90"]
    assert low < -0.03 and high == pytest.approx(0)  # wider than the frozen arm's, and only downwards
    assert 0.05 < out["best_fixed_bootstrap_share"]["k=1"] < 0.5 < out["best_fixed_bootstrap_share"]["k=4"]


@pytest.mark.slow
def test_engine_applies_the_estimator_per_request(tmp_path, start_embedded_server):
    fitted = fit(synthetic_rows(alphas={**ALPHA, (2, 2): 0.03}), c=C, max_k=8)  # hot free text: k = 0
    path = fitted.write(tmp_path)
    loop, prose = "1 2 3 4 5 " * 20, PROMPTS[2]
    assert [fitted.draft_length(p, t) for p, t in ((loop, 0.0), (prose, 0.3), (prose, 0.9))] == [8, 1, 0]
    server = start_embedded_server(drafter="ngram", draft_policy="estimator", draft_estimator=str(path),
                                   max_seq_len=512)

    def complete(prompt, temperature, **extra):
        body = {"prompt": prompt, "max_tokens": 24, "temperature": temperature, "seed": 1, "ignore_eos": True}
        return httpx.post(server.url + "/v1/completions", json=body | extra, timeout=120).json()

    loop_usage, prose_usage, plain = (complete(p, t)["usage"] for p, t in ((loop, 0.0), (prose, 0.3), (prose, 0.9)))
    assert loop_usage["spec_draft_tokens"] > 3 * loop_usage["spec_verify_steps"]  # k = 8 on a loop the n-grams match
    assert 0 < prose_usage["spec_draft_tokens"] <= prose_usage["spec_verify_steps"]  # k = 1
    assert {"spec_rejections", "spec_draft_seconds", "spec_verify_seconds"} <= set(loop_usage)
    # k = 0: plain decode for that request (no proposals, one target pass per token)
    assert plain["spec_draft_tokens"] == 0 and plain["spec_verify_steps"] == plain["completion_tokens"], plain
    # and never a different greedy output
    texts = {k: complete(loop[:60] + prose, 0.0, draft_length=k)["choices"][0]["text"] for k in (0, 8)}
    assert texts[0] == texts[8], texts


@pytest.mark.slow
def test_study_rows_and_bad_input(tmp_path):
    with pytest.raises(ValueError, match="no request data"):
        fit(pd.DataFrame())
    no_speculation = synthetic_rows(requests=1).assign(spec_verify_steps=0)
    with pytest.raises(ValueError, match="too little speculation"):
        fit(no_speculation, c=C)
    with pytest.raises(ValueError, match="draft/verify times"):
        fit(synthetic_rows(requests=2))  # no c given and no times to measure it from
    with pytest.raises(ValueError, match="no per-request data"):
        fit_from_study(tmp_path)

    # a study's per-request parquet (the tuner's layout): fitted, with rejections and c from the rows
    rows = synthetic_rows(requests=4).rename(columns={"text": "prompt"}).assign(
        api="completions", ok=True, config=json.dumps({"drafter": "ngram", "draft_length": 6}),
        spec_draft_seconds=lambda f: f["spec_draft_tokens"] * 1e-4, spec_verify_seconds=lambda f: f["spec_verify_steps"] * 0.02)
    (tmp_path / "requests").mkdir()
    rows.drop(columns=["k"]).to_parquet(tmp_path / "requests" / "trial-0.parquet")
    doc = json.loads(fit_from_study(tmp_path).read_text())
    assert doc["engine_config"] == {"drafter": "ngram", "draft_length": 6} and doc["requests"] == len(rows)
    assert doc["c"] == pytest.approx(1e-4 / 0.02, rel=1e-3) and doc["max_k"] == 6

    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({**doc, "k_table": [[1, 2]]}))
    with pytest.raises(ValueError, match="one row per temperature band"):
        load_estimator(str(bad))
    cli = [sys.executable, "-m", "autotune.cli", "estimator"]
    for argv in (["fit", str(tmp_path / "nowhere"), "--no-collect"], ["eval", "--estimator", str(bad)]):
        done = subprocess.run(cli + argv, capture_output=True, text=True, timeout=60)
        assert done.returncode == 2 and done.stderr.startswith("error: ") and len(done.stderr.splitlines()) == 1, done


def test_an_engine_without_step_times_at_one_k_takes_its_cost_from_the_nearest_plain_trial(tmp_path):
    """llama-server reports drafts and accepts but no draft/verify seconds, and a study may run its drafter at one
    k: the step's cost is then only learnable against plain steps. The plain trial sharing the most knobs is the
    k = 0 anchor (not one with other threads, whose steps cost another amount); client decode seconds per step
    regressed on k give back the c they were made with."""
    c, base = 0.05, 0.02
    spec = synthetic_rows(requests=4).rename(columns={"text": "prompt"})
    spec = spec.assign(config=json.dumps({"spec_type": "ngram-simple", "threads": 4, "draft_length": 6}),
                       ttft_ms=50.0, e2e_ms=50.0 + spec["spec_verify_steps"] * base * (1 + c * 6) * 1000)
    plain = spec.assign(spec_draft_tokens=0, spec_accepted_tokens=0, spec_rejections=0,
                        config=json.dumps({"spec_type": "none", "threads": 4}),
                        e2e_ms=50.0 + spec["spec_verify_steps"] * base * 1000)
    other = plain.assign(config=json.dumps({"spec_type": "none", "threads": 1}), e2e_ms=plain["e2e_ms"] * 3)
    (tmp_path / "requests").mkdir()
    for n, part in enumerate((plain, spec, other)):
        part.drop(columns=["k", "spec_rejections"]).assign(api="completions", ok=True).to_parquet(
            tmp_path / "requests" / f"trial-{n}.parquet")
    rows, setup = study_rows(tmp_path)
    assert setup == {"spec_type": "ngram-simple", "threads": 4, "draft_length": 6}
    assert sorted(rows["k"].unique()) == [0, 6] and (rows["k"] == 0).sum() == len(plain)
    doc = json.loads(fit_from_study(tmp_path).read_text())
    assert doc["c"] == pytest.approx(c, rel=1e-3) and doc["c_from"].startswith("step seconds regressed on k")
    assert doc["engine_config"] == setup


@pytest.mark.slow
def test_metrics_text_of_the_embedded_server_gives_the_acceptance_of_its_usage(embedded_server):
    """The embedded /metrics (rendered by prometheus_client) parsed by bench.server_metrics (its parser) gives
    the accept length and rate the requests' own usage adds up to; the text stays one `name value` per sample."""
    from autotune.bench.server_metrics import acceptance, parse_prometheus

    def metrics_text():
        return httpx.get(embedded_server + "/metrics", timeout=10).text

    before = metrics_text()
    body = {"prompt": "1 2 3 4 5 " * 20, "max_tokens": 16, "temperature": 0.0, "ignore_eos": True}
    usages = [httpx.post(embedded_server + "/v1/completions", json=body | {"seed": i}, timeout=120).json()["usage"]
              for i in range(3)]
    after = metrics_text()
    steps, drafted, accepted = (sum(u[key] for u in usages) for key in
                                ("spec_verify_steps", "spec_draft_tokens", "spec_accepted_tokens"))
    got = acceptance(parse_prometheus(before), parse_prometheus(after))
    assert got["server_metrics_source"] == "embedded" and accepted > 0
    assert got["server_accept_length"] == pytest.approx(1 + accepted / steps, rel=1e-9)
    assert got["server_accept_rate"] == pytest.approx(accepted / drafted, rel=1e-9)
    # unlabelled samples stay one `name value` a line (labelled ones, e.g. per-path HTTP counts, the parser sums)
    plain = {name: float(value) for name, value in
             (line.split() for line in after.splitlines() if line and not line.startswith("#") and "{" not in line)}
    assert plain.items() <= parse_prometheus(after).items() and "autotune_spec_accept_length" in plain


# -- the runtime stop rule (issue 17) ----------------------------------------------------------------------
PLAIN_S, DRAFT_PASS, VERIFY_STEP = 0.05, 0.3, 0.1  # seconds of a plain step; a draft pass and each verify token
CUT = 2.0  # synthetic truth: a proposal is accepted iff its draft entropy is below CUT


def traced_rows(ks=(0, 1, 2, 3, 4, 5, 6), steps=40, seed=0) -> pd.DataFrame:
    """A collection pass as collect() records it: each prompt x temperature at every k, every step traced;
    entropies uniform on 0..4 (top-1 probabilities unrelated noise), accepted while below CUT; a draft pass
    costs DRAFT_PASS plain steps and a verify pass w tokens wide 1 + VERIFY_STEP (w - 1)."""
    rng = np.random.default_rng(seed)
    rows = []
    for prompt in PROMPTS:
        for temperature in TEMPERATURES:
            for k in ks:
                trace = []
                for _ in range(steps if k else 0):
                    entropy = rng.uniform(0, 4, k).round(4)
                    accepted = next((j for j in range(k) if entropy[j] >= CUT), k)
                    trace.append([entropy.tolist(), rng.uniform(0, 1, k).round(4).tolist(), accepted])
                accepted = sum(t[2] for t in trace)
                rows.append({"text": prompt, "temperature": temperature, "top_p": 1.0, "k": k,
                             "spec_verify_steps": steps, "spec_draft_tokens": steps * k, "spec_accepted_tokens": accepted,
                             "spec_rejections": sum(t[2] < k for t in trace), "spec_draft_trace": json.dumps(trace),
                             "spec_draft_seconds": steps * k * DRAFT_PASS * PLAIN_S,
                             "spec_verify_seconds": steps * (1 + VERIFY_STEP * k) * PLAIN_S})
    return pd.DataFrame(rows)


@pytest.fixture(scope="module")
def stop_fitted():
    return fit(traced_rows())


def test_stop_rule_fit_finds_the_cut_and_pays_over_every_fixed_k(stop_fitted):
    from autotune.estimator.stop import replay, step_arrays

    rule, costs = stop_fitted.info["stop_rule"], stop_fitted.info["width_costs"]
    assert costs["draft"] == pytest.approx(DRAFT_PASS, rel=1e-3)  # measured from the rows, not assumed
    assert all(costs["verify"][str(w)] == pytest.approx(1 + VERIFY_STEP * (w - 1), rel=1e-3) for w in range(1, 8))
    assert rule["signal"] == "entropy"  # the top-1 probabilities carry no information here
    assert rule["auc"]["entropy"] > 0.99 and 0.4 < rule["auc"]["doubt"] < 0.6
    assert all(CUT - 0.45 <= t <= CUT + 0.05 for t in rule["thresholds"]), rule["thresholds"]
    # with a perfect stop, a cap past the usual run of accepts changes little: long caps, never none
    assert all(k >= 3 for row in stop_fitted.primary.k_table for k in row) and min(rule["caps"]) >= 3
    curve = rule["curve"]["entropy"]
    assert curve[0]["accept"] == 1.0 and curve[-1]["accept"] == 0.0  # acceptance falls with entropy
    # replayed on the same steps, the rule beats the best fixed k (no stop): +9 % with these costs
    rows = traced_rows().reset_index(drop=True)
    risk, proposed, accepted, request = step_arrays(rows, "entropy", 6)
    cost_table = {"verify": {int(w): c for w, c in costs["verify"].items()}, "draft": costs["draft"]}
    six = rows["k"].to_numpy()[request] == 6
    speed = {k: np.divide(*replay(risk[six], proposed[six], accepted[six], math.inf, k, cost_table)) for k in range(7)}
    ruled = np.divide(*replay(risk[six], proposed[six], accepted[six], rule["thresholds"][0], 6, cost_table))
    assert ruled > 1.05 * max(speed.values()), (ruled, speed)
    assert rule["expected_speedup"][0] == pytest.approx(ruled, rel=0.05)


def test_stop_rule_is_exported_to_the_module_the_engine_and_the_deployed_engines(stop_fitted, tmp_path):
    from autotune.engines.llamacpp import LlamaCppAdapter

    path = stop_fitted.write(tmp_path)
    doc, module, engine = json.loads(path.read_text()), load_standalone(tmp_path), load_estimator(str(path))
    assert module.STOP_SIGNAL == engine.signal == doc["stop_rule"]["signal"] == "entropy"
    for temperature, band in ((0.0, 0), (0.3, 1), (0.9, 2), (1.0, 2)):
        features = {"temperature": temperature, "top_p": 1.0, "prompt_text": PROMPTS[1]}
        assert module.stop_above(features) == engine.stop_above(features) == doc["stop_rule"]["thresholds"][band]
        assert module.draft_length(features) == engine(features) == stop_fitted.draft_length(PROMPTS[1], temperature)
    settings = doc["engine_settings"]
    doubt = doc["stop_rule"]["alternatives"]["doubt"]["thresholds"][0]
    llama = settings["llamacpp"]["settings"]
    cap = max(k for row in doc["k_table"] + doc["fallback"]["k_table"] for k in row)
    assert llama == {"spec_draft_n_max": cap, "spec_draft_n_min": 0,
                     "spec_draft_p_min": 0.0 if doubt is None else round(1 - doubt, 4)}
    adapter = LlamaCppAdapter()
    config = {"spec_type": "draft-simple", **llama}
    assert adapter.check(config, has_draft_model=True) == []
    assert "is a probability" in adapter.check({**config, "spec_draft_p_min": 1.5}, has_draft_model=True)[0]
    argv, _ = adapter.command(config, model="m.gguf", draft_model="d.gguf", host="127.0.0.1", port=8080)
    assert adapter.validate_flags(argv) == [] and "--spec-draft-p-min" in argv
    assert settings["sglang"]["settings"] == {"speculative_num_steps": cap, "speculative_num_draft_tokens": cap + 1,
                                              "speculative_eagle_topk": 1}
    assert settings["vllm"]["settings"] == {"num_speculative_tokens": cap}
    assert all("stop rule" in settings[e]["not_applied"] for e in ("sglang", "vllm"))


@pytest.mark.slow
def test_engine_stops_drafting_above_the_threshold_and_greedy_output_is_unchanged(tmp_path, start_embedded_server):
    """quantized_self with a stop rule at entropy 1.0: over HTTP, every proposal the rule lets through has a
    draft entropy at or below 1.0 and some steps stop before the cap, while the same request with the rule off
    (draft_length given) proposes above it; the greedy text is the same with the rule on, off, and at k = 0."""
    threshold, cap = 1.0, 6
    estimator = tmp_path / "estimator.json"
    estimator.write_text(json.dumps({"feature": "prompt_tokens", "thresholds": [], "temperature_edges": [],
                                     "k_table": [[cap]], "stop_rule": {"signal": "entropy", "temperature_edges": [],
                                                                       "thresholds": [threshold]}}))
    server = start_embedded_server(drafter="quantized_self", draft_policy="estimator", draft_estimator=str(estimator),
                                   max_seq_len=512, threads=1)

    def complete(**extra):
        body = {"prompt": "def fizzbuzz(n):\n    for i in range(1, n + 1):\n", "max_tokens": 40,
                "temperature": 0.0, "ignore_eos": True, "draft_trace": True}
        return httpx.post(server.url + "/v1/completions", json=body | extra, timeout=300).json()

    on, off, plain = complete(), complete(draft_length=cap), complete(draft_length=0)
    ruled, free = on["usage"]["spec_draft_trace"], off["usage"]["spec_draft_trace"]
    assert all(e <= threshold for entropies, _, _ in ruled for e in entropies)
    assert any(len(entropies) < cap for entropies, _, _ in ruled[:-2])  # stopped early (the last steps near max_tokens)
    assert all(len(entropies) == cap for entropies, _, _ in free[:-2])
    assert any(e > threshold for entropies, _, _ in free for e in entropies)
    assert on["usage"]["spec_draft_tokens"] < off["usage"]["spec_draft_tokens"]
    assert on["choices"][0]["text"] == off["choices"][0]["text"] == plain["choices"][0]["text"]
    assert "spec_draft_trace" not in complete(draft_trace=False)["usage"]


def test_report_draws_the_acceptance_curve_with_the_chosen_thresholds(stop_fitted, tmp_path):
    from types import SimpleNamespace

    from autotune.report import fig_stop_rule

    assert "no stop rule" in fig_stop_rule(SimpleNamespace(directory=tmp_path))
    doc = json.loads(stop_fitted.write(tmp_path).read_text())
    fig = fig_stop_rule(SimpleNamespace(directory=tmp_path))
    curve = doc["stop_rule"]["curve"]["entropy"]
    assert list(fig.data[0].y) == [c["accept"] for c in curve]
    lines = sorted(shape.x0 for shape in fig.layout.shapes)
    assert lines == sorted(t for t in doc["stop_rule"]["thresholds"] if t is not None)
    assert "AUC" in fig.layout.title.text


@pytest.mark.slow
def test_llama_server_applies_the_exported_cut_off(stop_fitted, tmp_path):
    """The llama.cpp settings estimator.json exports run on the real llama-server: with the bundled GGUF drafting
    for itself (draft-simple), its greedy confidence cut-off (spec_draft_p_min) drafts fewer tokens than no
    cut-off at the same n_max, and the text is the same."""
    from autotune.embedded.bundled import bundled_gguf_path
    from autotune.engines.launcher import launch
    from autotune.engines.llamacpp import LlamaCppAdapter, binary_version, find_binary

    if not find_binary() or binary_version(find_binary()) is None:
        pytest.skip("llama-server is not built here (bash setup.sh llamacpp)")
    settings = json.loads(stop_fitted.write(tmp_path).read_text())["engine_settings"]["llamacpp"]["settings"]
    model = str(bundled_gguf_path())
    drafted, texts = {}, {}
    for p_min in (0.0, 0.95):
        config = {"spec_type": "draft-simple", **settings, "spec_draft_n_max": 8, "spec_draft_p_min": p_min,
                  "threads": 1, "parallel": 1, "ctx_size": 1024}
        with launch(LlamaCppAdapter(), config, model=model, draft_model=model, log_path=tmp_path / f"{p_min}.log",
                    timeout_s=180) as server:
            body = {"prompt": "def fizzbuzz(n):\n    for i in range(1, n + 1):\n", "n_predict": 48,
                    "temperature": 0.0, "ignore_eos": True}
            doc = httpx.post(server.base_url + "/completion", json=body, timeout=300).json()
        drafted[p_min], texts[p_min] = doc["timings"]["draft_n"], doc["content"]
    assert 0 < drafted[0.95] < drafted[0.0], drafted
    assert texts[0.95] == texts[0.0]


RECORDED = ["estimator-2026-12-01/cpu/early_exit", "estimator-2026-12-01/cpu/quantized_self",
            "estimator-2026-12-02/selection/draft-h200-clean"]  # collection passes of three drafters (issue 17)


@pytest.mark.parametrize("folder", RECORDED)
def test_oracle_stop_bounds_every_policy_on_recorded_steps(folder):
    """On a recorded collection pass's steps at its largest k, under its measured costs, the oracle stop is no
    slower than every fixed k (k = 0 included: where drafting does not pay even when right, it must not draft)
    and than the best (threshold, cap) policy; on the steps that proposed k tokens, all of them taken as
    accepted, it is the best fixed k; and on synthetic steps with linear costs, where drafting the whole
    accepted run always pays, it is that run's speed exactly: n draft passes (none on a token it does not
    propose) and a verify n + 1 wide."""
    from pathlib import Path

    from autotune.estimator.stop import best_policy, candidate_thresholds, oracle_replay, replay, step_arrays

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / folder
    rows, doc = pd.read_parquet(path / "estimator-data.parquet"), json.loads((path / "estimator.json").read_text())
    costs = {"verify": {int(w): c for w, c in doc["width_costs"]["verify"].items()}, "draft": doc["width_costs"]["draft"]}
    cap = int(rows["k"].max())
    risk, proposed, accepted, _ = step_arrays(rows[rows["k"] == cap].reset_index(drop=True), "entropy", cap)
    fixed = [np.divide(*replay(risk, proposed, accepted, math.inf, k, costs)) for k in range(cap + 1)]
    full = proposed == cap  # steps of one length, all accepted: the same length is best for every one of them
    all_accepted = [np.divide(*replay(risk[full], proposed[full], proposed[full], math.inf, k, costs))
                    for k in range(cap + 1)]
    oracle = np.divide(*oracle_replay(proposed, accepted, cap, costs))
    policy = best_policy({c: (risk, proposed, accepted) for c in range(cap + 1)}, costs, candidate_thresholds(risk),
                         list(range(cap + 1)))[2]
    assert oracle >= max(fixed) * (1 - 1e-12) and oracle >= policy * (1 - 1e-12), (oracle, fixed, policy)
    assert np.divide(*oracle_replay(proposed, accepted, cap, costs, prefix_only=True)) <= oracle * (1 + 1e-12)
    assert np.divide(*oracle_replay(proposed[full], proposed[full], cap, costs)) == pytest.approx(max(all_accepted),
                                                                                                 rel=1e-12)

    synthetic = traced_rows(ks=(0, 6), steps=10)
    linear = {"verify": {w: 1 + VERIFY_STEP * (w - 1) for w in range(1, 8)}, "draft": DRAFT_PASS}
    _, proposed, accepted, _ = step_arrays(synthetic[synthetic["k"] == 6].reset_index(drop=True), "entropy", 6)
    assert oracle_replay(proposed, accepted, 6, linear) == pytest.approx(
        ((accepted + 1).sum(), (1 + (DRAFT_PASS + VERIFY_STEP) * accepted).sum()), rel=1e-12)
