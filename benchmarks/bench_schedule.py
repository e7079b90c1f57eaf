"""Does a draft-length schedule (batch size -> k) beat every fixed k on a load that ramps? (issue 34 point 5)

1. Fit (workload seed --fit-seed): one server per launch configuration, each k of --ks at each concurrency of
   --levels, --fit-repeats times, the k rotated cell by cell, each cell a closed loop of --phase-s seconds as an
   evaluation phase runs (study/schedule.measure_cell); study/schedule.fit chooses the schedule from these
   measurements alone (what `autotune run --fit-schedule` does after its own sweep).
2. Evaluation (the prompts in another order: workload seed --eval-seed): the ramp profile (each level for --phase-s
   seconds, closed loop, one after another) run --rounds times on every arm, the arms rotated per round:
   the schedule and each fixed k (k = 0 is plain decoding). Per arm the pooled tok/s of each round (tokens of
   all phases / their summed wall time) and the top phase's.
3. Result: the best fixed k = the fixed arm with the highest median pooled tok/s (picked on the evaluation
   itself: this favours the fixed arms), the schedule / best fixed per round (paired by round), its median and
   a 90% bootstrap interval, and the schedule / plain in the highest-concurrency phase.

The embedded engine is one server whose arms are runtime settings (`draft_length`, `draft_schedule` on
/admin/runtime); vLLM's CPU build takes k and the schedule (`num_speculative_tokens_per_batch_size`) only at
launch, so it runs one server per arm, all started before the evaluation.

    python3 benchmarks/bench_schedule.py --engine embedded [--levels 1,2,4,8] [--ks 0,2,4,8] [--phase-s 20]
        [--rounds 5] [--workload code] --out benchmarks/results/schedule-DATE
    python3 benchmarks/bench_schedule.py --engine vllm --out benchmarks/results/schedule-DATE
    python3 benchmarks/bench_schedule.py --engine embedded --gpu --out ...   # bf16 on the GPU, compiled, CUDA graphs

Rows are appended to OUT/summary.json (one per machine, engine and drafter):
{"machine", "engine", "drafter", "best_fixed_k", "ratio", "ci_low", "ci_high", "top_phase_ratio_vs_plain"};
OUT/<engine>.json holds the fit, every round and the servers' commands.
"""
import argparse
import json
import os
import platform
import subprocess
import time
from contextlib import ExitStack
from pathlib import Path

import numpy as np
from rich.console import Console

from autotune.bench import load_workload
from autotune.bench.load_profile import parse_load_profile
from autotune.bench.runner import measure_server_profile, warm_up
from autotune.engines import get_adapter
from autotune.engines.launcher import launch
from autotune.hardware.probe import probe
from autotune.space.space import powers_of_two
from autotune.study.schedule import Measurement, Phase, fit, measure_cell

BASE = {  # batch up to the top level, CPU, one model
    "embedded": {"drafter": "ngram", "quantization": "gguf", "device": "cpu", "max_seq_len": 1024, "seed": 0},
    "vllm": {"speculative_method": "ngram", "prompt_lookup_min": 2, "prompt_lookup_max": 4, "enforce_eager": True,
             "cpu_kvcache_space": 2, "max_model_len": 1024, "enable_prefix_caching": False},  # dtype: cpu_dtype()
}
GPU_EMBEDDED = {"drafter": "ngram", "dtype": "bfloat16", "device": "cuda", "compile": "inductor", "max_seq_len": 1024,
                "seed": 0}  # graphs for every batch size of the ramp are added per run
VLLM_SPECULATION = ("speculative_method", "prompt_lookup_min", "prompt_lookup_max")
SLOTS_KEY = {"embedded": "verify_slots", "vllm": "max_num_seqs"}
CONFIDENCE = 0.90


def cpu_dtype() -> str:
    """vLLM's CPU dtype: bfloat16 where this CPU computes it natively, else float32 (emulated bf16 ran plain decoding
    at 4 tok/s on an AVX2-only 2-core machine, a sixth of the AVX-512 machine's bf16)."""
    cpu = probe("auto").cpu
    return "bfloat16" if cpu is not None and "bf16" in cpu.native_units() else "float32"


def bootstrap_median(values: list[float], resamples: int = 5000, seed: int = 0) -> tuple[float, float, float]:
    v = np.asarray(values, dtype=float)
    boot = np.median(np.random.default_rng(seed).choice(v, size=(resamples, v.size)), axis=1)
    tail = (1 - CONFIDENCE) / 2 * 100
    return float(np.median(v)), float(np.percentile(boot, tail)), float(np.percentile(boot, 100 - tail))


class Arms:
    """The servers behind the arms: `url(arm)` after `use(arm)`. An arm is a fixed k (int) or "schedule"."""

    def __init__(self, engine: str, base: dict, ks: list[int], logs: Path, stack: ExitStack):
        self.engine, self.adapter, self.base, self.ks = engine, get_adapter(engine), base, ks
        self.logs, self.stack, self.servers, self.schedule = logs, stack, {}, None

    def config(self, arm) -> dict:
        if arm == "schedule":
            widest = self.adapter.with_draft_length(self.base, max(self.ks))
            rendering = self.adapter.schedule_args(widest, self.schedule, directory=self.logs)
            rendering.write_files()
            return {**widest, **rendering.config}
        if arm == 0 and self.engine != "embedded":  # plain decoding: a server without a speculative config
            return {k: v for k, v in self.base.items() if k not in VLLM_SPECULATION}
        return self.adapter.with_draft_length(self.base, arm)

    def server(self, arm):
        key = "one" if self.engine == "embedded" else arm
        if key not in self.servers:
            first = self.adapter.with_draft_length(self.base, max(self.ks)) if key == "one" else self.config(arm)
            server = launch(self.adapter, first, log_path=self.logs / f"{self.engine}-{key}.log", timeout_s=600)
            self.stack.callback(server.stop)
            self.servers[key] = server
        return self.servers[key]

    def use(self, arm):
        server = self.server(arm)
        if self.engine == "embedded":
            runtime = {"draft_length": max(self.ks), "draft_schedule": self.schedule.model_dump(mode="json")} \
                if arm == "schedule" else {"draft_length": arm, "draft_schedule": None}
            self.adapter.apply_runtime(server.base_url, runtime)
        return server


def fit_phase(arms: Arms, levels: list[int], repeats: int, cell_s: float, max_tokens: int, workload_name: str,
              seed: int, console) -> list[Measurement]:
    workload = load_workload(workload_name, seed)
    for k in arms.ks:  # compiling and warm caches are launch cost, not the first cell's speed
        warm_up(arms.use(k), workload, concurrency=max(levels), max_tokens=max_tokens, seed=seed)
    out = []
    for r in range(repeats):
        for c in levels:
            for k in (arms.ks if r % 2 == 0 else arms.ks[::-1]):
                s = measure_cell(arms.use(k), workload, c, cell_s, max_tokens=max_tokens, seed=seed + r)
                out.append(Measurement(arms.base[arms.adapter.facts.draft_keys[0]], k, c,
                                       float(s["output_tok_s"]), s.get("accept_length")))
                console.print(f"fit r{r} c={c} k={k}: {s['output_tok_s']:.1f} tok/s")
    return out


def evaluate(arms: Arms, profile, rounds: int, max_tokens: int, workload_name: str, seed: int,
             console) -> dict[str, list[dict]]:
    workload = load_workload(workload_name, seed)
    names = ["schedule", *arms.ks]
    warm_up(arms.use("schedule"), workload, concurrency=max(profile.concurrencies()), max_tokens=max_tokens,
            seed=seed)
    runs: dict[str, list[dict]] = {str(a): [] for a in names}
    top = f"phase_c{max(profile.concurrencies())}_output_tok_s"
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for arm in order:
            s, _ = measure_server_profile(arms.use(arm), workload, profile, max_tokens=max_tokens, seed=seed + r)
            runs[str(arm)].append({"round": r, "output_tok_s": s["output_tok_s"], "top_phase_tok_s": s[top]})
            console.print(f"eval r{r} {arm}: {s['output_tok_s']:.1f} tok/s pooled, {s[top]:.1f} at the top phase")
    return runs


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--engine", choices=sorted(BASE), default="embedded")
    ap.add_argument("--levels", default="1,2,4,8")
    ap.add_argument("--ks", default="0,2,4,8")
    ap.add_argument("--phase-s", type=float, default=20.0)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--fit-repeats", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--workload", default="code", help="the prompts of fit and evaluation (chat drafts worse)")
    ap.add_argument("--threads", type=int, default=None, help="compute threads per server (default: the engine's)")
    ap.add_argument("--gpu", action="store_true", help="embedded: bf16 on this machine's GPU, inductor, CUDA graphs")
    ap.add_argument("--fit-seed", type=int, default=1)
    ap.add_argument("--eval-seed", type=int, default=2)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    console, out = Console(), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    levels, ks = [int(x) for x in args.levels.split(",")], sorted({0, *(int(x) for x in args.ks.split(","))})
    if args.gpu and args.engine != "embedded":
        ap.error("--gpu: the embedded engine only (vLLM here is its CPU build)")
    base = {**(GPU_EMBEDDED if args.gpu else BASE[args.engine]), SLOTS_KEY[args.engine]: max(levels),
            **({"dtype": cpu_dtype()} if args.engine == "vllm" else {}),
            **({"cuda_graph_batch_sizes": powers_of_two(max(levels))} if args.gpu else {}),
            **({"threads": args.threads} if args.threads else {})}
    profile = parse_load_profile(",".join(f"{c}:{args.phase_s:g}s" for c in levels))
    commit = subprocess.run(["git", "rev-parse", "HEAD"], check=False, capture_output=True, text=True).stdout.strip()
    started = time.time()
    with ExitStack() as stack:
        arms = Arms(args.engine, base, ks, out / "logs", stack)
        measured = fit_phase(arms, levels, args.fit_repeats, args.phase_s, args.max_tokens, args.workload,
                             args.fit_seed, console)
        fitted = fit(measured, measured[-1].drafter, [Phase(c, args.phase_s) for c in levels])
        arms.schedule = fitted.schedule
        console.print(f"fitted: {fitted.summary_line()}")
        runs = evaluate(arms, profile, args.rounds, args.max_tokens, args.workload, args.eval_seed, console)
        commands = {str(key): server.argv for key, server in arms.servers.items()}
    medians = {k: float(np.median([r["output_tok_s"] for r in runs[str(k)]])) for k in ks}
    best_k = max(medians, key=medians.get)
    ratio = bootstrap_median([s["output_tok_s"] / b["output_tok_s"] for s, b in zip(runs["schedule"], runs[str(best_k)])])
    top = float(np.median([s["top_phase_tok_s"] / p["top_phase_tok_s"] for s, p in zip(runs["schedule"], runs["0"])]))
    machine = (f"gpu {probe('auto').gpus[0].name}" if args.gpu
               else f"cpu {platform.machine()} {len(os.sched_getaffinity(0))} cores")
    row = {"machine": machine, "engine": args.engine, "drafter": fitted.schedule.drafter, "best_fixed_k": best_k,
           "ratio": round(ratio[0], 4), "ci_low": round(ratio[1], 4), "ci_high": round(ratio[2], 4),
           "top_phase_ratio_vs_plain": round(top, 4)}
    summary_path = out / "summary.json"
    rows = json.loads(summary_path.read_text()) if summary_path.exists() else []
    rows = [r for r in rows if (r["machine"], r["engine"], r["drafter"]) != (machine, args.engine, row["drafter"])]
    summary_path.write_text(json.dumps([*rows, row], indent=1) + "\n")
    (out / f"{args.engine}.json").write_text(json.dumps({
        "commit": commit, "args": vars(args), "wall_s": round(time.time() - started, 1), "profile": str(profile),
        "fit": fitted.to_json(), "fit_measurements": [m.__dict__ for m in measured], "rounds": runs,
        "median_pooled_tok_s": medians, "commands": commands}, indent=1) + "\n")
    console.print(f"{args.engine}: schedule {fitted.rows_text()} / best fixed k={best_k}: {ratio[0]:.3f} [{ratio[1]:.3f}, {ratio[2]:.3f}] (90%); top phase vs "
                  f"plain {top:.3f}; {out / 'summary.json'}")


if __name__ == "__main__":
    main()
