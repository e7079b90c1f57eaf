"""The lines `autotune run` ends on (pipeline.closing_lines), from real validation records of the H200 runs."""
import json
from pathlib import Path

from autotune import pipeline
from autotune.validate.record import Validation

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "h200-2026-12-01c"
SGLANG = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "h200-2026-12-05" / "sglang"


def closing(doc: Validation, tmp_path) -> str:
    return "\n".join(pipeline.closing_lines({"validation": doc, "problems": []}, tmp_path, "sqlite:///s.db"))


def test_a_winner_that_is_the_engine_defaults_claims_no_gain_over_them(tmp_path):
    doc = Validation.model_validate(json.loads((RESULTS / "validation-c4.json").read_text()))
    assert doc.winner.config == doc.baseline.config
    # the defaults measured twice (as the baseline and as their own trial, with more repeats) differ by noise alone
    doc.winner.gain_over_baseline = 0.83
    text = closing(doc, tmp_path)
    assert f"exported: trial {doc.winner.trial} (the engine defaults)" in text
    assert "x the engine defaults" not in text
    assert doc.winner_changes() == []  # `autotune show` reads the same record, so says no gain either


def test_a_winner_that_changes_settings_states_its_gain_over_the_defaults(tmp_path):
    doc = Validation.model_validate(json.loads((RESULTS / "validation-c8.json").read_text()))
    doc.winner.config = {**doc.baseline.config, "drafter": "ngram"}
    doc.winner.gain_over_baseline = 1.71
    text = closing(doc, tmp_path)
    assert f"exported: trial {doc.winner.trial} (drafter=ngram)" in text and "1.71x the engine defaults" in text


def test_sglangs_none_and_an_unset_flag_are_the_same_defaults(tmp_path):
    """The H200's SGLang run: its winner, the defaults trial, says speculative_algorithm "none" (the space's word
    for the flag left out) where the baseline says null; it claimed '1.00x the engine defaults' as a gain."""
    doc = Validation.model_validate(json.loads((SGLANG / "validation-c1.json").read_text()))
    assert doc.winner.config["speculative_algorithm"] == "none" and doc.baseline.config["speculative_algorithm"] is None
    assert doc.winner_changes() == []
    text = closing(doc, tmp_path)
    assert f"exported: trial {doc.winner.trial} (the engine defaults)" in text and "x the engine defaults" not in text
    doc.winner.config = {**doc.winner.config, "speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": 12}
    assert doc.winner_changes() == ["speculative_algorithm=NGRAM", "speculative_num_draft_tokens=12"]
