"""How many tokens to propose per step (k), per request.

- fixed: always the configured draft length.
- adaptive: acceptance history of the request itself. A step that accepted every proposal grows k
  by one, one that rejected shrinks it by one (within 1 .. MAX_DRAFT_LENGTH); steps where the
  drafter found nothing to propose (n-gram misses) leave k alone.
- estimator: k chosen once per request, when its prefill ends, by an estimator file (`--draft-estimator`):

  A JSON file maps one prompt feature to k by buckets, tried in order; the first bucket whose
  "below" exceeds the feature wins, a bucket without "below" catches the rest:

      {"feature": "prompt_entropy",
       "buckets": [{"below": 1.0, "k": 8}, {"below": 2.5, "k": 4}, {"k": 2}]}

  A fitted estimator (`autotune estimator fit` writes it; detected by its "k_table") maps a feature
  bucket x temperature band to k; its other keys (fitted alpha, c, data) are for people:

      {"feature": "compression_ratio", "thresholds": [0.55, 0.8],      # bucket = bisect_right
       "temperature_edges": [0.0, 0.5],                                 # band = bisect_left
       "k_table": [[8, 6, 3], [6, 4, 2], [4, 3, 1]], ...}               # k_table[band][bucket]

  A Python file defines `draft_length(features: dict) -> int`.

  Features (all forms): prompt_entropy (mean next-token entropy of the first 32 prompt positions,
  nats), prompt_tokens, prompt_chars, temperature, top_p, and the model-free compression_ratio and
  unigram_entropy of the prompt text; the Python form also gets prompt_text.
"""
import bisect
import importlib.util
import json
import math
import re
import zlib
from pathlib import Path

from autotune.embedded.config import MAX_DRAFT_LENGTH


# Model-free prompt features: any serving stack can compute them from the text alone. The estimator's
# generated standalone module copies these functions verbatim, so both give the same answers.
def compression_ratio(text: str) -> float:
    """zlib-compressed size / raw size of the prompt: low for repetitive text, which drafts well."""
    raw = text.encode("utf-8")
    return len(zlib.compress(raw, 9)) / len(raw) if raw else 1.0


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


TEXT_FEATURES = {"compression_ratio": compression_ratio, "unigram_entropy": unigram_entropy}
FEATURES = ("prompt_entropy", "prompt_tokens", "prompt_chars", "temperature", "top_p", *TEXT_FEATURES)


def clamp_k(k: int) -> int:
    return max(0, min(MAX_DRAFT_LENGTH, int(k)))


def load_estimator(path: str):
    """Estimator file -> callable(features) -> k. Raises ValueError with a clear message when malformed."""
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"draft estimator {path!r} does not exist")
    if file.suffix == ".py":
        spec = importlib.util.spec_from_file_location("draft_length_estimator", file)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        if not callable(getattr(module, "draft_length", None)):
            raise ValueError(f"draft estimator {path!r} defines no draft_length(features) function")
        return lambda features: clamp_k(module.draft_length(features))
    try:
        spec = json.loads(file.read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        raise ValueError(f"draft estimator {path!r} is not valid JSON ({exc})") from None
    if isinstance(spec, dict) and "k_table" in spec:
        return _table_estimator(path, spec)
    try:
        feature, buckets = spec["feature"], spec["buckets"]
        bounds = [(float(b["below"]) if "below" in b else float("inf"), clamp_k(b["k"])) for b in buckets]
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"draft estimator {path!r} is not a valid estimator JSON ({exc})") from None
    if feature not in FEATURES or not bounds:
        raise ValueError(f"draft estimator {path!r}: feature must be one of {FEATURES} and buckets non-empty")

    def estimate(features: dict) -> int:
        value = feature_value(features, feature)
        return next((k for below, k in bounds if value < below), bounds[-1][1])

    return estimate


def feature_value(features: dict, name: str) -> float:
    if name in TEXT_FEATURES:
        return TEXT_FEATURES[name](features.get("prompt_text") or "")
    return features[name]


def _table_estimator(path: str, spec: dict):
    feature = spec.get("feature")
    if feature not in FEATURES:
        raise ValueError(f"draft estimator {path!r}: feature must be one of {FEATURES}, got {feature!r}")
    try:
        table = {"thresholds": [float(t) for t in spec["thresholds"]],
                 "temperature_edges": [float(t) for t in spec["temperature_edges"]],
                 "k_table": [[clamp_k(k) for k in row] for row in spec["k_table"]]}
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"draft estimator {path!r} is not a valid estimator JSON ({exc})") from None
    shape_ok = len(table["k_table"]) == len(table["temperature_edges"]) + 1 and all(
        len(row) == len(table["thresholds"]) + 1 for row in table["k_table"])
    if not shape_ok:
        raise ValueError(f"draft estimator {path!r}: k_table must have one row per temperature band "
                         "and one column per feature bucket")
    return lambda features: table_k(table, feature_value(features, feature), features["temperature"])


class DraftPolicy:
    def __init__(self, name: str, draft_length: int, estimator=None):
        if name == "estimator" and estimator is None:
            raise ValueError("draft policy 'estimator' needs a draft estimator file (--draft-estimator)")
        self.name, self.draft_length, self.estimator = name, draft_length, estimator

    def first_k(self, features: dict) -> int:
        return self.estimator(features) if self.name == "estimator" else self.draft_length

    def next_k(self, k: int, proposed: int, accepted: int) -> int:
        if self.name != "adaptive" or not proposed:
            return k
        return min(k + 1, MAX_DRAFT_LENGTH) if accepted == proposed else max(1, k - 1)
