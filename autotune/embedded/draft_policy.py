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

  A Python file defines `draft_length(features: dict) -> int`.

  Features (both forms): prompt_entropy (mean next-token entropy of the first 32 prompt positions,
  nats), prompt_tokens, prompt_chars, temperature, top_p; the Python form also gets prompt_text.
"""
import importlib.util
import json
from pathlib import Path

from autotune.embedded.generate import MAX_DRAFT_LENGTH

FEATURES = ("prompt_entropy", "prompt_tokens", "prompt_chars", "temperature", "top_p")


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
        feature, buckets = spec["feature"], spec["buckets"]
        bounds = [(float(b["below"]) if "below" in b else float("inf"), clamp_k(b["k"])) for b in buckets]
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"draft estimator {path!r} is not a valid estimator JSON ({exc})") from None
    if feature not in FEATURES or not bounds:
        raise ValueError(f"draft estimator {path!r}: feature must be one of {FEATURES} and buckets non-empty")

    def estimate(features: dict) -> int:
        value = features[feature]
        return next((k for below, k in bounds if value < below), bounds[-1][1])

    return estimate


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
