"""Draft length per request, fitted by `autotune estimator fit` (no dependencies: copy it anywhere).

    estimate_draft_length(prompt, temperature=0.0, top_p=1.0) -> k (the cap on a step's proposals)
    stop_above(features) -> the risk (STOP_SIGNAL of the draft token) above which drafting stops, or None

prompt: the text the model is given (for chat requests, after the chat template). Stop rule: a draft
token whose entropy ("entropy": of the draft's softmax, nats; "doubt": 1 - its top-1
probability) is above the threshold of the request's temperature band is not proposed, and drafting
stops (null: never stop).
Feature: unigram_entropy of the prompt; k from its bucket in the temperature's band; c = 0.17387.

The engine-side estimator.json keys on prompt_entropy (the model's prompt entropy); this module cannot compute
that, so it uses the fitted model-free fallback unigram_entropy.
"""
import bisect
import math
import re

TABLE = {"feature": "unigram_entropy", "thresholds": [0.763, 0.782393], "temperature_edges": [0.0, 0.5], "k_table": [[1, 1, 1], [6, 6, 0], [6, 6, 6]]}
STOP_RULE = {'signal': 'entropy', 'temperature_edges': [0.0, 0.5], 'thresholds': [5.329, 3.4269, 3.3172]}  # Python literals: a threshold of None never stops
STOP_SIGNAL = 'entropy'


def unigram_entropy(text: str) -> float:
    """Entropy of the prompt's word/punctuation unigrams over log2(count): 1.0 = no word repeats."""
    words = re.findall(r"\w+|[^\w\s]", text)
    if len(words) < 2:
        return 1.0
    counts = {}
    for w in words:
        counts[w] = counts.get(w, 0) + 1
    n = len(words)
    return -sum(c / n * math.log2(c / n) for c in counts.values()) / math.log2(n)


def table_k(table: dict, value: float, temperature: float) -> int:
    """k of a fitted table: the feature's bucket (thresholds) in the temperature's band."""
    band = bisect.bisect_left(table["temperature_edges"], temperature)
    return table["k_table"][band][bisect.bisect_right(table["thresholds"], value)]


def stop_threshold(rule: dict, temperature: float) -> float | None:
    """The stop rule's threshold for a temperature (None: never stop)."""
    return rule["thresholds"][bisect.bisect_left(rule["temperature_edges"], temperature)]


def estimate_draft_length(prompt: str, temperature: float = 0.0, top_p: float = 1.0) -> int:
    return table_k(TABLE, unigram_entropy(prompt), temperature)


def draft_length(features: dict) -> int:
    """The embedded engine's Python-estimator hook (`autotune serve --draft-estimator this.py`)."""
    return estimate_draft_length(features.get("prompt_text") or "", features["temperature"], features["top_p"])


def stop_above(features: dict):
    """The embedded engine's stop-rule hook: the request's threshold, None = never stop."""
    return stop_threshold(STOP_RULE, features["temperature"]) if STOP_RULE else None
