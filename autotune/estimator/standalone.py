"""draft_length_estimator.py: the fitted model-free table (and stop rule) as a module with no dependencies.

It copies the engine's own feature function and table lookup (inspect.getsource), so the module, the
engine and the fit give the same k; the only imports it writes are stdlib ones.
"""
import inspect
import json

from autotune.embedded.draft_policy import (
    TEXT_FEATURES,
    compression_ratio,
    stop_threshold,
    table_k,
    unigram_entropy,
)

# the stdlib imports each copied feature function needs
IMPORTS = {compression_ratio: "import zlib", unigram_entropy: "import math\nimport re"}


def standalone_module(fallback: dict, primary_feature: str, c: float, stop_rule: dict | None = None) -> str:
    """The module's source: `fallback` is the fitted model-free table (Table as a dict), `primary_feature`
    the feature estimator.json keys on, c the fitted draft cost, stop_rule estimator.json's (or None)."""
    table = {k: fallback[k] for k in ("feature", "thresholds", "temperature_edges", "k_table")}
    rule = {k: stop_rule[k] for k in ("signal", "temperature_edges", "thresholds")} if stop_rule else None
    fn = TEXT_FEATURES[table["feature"]]
    note = ("" if primary_feature == table["feature"] else
            f"\nThe engine-side estimator.json keys on {primary_feature} (the model's prompt entropy); this module "
            f"cannot compute\nthat, so it uses the fitted model-free fallback {table['feature']}.\n")
    return f'''"""Draft length per request, fitted by `autotune estimator fit` (no dependencies: copy it anywhere).

    estimate_draft_length(prompt, temperature=0.0, top_p=1.0) -> k (the cap on a step's proposals)
    stop_above(features) -> the risk (STOP_SIGNAL of the draft token) above which drafting stops, or None

prompt: the text the model is given (for chat requests, after the chat template). Stop rule: a draft
token whose {rule and rule["signal"]} ("entropy": of the draft's softmax, nats; "doubt": 1 - its top-1
probability) is above the threshold of the request's temperature band is not proposed, and drafting
stops ({"no stop rule was fitted" if rule is None else "null: never stop"}).
Feature: {table["feature"]} of the prompt; k from its bucket in the temperature's band; c = {c}.
{note}"""
import bisect
{IMPORTS[fn]}

TABLE = {json.dumps(table)}
STOP_RULE = {rule!r}  # Python literals: a threshold of None never stops
STOP_SIGNAL = {(rule["signal"] if rule else "entropy")!r}


{inspect.getsource(fn)}

{inspect.getsource(table_k)}

{inspect.getsource(stop_threshold)}

def estimate_draft_length(prompt: str, temperature: float = 0.0, top_p: float = 1.0) -> int:
    return table_k(TABLE, {fn.__name__}(prompt), temperature)


def draft_length(features: dict) -> int:
    """The embedded engine's Python-estimator hook (`autotune serve --draft-estimator this.py`)."""
    return estimate_draft_length(features.get("prompt_text") or "", features["temperature"], features["top_p"])


def stop_above(features: dict):
    """The embedded engine's stop-rule hook: the request's threshold, None = never stop."""
    return stop_threshold(STOP_RULE, features["temperature"]) if STOP_RULE else None
'''
