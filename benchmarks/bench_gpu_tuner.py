"""Does the tuner find what the GPU can do? A reference sweep against `autotune run` (issue 16, points 6 and 8).

    python3 benchmarks/bench_gpu_tuner.py prewarm --out DIR [--concurrency 1 4 8]
    python3 benchmarks/bench_gpu_tuner.py sweep   --out DIR [--engine embedded|llamacpp] [--concurrency 1 4 8]
    python3 benchmarks/bench_gpu_tuner.py tuner   --out DIR [--engine ...] --concurrency 4 [--trials 8 --budget 3m]
    python3 benchmarks/bench_gpu_tuner.py confirm --out DIR [--engine ...] [--rounds 3] [--concurrency 1 4 8]
    python3 benchmarks/bench_gpu_tuner.py summarize --out DIR [--engine ...]   # -> DIR/summary[-ENGINE].json
    python3 benchmarks/bench_gpu_tuner.py table --out DIR                      # -> DIR/tuner-vs-best.json

prewarm: a fresh machine compiles each KV-cache shape once (the cache is static in the compiled graph, so each
verify-slot count is a compilation of its own; minutes cold, under a minute from the inductor cache after). The
shapes the CUDA seeds and the sweep use (bf16, inductor, slots = each concurrency, n-gram) are compiled side by
side first and their cold start-up seconds recorded (prewarm.json), so the sweep and the tuner both run warm
and the one-time cost is reported on its own.
sweep, embedded: the space's main axes (bf16): drafter none / n-gram x draft length x graphs+compile off / on
(inductor, CUDA graphs for 1, 2, 4, 8) x verify slots 4 / 8. One launch per (drafter, graphs/compile, slots):
the draft length is a runtime knob, changed on the running server as the tuner itself does.
sweep, llamacpp: speculative type none / ngram-simple / ngram-mod x flash attention on / off x slots (-np) 4 / 8,
layers on the GPU by the server's own -ngl auto: every one a launch (llama-server has no runtime knobs).
Each launch is warmed up as a trial is (bench.runner.warm_up at the highest concurrency), then measured at every
concurrency; `sweep_wall_s` per concurrency is what a sweep at that concurrency alone costs: every launch
and warm-up plus that concurrency's measurements.
tuner: `autotune run --gpu auto` with its default space and seeds at one concurrency, without the estimator
step (it has its own benchmark, bench_estimator.py). `wall_s` is what a user waits for (search, validation,
export, report); `search_s` the trials alone; `to_best_s` until the trial the validation chose had finished.
confirm: the sweep's best and the tuner's validated winner per concurrency, relaunched side by side and
measured in alternation (`--rounds` each): the ratio comes from this run, not from the runs that chose them.
table: issue 30 point 6's rows, one per engine and concurrency that has a tuner run and a confirm in DIR; best
known = the better of the two relaunched medians (the tuner's export can beat the sweep), the commit the tuner's
study recorded.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from autotune import provenance
from autotune.bench import load_workload
from autotune.bench.runner import measure_server, warm_up
from autotune.engines import ENGINES, get_adapter
from autotune.engines.launcher import LaunchError, launch
from autotune.study.plan import parse_duration

FAST = {"compile": "inductor", "cuda_graph_batch_sizes": [1, 2, 4, 8]}
SLOW = {"compile": "none", "cuda_graph_batch_sizes": []}
DRAFT_LENGTHS = (4, 8)  # the field report: 4 gave 5x, 16 almost nothing; 8 is where n-gram peaked on the H200
WORKLOAD = "code"


def embedded_launches():
    for fast_name, fast in (("eager", SLOW), ("graphs+inductor", FAST)):
        for slots in (4, 8):
            base = {"dtype": "bfloat16", "verify_slots": slots, **fast}
            yield f"plain {fast_name} slots{slots}", {**base, "drafter": "none"}, [None]
            yield f"ngram {fast_name} slots{slots}", {**base, "drafter": "ngram"}, list(DRAFT_LENGTHS)


def llamacpp_launches():
    for spec in ("none", "ngram-simple", "ngram-mod"):  # the server's own n-gram sizes (its --help defaults)
        for flash in ("on", "off"):
            for slots in (4, 8):
                yield (f"{spec} fa-{flash} np{slots}",
                       {"spec_type": spec, "flash_attn": flash, "parallel": slots}, [None])


LAUNCHES = {"embedded": embedded_launches, "llamacpp": llamacpp_launches}


def prewarm(args):
    from concurrent.futures import ThreadPoolExecutor

    from autotune.space.space import powers_of_two
    out = Path(args.out)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    adapter = get_adapter("embedded")

    def one(c):
        config = {"dtype": "bfloat16", "compile": "inductor", "cuda_graph_batch_sizes": powers_of_two(c),
                  "verify_slots": c, "drafter": "ngram"}
        t0 = time.monotonic()
        server = launch(adapter, config, log_path=out / "logs" / f"prewarm-slots{c}.log", timeout_s=args.launch_timeout)
        server.stop()
        return {"config": config, "cold_launch_s": round(time.monotonic() - t0, 1)}

    with ThreadPoolExecutor(len(args.concurrency)) as pool:  # side by side: each compiles on its own cores
        done = dict(zip(args.concurrency, pool.map(one, args.concurrency)))
    (out / "prewarm.json").write_text(json.dumps(done, indent=1) + "\n")
    print(json.dumps(done), flush=True)


def requests_at(concurrency: int, per_stream: int) -> int:
    return max(4, per_stream * concurrency)


def sweep(args):
    out = Path(args.out)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    adapter, workload = get_adapter(args.engine), load_workload(WORKLOAD, args.seed)
    cells, launched = [], []
    settings = {"engine": args.engine, "workload": WORKLOAD, "max_tokens": args.max_tokens,
                "per_stream": args.per_stream, "seed": args.seed}
    if args.engine not in LAUNCHES:
        raise SystemExit(f"sweep: no reference sweep for {args.engine} (one of {', '.join(sorted(LAUNCHES))})")
    for name, config, lengths in LAUNCHES[args.engine]():
        if args.only and not re.search(args.only, name):
            continue
        t0 = time.monotonic()
        try:
            server = launch(adapter, config, log_path=out / "logs" / f"{name.replace(' ', '_')}.log",
                            timeout_s=args.launch_timeout)
        except (LaunchError, ValueError) as e:  # a launch that fails is a result of the sweep
            launched.append({"name": name, "config": config, "error": str(e).splitlines()[0]})
            print(f"{name}: launch failed: {e}", flush=True)
            continue
        try:
            launch_s = time.monotonic() - t0
            if config.get("drafter", "none") != "none":
                adapter.apply_runtime(server.base_url, {"draft_length": max(lengths)})
            # the tuner's own warm-up (waves at the highest concurrency until they stop getting faster)
            warm = warm_up(server, workload, concurrency=max(args.concurrency), max_tokens=args.max_tokens,
                           seed=args.seed, request_timeout=args.launch_timeout)
            launched.append({"name": name, "config": config, "launch_s": round(launch_s, 2),
                             "warmup_s": warm["warmup_s"]})
            for k in lengths:
                if k is not None:
                    adapter.apply_runtime(server.base_url, {"draft_length": k})
                for c in args.concurrency:
                    summary, _ = measure_server(server, workload, concurrency=c,
                                                num_requests=requests_at(c, args.per_stream),
                                                max_tokens=args.max_tokens, seed=args.seed,
                                                request_timeout=args.request_timeout)
                    cell = {"launch": name, "config": {**config, **({"draft_length": k} if k else {})},
                            "concurrency": c, "output_tok_s": summary["output_tok_s"],
                            "failed": summary["failed"], "measure_s": summary["duration_s"]}
                    cells.append(cell)
                    print(f"{name} k={k} c={c}: {summary['output_tok_s']:.1f} tok/s "
                          f"({summary['failed']} failed, {summary['duration_s']:.1f} s)", flush=True)
        finally:
            server.stop()
        sweep_path(out, args.engine).write_text(
            json.dumps({"settings": settings, "launches": launched, "cells": cells}, indent=1) + "\n")


def sweep_path(out: Path, engine: str, stem: str = "sweep") -> Path:
    """DIR/sweep.json for the embedded engine (as the first runs wrote it), DIR/sweep-llamacpp.json else."""
    return out / (f"{stem}.json" if engine == "embedded" else f"{stem}-{engine}.json")


def tuner(args):
    out = Path(args.out)
    c = args.concurrency[0]
    name = tuner_name(args.engine, c)
    argv = [sys.executable, "-m", "autotune.cli", "run", "--gpu", "auto", "--engine", args.engine,
            "--concurrency", str(c), "--study", name, "--seed", str(args.seed)]
    if not args.as_user:  # the sweep's workload and request counts, without the estimator step
        argv += ["--workload", WORKLOAD, "--num-requests", str(requests_at(c, args.per_stream)),
                 "--max-tokens", str(args.max_tokens), "--no-estimator"]
    argv += [*(["--trials", str(args.trials)] if args.trials else []), *(["--budget", args.budget] if args.budget else [])]
    env = {**os.environ, "AUTOTUNE_STUDIES_DIR": str(out / "studies")}
    started = time.time()
    t0 = time.monotonic()
    rc = subprocess.run(argv, env=env, check=False).returncode
    wall = time.monotonic() - t0
    directory = out / "studies" / name
    validation_path = directory / "best" / "validation.json"
    validation = json.loads(validation_path.read_text()) if rc == 0 and validation_path.exists() else {}
    winner = validation.get("winner") or {}
    record = {"engine": args.engine, "concurrency": c, "argv": argv[1:], "rc": rc, "wall_s": round(wall, 1),
              **_trial_times(directory, started, winner.get("trial")),
              "validated_at_s": round(validation_path.stat().st_mtime - started, 1) if validation else None,
              "winner_config": winner.get("config"), "winner_trial": winner.get("trial"), "tie": winner.get("tie"),
              "tuner_validated_tok_s": ((winner.get("stats") or {}).get("output_tok_s") or {}).get("median"),
              "gain_over_defaults": winner.get("gain_over_baseline")}
    tuner_path(out, args.engine, c).write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps(record, indent=1))


def tuner_name(engine: str, c: int) -> str:
    return f"tuner-c{c}" if engine == "embedded" else f"tuner-{engine}-c{c}"


def tuner_path(out: Path, engine: str, c: int) -> Path:
    return out / f"{tuner_name(engine, c)}.json"


def _trial_times(directory: Path, started: float, best_trial: int | None) -> dict:
    """Measured trials, the trials' span (search_s) and when the validated winner's trial ended (to_best_s),
    in seconds from the run's start."""
    import optuna
    empty = {"trials": None, "search_s": None, "to_best_s": None}
    if not (directory / "study.db").exists():  # the run failed before creating its study
        return empty
    try:
        study = optuna.load_study(study_name=directory.name, storage=f"sqlite:///{directory / 'study.db'}")
    except KeyError:  # a storage without that study
        return empty
    ended = [t for t in study.trials if t.datetime_complete is not None]
    best = next((t for t in ended if t.number == best_trial), None)
    return {"trials": sum(t.state == optuna.trial.TrialState.COMPLETE for t in study.trials),
            "search_s": round(max(t.datetime_complete.timestamp() for t in ended) - started, 1) if ended else None,
            "to_best_s": round(best.datetime_complete.timestamp() - started, 1) if best else None}


def best_cells(out: Path, engine: str) -> dict[int, dict]:
    cells = json.loads(sweep_path(out, engine).read_text())["cells"]
    best = {}
    for cell in cells:
        c = cell["concurrency"]
        if not cell["failed"] and (c not in best or cell["output_tok_s"] > best[c]["output_tok_s"]):
            best[c] = cell
    return best


def launch_config(adapter, config: dict, *, log_path: Path, timeout_s: float, argv: list[str] | None = None,
                  env: dict | None = None):
    """`config` launched (from an export's argv and env where given), its runtime settings applied as the tuner
    applies them; an engine without runtime settings is only launched (llama-server's adapter refuses any)."""
    launch_part, runtime = adapter.facts.split_runtime(config)
    if argv is not None:
        server = launch(adapter, argv=argv, env=env or {}, log_path=log_path, timeout_s=timeout_s)
    else:
        server = launch(adapter, launch_part, log_path=log_path, timeout_s=timeout_s)
    if runtime:
        adapter.apply_runtime(server.base_url, runtime)
    return server


def confirm(args):
    """Relaunch the sweep's best and the tuner's winner per concurrency; alternate measurements."""
    out = Path(args.out)
    adapter, workload = get_adapter(args.engine), load_workload(WORKLOAD, args.seed + 1)  # other prompts order
    rows = {}
    for c, cell in sorted(best_cells(out, args.engine).items()):
        path = tuner_path(out, args.engine, c)
        if c not in args.concurrency or not path.exists() or not json.loads(path.read_text()).get("winner_config"):
            continue
        sides = {"sweep_best": cell["config"], "tuner": json.loads(path.read_text())["winner_config"]}
        if adapter.effective(sides["sweep_best"]) == adapter.effective(sides["tuner"]):
            rows[c] = {"same_configuration": True, "ratio_tuner_over_sweep": 1.0}  # nothing to tell apart
            print(f"c={c}: the tuner's winner is the sweep's best", flush=True)
            continue
        servers = {}
        try:
            for side, config in sides.items():
                servers[side] = launch_config(adapter, config, log_path=out / "logs" / f"confirm-c{c}-{side}.log",
                                              timeout_s=args.launch_timeout)
                warm_up(servers[side], workload, concurrency=c, max_tokens=args.max_tokens, seed=args.seed,
                        request_timeout=args.launch_timeout)
            values = {side: [] for side in sides}
            for r in range(args.rounds):
                order = list(sides) if r % 2 == 0 else list(reversed(sides))
                for side in order:
                    summary, _ = measure_server(servers[side], workload, concurrency=c,
                                                num_requests=requests_at(c, args.per_stream),
                                                max_tokens=args.max_tokens, seed=args.seed + 1 + r)
                    values[side].append(summary["output_tok_s"])
        finally:
            for s in servers.values():
                s.stop()
        rows[c] = {side: {"values": v, "median": statistics.median(v)} for side, v in values.items()}
        rows[c]["ratio_tuner_over_sweep"] = rows[c]["tuner"]["median"] / rows[c]["sweep_best"]["median"]
        print(f"c={c}: {json.dumps(rows[c])}", flush=True)
    confirmed = sweep_path(out, args.engine, "confirm")  # runs at other concurrencies add to it
    earlier = json.loads(confirmed.read_text()) if confirmed.exists() else {}
    confirmed.write_text(json.dumps({**earlier, **{str(c): row for c, row in rows.items()}}, indent=1) + "\n")


def summarize(args):
    out = Path(args.out)
    sweep_dir = Path(args.sweep_dir or out)  # a sweep recorded in another results folder (its own commit)
    doc = json.loads(sweep_path(sweep_dir, args.engine).read_text())
    launch_cost = sum(item.get("launch_s", 0) + item.get("warmup_s", 0) for item in doc["launches"])
    confirm_path = sweep_path(out, args.engine, "confirm")
    confirmed = json.loads(confirm_path.read_text()) if confirm_path.exists() else {}
    rows = []
    for c, cell in sorted(best_cells(sweep_dir, args.engine).items()):
        measured = sum(x["measure_s"] for x in doc["cells"] if x["concurrency"] == c)
        path = tuner_path(out, args.engine, c)
        t = json.loads(path.read_text()) if path.exists() else {}
        sweep_wall = launch_cost + measured
        row = {"concurrency": c, "sweep_best_tok_s": cell["output_tok_s"], "sweep_best_config": cell["config"],
               "sweep_cells": sum(x["concurrency"] == c for x in doc["cells"]), "sweep_wall_s": round(sweep_wall, 1),
               "tuner_validated_tok_s": t.get("tuner_validated_tok_s"), "tuner_config": t.get("winner_config"),
               "tuner_over_sweep_best": (round(t["tuner_validated_tok_s"] / cell["output_tok_s"], 3)
                                         if t.get("tuner_validated_tok_s") else None),
               "trials": t.get("trials"), "wall_s": t.get("wall_s"),
               **{f"{key}_fraction": round(t[key] / sweep_wall, 3) if t.get(key) else None
                  for key in ("wall_s", "validated_at_s", "search_s", "to_best_s")}}
        if str(c) in confirmed:
            row["confirm"] = confirmed[str(c)]
        rows.append(row)
    summary = {"commit": provenance.commit(), **doc["settings"], "rows": rows,
               **({"sweep_from": str(sweep_dir)} if args.sweep_dir else {})}
    sweep_path(out, args.engine, "summary").write_text(json.dumps(summary, indent=1) + "\n")
    print(yaml.safe_dump(summary, sort_keys=False))


def table(args):
    out, rows, commits = Path(args.out), [], set()
    for engine in sorted(ENGINES):
        confirmed = sweep_path(out, engine, "confirm")
        for c, k in sorted((json.loads(confirmed.read_text()) if confirmed.exists() else {}).items(), key=lambda x: int(x[0])):
            path = tuner_path(out, engine, int(c))
            if not path.exists():
                continue
            t = json.loads(path.read_text())
            argv = t["argv"]
            study = out / "studies" / tuner_name(engine, int(c)) / "provenance.json"
            if study.exists():
                commits.add(json.loads(study.read_text()).get("commit", "")[:7])
            same = k.get("same_configuration", False)
            best = None if same else max(k["sweep_best"]["median"], k["tuner"]["median"])
            rows.append({"engine": engine, "concurrency": int(c),
                         "tuner_validated_tok_s": round(t["tuner_validated_tok_s"], 1) if t["tuner_validated_tok_s"] else None,
                         "best_known_tok_s": round(best, 1) if best else None,
                         "sweep_best_relaunched_tok_s": None if same else round(k["sweep_best"]["median"], 1),
                         "tuner_relaunched_tok_s": None if same else round(k["tuner"]["median"], 1),
                         "ratio_tuner_over_best_known": 1.0 if same else round(k["tuner"]["median"] / best, 3),
                         "ratio_tuner_over_sweep_best": round(k["ratio_tuner_over_sweep"], 3),
                         **({"same_configuration": True} if same else {}),
                         "budget_s": (parse_duration(argv[argv.index("--budget") + 1]) if "--budget" in argv else None),
                         "wall_s": t["wall_s"], "trials": t["trials"], "tie": t["tie"]})
    doc = {"commit": ", ".join(sorted(commits)) or provenance.commit(), "rows": rows}
    (out / "tuner-vs-best.json").write_text(json.dumps(doc, indent=1) + "\n")
    print(json.dumps(doc, indent=1))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("step", choices=["prewarm", "sweep", "tuner", "confirm", "summarize", "table"])
    ap.add_argument("--out", required=True)
    ap.add_argument("--engine", choices=sorted(ENGINES), default="embedded", help="sweep: embedded or llamacpp")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--per-stream", type=int, default=4, help="measured requests per concurrent stream")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--trials", type=int, default=None)
    ap.add_argument("--budget", default=None)
    ap.add_argument("--as-user", action="store_true",
                    help="tuner: the command a user types (`run --gpu auto --concurrency C --budget B`), all defaults")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sweep-dir", default=None, help="summarize: the sweep's results folder, when not --out")
    ap.add_argument("--only", default=None, help="sweep: only the launches whose name matches this regex")
    ap.add_argument("--launch-timeout", type=float, default=600.0)
    ap.add_argument("--request-timeout", type=float, default=120.0)
    args = ap.parse_args()
    {"prewarm": prewarm, "sweep": sweep, "tuner": tuner, "confirm": confirm, "summarize": summarize,
     "table": table}[args.step](args)


if __name__ == "__main__":
    main()
