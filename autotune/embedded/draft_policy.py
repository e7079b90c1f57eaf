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

  Its optional "stop_rule" stops drafting during a step (generate.py): a draft token whose risk (entropy
  of the draft's distribution, or doubt = 1 - its top-1 probability) is above the threshold of the
  request's temperature band ends the proposal (null: never stop); for the n-gram drafter the risk is the
  target's at the last accepted token, and a step above it proposes nothing. Its curve, AUC and
  per-engine settings are for people and exports:

      "stop_rule": {"signal": "entropy", "temperature_edges": [0.0, 0.5], "thresholds": [1.2, 2.0, null]}

  A Python file defines `draft_length(features: dict) -> int` (and, optionally, `stop_above(features) ->
  float | None` with a module-level STOP_SIGNAL).

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
from autotune.embedded.generate import STOP_SIGNALS


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


def stop_threshold(rule: dict, temperature: float) -> float | None:
    """The stop rule's threshold for a temperature (None: never stop)."""
    return rule["thresholds"][bisect.bisect_left(rule["temperature_edges"], temperature)]


class FileEstimator:
    """An estimator file, read: k per request (`self(features)`), and its stop rule (signal + threshold)."""

    def __init__(self, k_of, stop_above=None, signal: str = "entropy"):
        self.k_of, self.stop_above, self.signal = k_of, stop_above, signal

    def __call__(self, features: dict) -> int:
        return clamp_k(self.k_of(features))


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
        signal = getattr(module, "STOP_SIGNAL", "entropy")
        if signal not in STOP_SIGNALS:
            raise ValueError(f"draft estimator {path!r}: STOP_SIGNAL must be one of {STOP_SIGNALS}, got {signal!r}")
        return FileEstimator(module.draft_length, getattr(module, "stop_above", None), signal)
    try:
        spec = json.loads(file.read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        raise ValueError(f"draft estimator {path!r} is not valid JSON ({exc})") from None
    if isinstance(spec, dict) and "k_table" in spec:
        return FileEstimator(_table_estimator(path, spec), *_stop_rule(path, spec.get("stop_rule")))
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

    return FileEstimator(estimate)


def _stop_rule(path: str, rule: dict | None) -> tuple:
    """estimator.json's stop_rule -> (stop_above(features), signal); (None, "entropy") without one."""
    if rule is None:
        return None, "entropy"
    try:
        rule = {"signal": rule["signal"], "temperature_edges": [float(t) for t in rule["temperature_edges"]],
                "thresholds": [None if t is None else float(t) for t in rule["thresholds"]]}
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"draft estimator {path!r}: stop_rule is not valid ({exc})") from None
    if rule["signal"] not in STOP_SIGNALS or len(rule["thresholds"]) != len(rule["temperature_edges"]) + 1:
        raise ValueError(f"draft estimator {path!r}: stop_rule needs signal one of {STOP_SIGNALS} and one "
                         "threshold per temperature band")
    return (lambda features: stop_threshold(rule, features["temperature"])), rule["signal"]


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

    def stop_above(self, features: dict) -> float | None:
        """The request's draft stop threshold: the estimator's, for its temperature; None: no stopping."""
        rule = self.estimator.stop_above if self.name == "estimator" else None
        return rule(features) if rule else None

    @property
    def stop_signal(self) -> str:
        return self.estimator.signal if self.estimator else "entropy"

    def step_fields(self, stop_above: list[float | None], traced: list[bool], target_signals: list | None) -> dict:
        """StepInput's stop-rule fields for a batch: per row its threshold (None: never), whether it is
        traced, and (for the n-gram drafter) the target's signals of its previous step."""
        rule = any(a is not None for a in stop_above)
        return {"stop_above": [math.inf if a is None else a for a in stop_above] if rule else None,
                "stop_signal": self.stop_signal, "trace": any(traced),
                "target_signals": target_signals if target_signals is not None and (rule or any(traced)) else None}

    def next_k(self, k: int, proposed: int, accepted: int) -> int:
        if self.name != "adaptive" or not proposed:
            return k
        return min(k + 1, MAX_DRAFT_LENGTH) if accepted == proposed else max(1, k - 1)
