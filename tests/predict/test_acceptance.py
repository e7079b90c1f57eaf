"""Acceptance by drafter family, fitted to published acceptance lengths (autotune/predict/acceptance.py)."""
import statistics

import pytest

from autotune.engines import get_adapter
from autotune.hardware import get_profile
from autotune.predict import Calibration, load_model, predict_speed, rank_configs
from autotune.predict.acceptance import (
    Acceptance,
    alpha_from_accept_length,
    drafter_acceptance,
    expected_tokens,
    prior,
    published,
    scaled_to,
    sibling_exponent,
    tokens_per_step,
)
from autotune.space import load_space

SGLANG, VLLM = get_adapter("sglang"), get_adapter("vllm")
H100 = get_profile("h100-sxm5")


def sglang(algo: str, steps: int, topk: int, tokens: int, tp: int = 1) -> dict:
    return {"tp_size": tp, "speculative_algorithm": algo, "speculative_num_steps": steps,
            "speculative_eagle_topk": topk, "speculative_num_draft_tokens": tokens}


def predicted_tau(row) -> float:
    return tokens_per_step(prior(row.family, row.mtp_layers), row.steps, row.topk, row.draft_tokens,
                           sibling_exponent())


def test_every_row_cites_its_source_and_setting():
    rows = published()
    assert {r.family for r in rows} >= {"eagle", "eagle3", "mtp", "dflash", "lookup", "draft"}
    for r in rows:
        assert r.source and r.model and r.benchmark, r
        assert r.steps >= 1 and r.topk >= 1 and r.draft_tokens >= 2 and 1 < r.tau <= r.draft_tokens, r
        assert r.topk > 1 or r.family == "dflash" or r.draft_tokens == r.steps + 1, r  # a chain verifies k + 1
        if r.per_position:  # the shares sum to the accepted drafts: tau - 1
            assert len(r.per_position) == r.draft_tokens - 1
            assert 1 + sum(r.per_position) == pytest.approx(r.tau, abs=0.02), r


def test_published_settings_are_reproduced():
    # One prior per family meets every chain that agrees with the others within about 10%; rows that disagree
    # with their family (DFlash drafters of other trainers or asked in another language, n-gram on chat against
    # code) are the spread the prior sits in. Sweeps are other draft heads: they fit only the tree (below).
    rows = [r for r in published() if not r.sweep]
    errors = [predicted_tau(r) / r.tau - 1 for r in rows if r.family != "lookup" and r.topk == 1]
    # (0.11 over the 16 chains; the median was under 0.10 only with the EAGLE-3 paper's tree in, checked below)
    assert statistics.median(abs(e) for e in errors) < 0.12  # n-gram: bound to the workload, below
    # (EAGLE-3 on Qwen3-8B, a weaker drafter than the others, is 14% below the family's prior.)
    agreeing = [r for r in rows if r.topk == 1 and (r.family in ("eagle", "draft") or "Qwen/Qwen3-8B +" not in
                r.model and r.family == "eagle3" or "DeepSeek-V3 (1 MTP" in r.model or "Qwen3.6-27B" in r.model)]
    assert len(agreeing) >= 8
    for r in agreeing:
        assert predicted_tau(r) == pytest.approx(r.tau, rel=0.12), r
    for family in ("dflash", "lookup", "mtp", "eagle3"):
        taus = [(r.tau, predicted_tau(r)) for r in rows if r.family == family]
        assert min(p / t for t, p in taus) < 1 < max(p / t for t, p in taus), family


def test_sglang_trees_follow_the_chain_of_their_own_draft_head():
    # SpecForge #339: one Qwen3-30B-A3B head in SGLang at six settings. The alpha that reproduces its chain (1.86
    # at 3 drafts) gives every tree of the sweep within 10%: the same 4-token budget as a tree accepts more than
    # as a chain, and the 60-token tree 3.2, not the 4.9 of as many candidates on every level.
    sweep = [r for r in published() if r.sweep == "specforge-339"]
    chain = next(r for r in sweep if r.topk == 1)
    acc = scaled_to(chain.tau, SGLANG.knobs(sglang("EAGLE3", chain.steps, 1, chain.draft_tokens)), prior("eagle3"))
    tau = lambda r: tokens_per_step(acc, r.steps, r.topk, r.draft_tokens, sibling_exponent())
    for r in sweep:
        assert tau(r) == pytest.approx(r.tau, rel=0.10), r
    assert tau(next(r for r in sweep if (r.topk, r.draft_tokens) == (3, 4))) > chain.tau
    # The EAGLE authors' own 60-token tree, with the family's chain prior, within 20% (6.13: their repository's
    # implementation; SGLang's runs of the same kind of head accept less, AngelSlim #9).
    paper = next(r for r in published() if r.topk > 1 and not r.sweep)
    assert predicted_tau(paper) == pytest.approx(paper.tau, rel=0.20)


def test_a_reused_mtp_layer_decays_and_more_layers_keep_their_rate():
    one, three = prior("mtp", mtp_layers=1), prior("mtp", mtp_layers=3)
    assert one.decay < 1 and [one.rate(i) for i in (1, 2, 3)] == sorted([one.rate(i) for i in (1, 2, 3)], reverse=True)
    assert three.rate(3) == one.rate(1) > one.rate(3)
    chain = lambda acc, k: tokens_per_step(acc, k, 1, k + 1, sibling_exponent())
    # Diminishing returns: the last four drafts of eight add less than the second and third of four.
    assert chain(one, 8) - chain(one, 4) < chain(one, 4) - chain(one, 1)
    assert chain(three, 3) > chain(one, 3)
    # DeepSeek-V3's module: 85-90% at one draft, tau 3.20 at seven, far below a flat 0.875 (4.9).
    assert 1.85 < chain(one, 1) < 2.0 and chain(one, 7) < chain(Acceptance.flat(0.875), 7) - 1


def test_tree_siblings_help_less_and_less_and_never_past_the_candidates():
    acc, s = prior("eagle3"), sibling_exponent()
    assert 0 < s < 1  # fitted to the published trees: each extra sibling helps less than the one before
    e = {topk: tokens_per_step(acc, 5, topk, 64, s) for topk in (1, 2, 4, 8)}
    assert e[1] < e[2] < e[4] < e[8] <= 6
    level = {m: tokens_per_step(acc, 1, m, m + 1, s) - 1 for m in (1, 2, 4, 8)}  # one level's acceptance
    assert level[2] - level[1] > level[4] - level[2] > level[8] - level[4] > 0  # each doubling gains less
    assert tokens_per_step(Acceptance.flat(0.0), 8, 8, 64, s) == 1.0  # siblings of a drafter that never agrees
    # The verified tokens bound the tree: more candidates (topk, levels) never lose, 4 tokens accept at most 3
    # drafts and no fewer than the chain of 3, and a budget of 8 stays within 5% of the chain of 7.
    assert tokens_per_step(acc, 5, 3, 16, s) <= tokens_per_step(acc, 5, 8, 16, s) <= tokens_per_step(acc, 8, 8, 16, s)
    assert tokens_per_step(acc, 3, 1, 4, s) <= tokens_per_step(acc, 5, 4, 4, s) < 4
    assert tokens_per_step(acc, 8, 4, 8, s) == pytest.approx(tokens_per_step(acc, 7, 1, 8, s), rel=0.05)
    # The EAGLE authors' own 60-token tree (6.13, the best case published) bounds what a smaller tree gets.
    assert tokens_per_step(acc, 8, 4, 32, s) < 6.13


def test_extreme_shapes_no_longer_win_by_a_wide_margin():
    # The issue: a single MTP layer read as a flat 0.85 for 8 steps put steps 8 / topk 4 / 32 tokens on top,
    # 1.7x the engines' usual steps 3 / topk 1 / 4 tokens for a dense 27B on four RTX 3090s.
    qwen, rtx = load_model("qwen3.5-27b"), get_profile("rtx-3090")
    speed = lambda model, profile, n, cfg, **kw: predict_speed(model, cfg, profile, n, engine=SGLANG, **kw)
    usual, extreme = sglang("NEXTN", 3, 1, 4, tp=4), sglang("NEXTN", 8, 4, 32, tp=4)
    flat = speed(qwen, rtx, 4, extreme, alpha=0.85).single_tok_s / speed(qwen, rtx, 4, usual, alpha=0.85).single_tok_s
    now = speed(qwen, rtx, 4, extreme).single_tok_s / speed(qwen, rtx, 4, usual).single_tok_s
    # (1.36: SGLang's host time, once a step however many tokens it yields, leans a little towards longer steps)
    assert flat > 1.6 and now < 1.4
    # EAGLE-3 on Llama-3.1-8B (H100): the published tree does accept over twice the chain's tokens (6.13 at 60
    # tokens against 2.60 at three drafts), so the tree keeps an edge, smaller than that ratio.
    llama = load_model("llama-3.1-8b")
    chain, tree = speed(llama, H100, 1, sglang("EAGLE3", 3, 1, 4)), speed(llama, H100, 1, sglang("EAGLE3", 8, 4, 32))
    assert chain.tokens_per_step == pytest.approx(2.60, rel=0.05)
    assert 1 < tree.single_tok_s / chain.single_tok_s < tree.tokens_per_step / chain.tokens_per_step < 6.13 / 2.60


def test_the_ranking_does_not_put_the_deepest_mtp_shape_on_top():
    # The case ranked: a dense 27B with one MTP layer on four RTX 3090s, SGLang's space. Its best NEXTN
    # row drafts fewer levels than the space's deepest (a reused layer's later drafts are rarely accepted).
    space = load_space("sglang")
    best, _ = rank_configs(space, load_model("qwen3.5-27b"), get_profile("rtx-3090"), 4, top=1, engine=SGLANG)[0]
    assert best["speculative_algorithm"] == "NEXTN"
    assert best["speculative_num_steps"] < space.params["speculative_num_steps"].high == 8


def test_measured_accept_lengths_replace_the_prior_keeping_its_decay():
    # Trials that measured tau 2.0 at four MTP drafts: the calibrated model gives 2.0 there, and at eight
    # drafts less than the prior would and less than a flat rate fitted to the same 2.0 (the decay is kept).
    qwen = load_model("qwen3.5-27b")
    at = lambda k: {"tensor_parallel_size": 1, "speculative_method": "mtp", "num_speculative_tokens": k}
    trials = [{"config": at(4), "concurrency": 1, "decode_tok_s": rate, "accept_length": 2.0} for rate in (40.0, 42.0)]
    cal = Calibration.fit(trials, qwen, H100, engine=VLLM)
    shape = drafter_acceptance("mtp", qwen.mtp_layers)
    assert cal.alphas["mtp"] < shape.alpha_1
    tokens = lambda k, **kw: predict_speed(qwen, at(k), H100, 1, engine=VLLM, **kw).tokens_per_step
    assert tokens(4, calibration=cal) == pytest.approx(2.0, abs=1e-3)
    flat_alpha = alpha_from_accept_length(2.0, VLLM.knobs(at(4)))
    assert tokens(8, calibration=cal) < tokens(8)
    assert tokens(8, calibration=cal) < expected_tokens(flat_alpha, VLLM.knobs(at(8)))


def test_an_explicit_alpha_is_a_flat_rate():
    k = VLLM.knobs({"speculative_method": "eagle3", "num_speculative_tokens": 3})
    assert expected_tokens(0.8, k) == pytest.approx((1 - 0.8**4) / 0.2)
    assert expected_tokens(Acceptance(0.8, 0.5), k) == pytest.approx(1 + 0.8 + 0.8 * 0.4 + 0.8 * 0.4 * 0.2)
