"""Draft length per request, fitted by `autotune estimator fit` (no dependencies: copy it anywhere).

    estimate_draft_length(prompt, temperature=0.0, top_p=1.0) -> k (the cap on a step's proposals)
    stop_above(features) -> the risk (STOP_SIGNAL of the draft token) above which drafting stops, or None

prompt: the text the model is given (for chat requests, after the chat template). Stop rule: a draft
token whose doubt ("entropy": of the draft's softmax, nats; "doubt": 1 - its top-1
probability) is above the threshold of the request's temperature band is not proposed, and drafting
stops (null: never stop).
Feature: compression_ratio of the prompt; k from its bucket in the temperature's band; c = 0.21641.
"""
import bisect
import zlib

TABLE = {"feature": "compression_ratio", "thresholds": [0.581152, 0.725472], "temperature_edges": [0.0, 0.5], "k_table": [[6, 6, 6], [4, 0, 6], [4, 1, 1]]}
STOP_RULE = {'signal': 'doubt', 'temperature_edges': [0.0, 0.5], 'thresholds': [0.7639, 0.79, 0.9307]}  # Python literals: a threshold of None never stops
STOP_SIGNAL = 'doubt'


def compression_ratio(text: str) -> float:
    """zlib-compressed size / raw size of the prompt: low for repetitive text, which drafts well."""
    raw = text.encode("utf-8")
    return len(zlib.compress(raw, 9)) / len(raw) if raw else 1.0


def table_k(table: dict, value: float, temperature: float) -> int:
    """k of a fitted table: the feature's bucket (thresholds) in the temperature's band."""
    band = bisect.bisect_left(table["temperature_edges"], temperature)
    return table["k_table"][band][bisect.bisect_right(table["thresholds"], value)]


def stop_threshold(rule: dict, temperature: float) -> float | None:
    """The stop rule's threshold for a temperature (None: never stop)."""
    return rule["thresholds"][bisect.bisect_left(rule["temperature_edges"], temperature)]


def estimate_draft_length(prompt: str, temperature: float = 0.0, top_p: float = 1.0) -> int:
    return table_k(TABLE, compression_ratio(prompt), temperature)


def draft_length(features: dict) -> int:
    """The embedded engine's Python-estimator hook (`autotune serve --draft-estimator this.py`)."""
    return estimate_draft_length(features.get("prompt_text") or "", features["temperature"], features["top_p"])


def stop_above(features: dict):
    """The embedded engine's stop-rule hook: the request's threshold, None = never stop."""
    return stop_threshold(STOP_RULE, features["temperature"]) if STOP_RULE else None
