"""Draft length per request, fitted by `autotune estimator fit` (no dependencies: copy it anywhere).

    estimate_draft_length(prompt, temperature=0.0, top_p=1.0) -> k

prompt: the text the model is given (for chat requests, after the chat template).
Feature: compression_ratio of the prompt; k from its bucket in the temperature's band; c = 0.11077.
"""
import bisect
import zlib

TABLE = {"feature": "compression_ratio", "thresholds": [0.577482, 0.723126], "temperature_edges": [0.0, 0.5], "k_table": [[8, 8, 1], [8, 4, 1], [1, 1, 0]]}


def compression_ratio(text: str) -> float:
    """zlib-compressed size / raw size of the prompt: low for repetitive text, which drafts well."""
    raw = text.encode("utf-8")
    return len(zlib.compress(raw, 9)) / len(raw) if raw else 1.0


def table_k(table: dict, value: float, temperature: float) -> int:
    """k of a fitted table: the feature's bucket (thresholds) in the temperature's band."""
    band = bisect.bisect_left(table["temperature_edges"], temperature)
    return table["k_table"][band][bisect.bisect_right(table["thresholds"], value)]


def estimate_draft_length(prompt: str, temperature: float = 0.0, top_p: float = 1.0) -> int:
    return table_k(TABLE, compression_ratio(prompt), temperature)


def draft_length(features: dict) -> int:
    """The embedded engine's Python-estimator hook (`autotune serve --draft-estimator this.py`)."""
    return estimate_draft_length(features.get("prompt_text") or "", features["temperature"], features["top_p"])
