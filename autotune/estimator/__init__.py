"""The runtime draft-length estimator: per request, pick k (the cap) from prompt features and temperature;
per step, stop drafting when the draft's entropy (or 1 - top-1 probability) crosses the fitted threshold.

One file per phase, each readable top to bottom:
  collect.py     the data: a study's per-request rows, or a collection pass on a live embedded server
  live.py        that server: launch, requests, one request, the text its model sees
  model.py       the speedup model: geometric acceptance, alpha, the best k for a step cost
  cost.py        what a step costs: c, and each k's measured cost
  fit.py         features, the k table per feature bucket x temperature band, the Estimator
  standalone.py  draft_length_estimator.py: the fitted table as a module with no dependencies
  evaluate.py    the estimator against the best single fixed k, on one server, interleaved
  stop.py        the runtime stop rule: per proposed token's signals -> curve, AUC, thresholds and caps
  engine_settings.py  the rule and caps in SGLang / vLLM / llama.cpp settings, where their versions allow
  study.py       the end of `autotune run`: a study's rows (or a traced pass) -> fit -> estimator.json -> eval
"""
from autotune.estimator.collect import collect
from autotune.estimator.evaluate import evaluate, summarize
from autotune.estimator.fit import Estimator, fit
from autotune.estimator.model import best_k
from autotune.estimator.study import evaluate_for_study, fit_from_study

__all__ = ["Estimator", "best_k", "collect", "evaluate", "evaluate_for_study", "fit", "fit_from_study", "summarize"]
