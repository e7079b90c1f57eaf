"""The fitted stop rule and caps in each deployed engine's own settings, as far as its pinned version
accepts them (the data: autotune/engines/draft_stop.json, with what cannot be applied said per engine)."""
import json

from autotune import package_path

SUPPORT = package_path("engines", "draft_stop.json")


def engine_settings(rule: dict, tables: dict) -> dict:
    """{engine: {"version", "settings", "applies_with", "not_applied"}}: the cap is the largest k of the fitted
    tables (one cap per server; the stop rule ends drafts early); the cut-off is 1 - the doubt threshold of
    the greedy band (0.0: never stop)."""
    cap = max(k for table in tables.values() for row in table.k_table for k in row)
    doubt = rule if rule["signal"] == "doubt" else rule["alternatives"]["doubt"]
    greedy_threshold = doubt["thresholds"][0]
    p_min = 0.0 if greedy_threshold is None else round(max(0.0, 1 - greedy_threshold), 4)
    out = {}
    for engine, support in json.loads(SUPPORT.read_text())["engines"].items():
        settings = {key: cap + offset for key, offset in support["cap"].items()} if cap else {}
        settings.update(support["constant"] if cap else {})
        if support["cut_off"] and cap:
            settings[support["cut_off"]] = p_min
        out[engine] = {"version": support["version"], "settings": settings,
                       "applies_with": support["applies_with"], "not_applied": support["not_applied"]}
    return out
