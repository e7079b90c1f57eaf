"""vLLM, llama-server and the embedded engine on the same CPU: same model, workload, threads; plain and best n-gram.

Each server is started through autotune's own adapters and launcher (what the tuner runs), with the same compute
thread count: the embedded engine (`--quantization gguf`: the bundled GGUF's Q4_1/Q8_0 blocks, its fastest CPU
path) and llama-server read the bundled SmolLM2-135M GGUF; vLLM's CPU build reads the HF copy autotune writes
from it (float32 weights dequantised from the same blocks; served in bf16 or float32). The numerics therefore
differ: vLLM multiplies dequantised float weights, the other two the 4-bit blocks. All three get the same token
ids (the embedded tokenizer and chat template, on /v1/completions), batch 1, greedy, N tokens with ignore_eos,
no prompt cache; tok/s = N / wall seconds of one non-streaming request, timed by this client alike for all.

1. Selection (the first --select-prompts prompts of each shuffled workload): vLLM's plain numerics
   (--vllm-plain, e.g. bfloat16:eager) rotated on each prompt, scored against the first; every n-gram setting
   (embedded draft_length --ks, llama-server ngram-simple --llama-ngram, vLLM num_speculative_tokens --vllm-ks
   with prompt_lookup 2..4, each vLLM setting a server of its own started in turn) scored against its own
   engine's plain decode on the same prompt, run just before or after it. Best median wins.
2. Confirmation (the next --pairs prompts): six servers (three plains, three chosen n-gram settings) rotated
   request by request, the order shifted per prompt. Per workload, each row is the median over prompts of a
   per-prompt ratio with a 95% percentile bootstrap interval: each engine's plain vs the fastest other engine's
   plain, its n-gram vs the fastest other n-gram, its n-gram vs its own plain. Only these numbers are results.

    python3 benchmarks/bench_cpu_engines.py [--threads 1] [--tokens 96] [--select-prompts 2] [--pairs 5]
        [--ks 1,2,4] [--llama-ngram 2:8,4:16,12:48] [--vllm-ks 2,4,8] [--vllm-plain bfloat16:eager,float32:eager]
        --out benchmarks/results/cpu-DATE-engines
"""
import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

import gguf
from bench_embedded import EMBEDDED_BASE, LLAMA_SERVER_BASE, Side, git, machine_info, prompt_ids, ratio_row
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from autotune.bench import load_workload
from autotune.embedded import weights
from autotune.embedded.tokenizer import tokenizer_from_gguf
from autotune.engines import get_adapter
from autotune.engines.launcher import launch
from autotune.engines.llamacpp import INSTALL_HINT, find_binary

ENGINES = ("embedded", "llama-server", "vLLM")
# batch 1, no prefix cache (the selection sends a prompt twice), the context llama-server gets, 1 GiB of KV cache
VLLM_BASE = {"max_num_seqs": 1, "enable_prefix_caching": False, "max_model_len": 2048, "cpu_kvcache_space": 1}
VLLM_LOOKUP = {"prompt_lookup_min": 2, "prompt_lookup_max": 4}
DRAFTED, ACCEPTED = "vllm:spec_decode_num_draft_tokens_total", "vllm:spec_decode_num_accepted_tokens_total"
EOS_PROMPT = [{"role": "user", "content": "What is 2+2?"}]  # a short answer from all three (12-27 tokens)


class VLLMSide(Side):
    """A vLLM server: drafted / accepted tokens from the difference of its /metrics counters around a request."""

    def counters(self) -> dict[str, float]:
        found = {DRAFTED: 0.0, ACCEPTED: 0.0}
        for line in self.client.get("/metrics").text.splitlines():
            name = line.split("{")[0].split(" ")[0]
            if name in found:
                found[name] += float(line.rsplit(" ", 1)[1])
        return found

    def request(self, prompt_ids: list[int], tokens: int) -> dict:
        before = self.counters()
        run = super().request(prompt_ids, tokens)
        after = self.counters()
        run["drafted"], run["accepted"] = (int(after[k] - before[k]) for k in (DRAFTED, ACCEPTED))
        return run


def numerics(spec: str) -> dict:
    """"bfloat16:eager" -> vLLM's dtype and enforce_eager ("compiled": torch.compile, minutes at start)."""
    dtype, mode = spec.split(":")
    return {"dtype": dtype, "enforce_eager": mode == "eager"}


def eos_check(side: Side, ids: list[int], tokens: int) -> dict:
    """The same short prompt with and without ignore_eos: (tokens, finish_reason) of each."""
    out = {}
    for flag in (False, True):
        body = {"prompt": ids, "max_tokens": tokens, "temperature": 0.0, "ignore_eos": flag, "cache_prompt": False}
        reply = side.client.post("/v1/completions", json=body).raise_for_status().json()
        out[f"ignore_eos={flag}"] = [reply["usage"]["completion_tokens"], reply["choices"][0]["finish_reason"]]
    return out


def group_cpu(pid: int, seconds: float = 3.0) -> float:
    """CPU seconds per second a server's process group uses while idle (measured over `seconds`)."""
    def ticks():
        pids = subprocess.run(["pgrep", "-g", str(os.getpgid(pid))], capture_output=True, text=True,
                              check=False).stdout.split()
        total = 0
        for p in pids:
            try:
                fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
                total += int(fields[11]) + int(fields[12])
            except (FileNotFoundError, ProcessLookupError):
                pass
        return total
    first = ticks()
    time.sleep(seconds)  # a measurement window, not a wait for anything
    return (ticks() - first) / os.sysconf("SC_CLK_TCK") / seconds


def best(scores: dict, options: list) -> object:
    """The option with the best median score; a tie goes to the one listed first."""
    return max(options, key=lambda o: (statistics.median(scores[o]), -options.index(o)))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=1, help="compute threads of every server")
    p.add_argument("--tokens", type=int, default=96)
    p.add_argument("--select-prompts", type=int, default=2, help="selection prompts per workload")
    p.add_argument("--pairs", type=int, default=5, help="confirmation prompts per workload")
    p.add_argument("--ks", default="1,2,4", help="embedded n-gram draft_length values")
    p.add_argument("--llama-ngram", default="2:8,4:16,12:48", help="llama-server ngram-simple size_n:size_m pairs")
    p.add_argument("--vllm-ks", default="2,4,8", help="vLLM n-gram num_speculative_tokens (prompt_lookup 2..4)")
    p.add_argument("--vllm-plain", default="bfloat16:eager,float32:eager",
                   help="vLLM numerics candidates dtype:eager|compiled; n-gram servers use the chosen one")
    p.add_argument("--workloads", default="code,chat")
    p.add_argument("--seed", type=int, default=0, help="workload shuffle and bootstrap seed")
    p.add_argument("--out", default=f"benchmarks/results/cpu-{time.strftime('%Y-%m-%d')}-engines")
    args = p.parse_args()
    began, out, tokens = time.monotonic(), Path(args.out), args.tokens
    out.mkdir(parents=True, exist_ok=True)
    console = Console(width=160)
    binary, vllm = find_binary(), get_adapter("vllm")
    if not binary or not vllm.installed():
        raise SystemExit(f"need llama-server ({INSTALL_HINT}) and vLLM ({vllm.missing()})")
    commit, dirty = git("rev-parse", "HEAD"), git("status", "--porcelain").splitlines()
    path = weights.bundled_gguf_path()
    tokenizer = tokenizer_from_gguf({k: f.contents() for k, f in gguf.GGUFReader(path).fields.items()})
    info = machine_info(args.threads, binary) | {"vllm": "-".join(vllm.found), "vllm_model": vllm.default_model()}
    ks, vllm_ks = [int(k) for k in args.ks.split(",")], [int(k) for k in args.vllm_ks.split(",")]
    llama_ks = [tuple(int(v) for v in pair.split(":")) for pair in args.llama_ngram.split(",")]
    plain_options, names = args.vllm_plain.split(","), args.workloads.split(",")
    prompts = {}
    for name in names:
        ids = [prompt_ids(tokenizer, r) for r in load_workload(name, seed=args.seed).requests]
        prompts[name] = {"select": ids[:args.select_prompts],
                         "confirm": ids[args.select_prompts:args.select_prompts + args.pairs]}
    warm = prompts[names[0]]["select"][0]
    console.print(f"{path.name}, {args.threads} compute thread(s) per server, batch 1, greedy, {tokens} tokens; "
                  f"{info['cpu']}, {info['cores_visible']} cores, load {info['loadavg_start'][0]:.2f}. Numerics "
                  "differ: vLLM runs float weights dequantised from the GGUF, the other two its Q4_1 blocks.")

    sides, launches, idle_cpu = {}, [], {}

    def start(key, engine, config, cls=Side):
        t0 = time.monotonic()  # vLLM: model None = the adapter's HF copy of the bundled GGUF
        server = launch(get_adapter(engine), config, model=None if engine == "vllm" else str(path), timeout_s=1200,
                        log_path=out / "logs" / f"{key.replace(' ', '-').replace(':', '-')}.log")
        sides[key] = cls(key, engine, server)
        sides[key].request(warm, 16)  # allocator, kernel build, first-touch pages
        launches.append({"server": key, "engine": engine, "config": config, "argv": server.argv,
                         "launch_s": round(time.monotonic() - t0, 1)})
        progress.console.print(f"  {key}: up and warm in {launches[-1]['launch_s']:.0f} s")

    def stop(key):
        sides.pop(key).close()

    def stop_vllm_ngram():
        for key in [key for key in sides if key.startswith("vllm ngram")]:
            stop(key)

    def run(key, ids, extra=None):
        sides[key].extra = extra or {}
        result = sides[key].request(ids, tokens)
        progress.advance(task)
        return result

    per_select = 2 * len(ks) + 2 * len(llama_ks) + len(plain_options) + 2 * len(vllm_ks)
    total = sum(len(p["select"]) * per_select + len(p["confirm"]) * 6 for p in prompts.values())
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    selection, confirmation, rows, eos = {n: {} for n in names}, {}, [], {}
    with Progress(*columns, console=console) as progress:
        task = progress.add_task("launching", total=total)
        try:
            start("embedded plain", "embedded", EMBEDDED_BASE | {"threads": args.threads, "drafter": "none"})
            start("embedded ngram", "embedded", EMBEDDED_BASE | {"threads": args.threads, "drafter": "ngram"})
            llama_base = LLAMA_SERVER_BASE | {"threads": args.threads}
            start("llama plain", "llamacpp", llama_base)
            for n, m in llama_ks:  # idle servers wait for a request: no CPU taken from the one measured
                start(f"llama ngram {n}:{m}", "llamacpp", llama_base | {
                    "spec_type": "ngram-simple", "spec_ngram_simple_size_n": n, "spec_ngram_simple_size_m": m})
            vllm_base = VLLM_BASE | {"threads": args.threads}
            for option in plain_options:
                start(f"vllm plain {option}", "vllm", vllm_base | numerics(option), VLLMSide)
            eos_ids = tokenizer.encode(tokenizer.apply_chat_template(EOS_PROMPT))
            for key in ("embedded plain", "llama plain", f"vllm plain {plain_options[0]}"):
                eos[key] = eos_check(sides[key], eos_ids, tokens)
            idle_cpu = {key: round(group_cpu(side.server.proc.pid), 3) for key, side in sides.items()}
            progress.console.print(f"  ignore_eos: {eos}\n  idle CPU s/s per server: {idle_cpu}")

            # -- selection 1: embedded k, llama-server n:m (each vs its own plain just before), vLLM numerics
            scores = {("embedded", k): {n: [] for n in names} for k in ks}
            scores |= {("llama", k): {n: [] for n in names} for k in llama_ks}
            scores |= {("vllm plain", o): {n: [] for n in names} for o in plain_options}
            for name in names:
                progress.update(task, description=f"selection {name}")
                for i, ids in enumerate(prompts[name]["select"]):
                    steps = [("embedded", k) for k in ks] + [("llama", k) for k in llama_ks]
                    for engine, k in (steps[::-1] if i % 2 else steps):
                        plain, spec = (("embedded plain", "embedded ngram") if engine == "embedded"
                                       else ("llama plain", f"llama ngram {k[0]}:{k[1]}"))
                        a = run(plain, ids)
                        b = run(spec, ids, {"draft_length": k} if engine == "embedded" else None)
                        scores[(engine, k)][name].append(b["tok_s"] / a["tok_s"])
                        selection[name].setdefault(f"{engine} {k}", []).append(
                            {"tok_s": b["tok_s"], "plain_tok_s": a["tok_s"], "drafted": b["drafted"],
                             "accepted": b["accepted"], "same_text_as_plain": a["text"] == b["text"]})
                    turn = i % len(plain_options)
                    found = {o: run(f"vllm plain {o}", ids) for o in plain_options[turn:] + plain_options[:turn]}
                    for o in plain_options:
                        scores[("vllm plain", o)][name].append(found[o]["tok_s"] / found[plain_options[0]]["tok_s"])
                        selection[name].setdefault(f"vllm plain {o}", []).append({"tok_s": found[o]["tok_s"]})
            chosen = {n: {"embedded": best({k: scores[("embedded", k)][n] for k in ks}, ks),
                          "llama": best({k: scores[("llama", k)][n] for k in llama_ks}, llama_ks)} for n in names}
            every = {o: [r for n in names for r in scores[("vllm plain", o)][n]] for o in plain_options}
            vllm_plain = best(every, plain_options)  # one numerics for all workloads: the n-gram servers use it
            for o in plain_options:
                if o != vllm_plain:
                    stop(f"vllm plain {o}")
            sides["vllm plain"] = sides.pop(f"vllm plain {vllm_plain}")
            progress.console.print(f"  chosen: {chosen}; vLLM plain numerics {vllm_plain} "
                                   f"(median vs {plain_options[0]}: "
                                   f"{ {o: round(statistics.median(v), 3) for o, v in every.items()} })")

            # -- selection 2: vLLM k, one server at a time, each vs vLLM plain on the same prompt (order alternated)
            def vllm_spec(k):
                return vllm_base | numerics(vllm_plain) | VLLM_LOOKUP | {"speculative_method": "ngram",
                                                                         "num_speculative_tokens": k}
            for k in vllm_ks:
                progress.update(task, description=f"selection vLLM k={k}")
                stop_vllm_ngram()  # one n-gram vLLM at a time (memory); the last one stays for the confirmation
                start(f"vllm ngram k={k}", "vllm", vllm_spec(k), VLLMSide)
                scores[("vllm", k)] = {n: [] for n in names}
                for name in names:
                    for i, ids in enumerate(prompts[name]["select"]):
                        pair = ["vllm plain", f"vllm ngram k={k}"]
                        found = {key: run(key, ids) for key in (pair[::-1] if i % 2 else pair)}
                        a, b = found["vllm plain"], found[f"vllm ngram k={k}"]
                        scores[("vllm", k)][name].append(b["tok_s"] / a["tok_s"])
                        selection[name].setdefault(f"vllm {k}", []).append(
                            {"tok_s": b["tok_s"], "plain_tok_s": a["tok_s"], "drafted": b["drafted"],
                             "accepted": b["accepted"], "same_text_as_plain": a["text"] == b["text"]})
            for n in names:
                chosen[n]["vllm"] = best({k: scores[("vllm", k)][n] for k in vllm_ks}, vllm_ks)
            progress.console.print(f"  chosen n-gram settings: {chosen}")

            # -- confirmation: six servers rotated request by request on other prompts
            for w, name in enumerate(names):
                progress.update(task, description=f"confirmation {name}")
                k_e, k_l, k_v = (chosen[name][e] for e in ("embedded", "llama", "vllm"))
                if f"vllm ngram k={k_v}" not in sides:
                    stop_vllm_ngram()
                    start(f"vllm ngram k={k_v}", "vllm", vllm_spec(k_v), VLLMSide)
                settings = {("embedded", "plain"): ("embedded plain", None),
                            ("llama-server", "plain"): ("llama plain", None),
                            ("vLLM", "plain"): ("vllm plain", None),
                            ("embedded", "spec"): ("embedded ngram", {"draft_length": k_e}),
                            ("llama-server", "spec"): (f"llama ngram {k_l[0]}:{k_l[1]}", None),
                            ("vLLM", "spec"): (f"vllm ngram k={k_v}", None)}
                order, runs, loads = list(settings), {s: [] for s in settings}, []
                for i, ids in enumerate(prompts[name]["confirm"]):
                    turn = i % len(order)
                    for s in order[turn:] + order[:turn]:
                        key, extra = settings[s]
                        runs[s].append(run(key, ids, extra))
                    loads.append(os.getloadavg()[0])
                label = {"embedded": f"embedded n-gram k={k_e}", "llama-server": f"llama-server ngram-simple {k_l[0]}:{k_l[1]}",
                         "vLLM": f"vLLM n-gram k={k_v}"}
                med = {s: statistics.median(r["tok_s"] for r in runs[s]) for s in settings}
                seed = args.seed + 101 * w
                for e in ENGINES:
                    others = [o for o in ENGINES if o != e]
                    peer = max(others, key=lambda o: med[(o, "plain")])
                    peer_spec = max(others, key=lambda o: med[(o, "spec")])
                    for j, (text, a, b) in enumerate((
                            (f"plain: {e} / {peer} (fastest other plain)", (e, "plain"), (peer, "plain")),
                            (f"n-gram: {label[e]} / {label[peer_spec]} (fastest other n-gram)", (e, "spec"),
                             (peer_spec, "spec")),
                            (f"n-gram vs own plain: {label[e]} / {e} plain", (e, "spec"), (e, "plain")))):
                        rows.append(ratio_row(text, runs[a], runs[b], seed + 3 * ENGINES.index(e) + j) | {"workload": name})
                confirmation[name] = {
                    "chosen": {e: str(chosen[name][e]) for e in chosen[name]}, "loadavg_1min": loads,
                    "prompt_tokens": [len(ids) for ids in prompts[name]["confirm"]],
                    "tok_s": {f"{e} {s}": [r["tok_s"] for r in rs] for (e, s), rs in runs.items()},
                    "accept_rate": {e: sum(r["accepted"] for r in runs[(e, "spec")]) /
                                    max(1, sum(r["drafted"] for r in runs[(e, "spec")])) for e in ENGINES},
                    "spec_text_equals_plain": {e: sum(a["text"] == b["text"] for a, b in
                                                      zip(runs[(e, "spec")], runs[(e, "plain")])) for e in ENGINES},
                    "plain_text_equals_embedded_plain": {e: sum(a["text"] == b["text"] for a, b in zip(
                        runs[(e, "plain")], runs[("embedded", "plain")])) for e in ENGINES[1:]},
                    "texts": {f"{e} {s}": [r["text"] for r in rs] for (e, s), rs in runs.items()}}
        finally:
            for key in list(sides):
                stop(key)

    info["loadavg_end"] = os.getloadavg()
    seconds = round(time.monotonic() - began)
    table = Table(title=f"confirmation: median of {args.pairs} per-prompt ratios, 95% bootstrap interval "
                        f"({args.threads} thread(s), {tokens} tokens, batch 1, greedy)")
    for column in ("workload", "row", "a tok/s", "b tok/s", "a / b", "95% interval"):
        table.add_column(column)
    lines = ["| workload | row | a tok/s (median) | b tok/s (median) | a / b (median of ratios) | 95% interval |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        cells = [r["workload"], r["row"], f"{r['a_tok_s_median']:.1f}", f"{r['b_tok_s_median']:.1f}",
                 f"{r['median']:.2f}x", f"{r['interval_95'][0]:.2f}-{r['interval_95'][1]:.2f}x"]
        table.add_row(*cells)
        lines.append("| " + " | ".join(cells) + " |")
    console.print(table)
    for name, c in confirmation.items():
        console.print(f"{name}: n-gram text = own plain text {c['spec_text_equals_plain']} of {args.pairs}; plain "
                      f"text = embedded plain text {c['plain_text_equals_embedded_plain']}; accept rate "
                      f"{ {e: round(v, 2) for e, v in c['accept_rate'].items()} }")
    command = shlex.join(["python3", Path(sys.argv[0]).as_posix(), *sys.argv[1:]])
    result = {"command": command, "commit": commit, "dirty": dirty, "machine": info, "threads": args.threads,
              "tokens": tokens, "seconds": seconds, "model": {"gguf": path.name, "vllm": info["vllm_model"]},
              "measure": "client-side tok/s: completion tokens / wall seconds of one non-streaming /v1/completions "
                         "request (prompt included), the same token ids to every server",
              "ignore_eos_check": eos, "idle_cpu_s_per_s": idle_cpu, "launches": launches, "vllm_plain": vllm_plain,
              "selection": {"chosen": {n: {e: str(v) for e, v in c.items()} for n, c in chosen.items()},
                            "median_score": {n: {f"{e} {k}": statistics.median(v[n]) for (e, k), v in scores.items()}
                                             for n in names}, "runs": selection},
              "rows": rows, "confirmation": confirmation}
    (out / "results.json").write_text(json.dumps(result, indent=1) + "\n")
    launch_lines = [f"| {x['server']} | `{json.dumps(x['config'])}` | {x['launch_s']:.0f} |" for x in launches]
    picks = "; ".join(f"{n}: embedded k={c['embedded']}, llama-server {c['llama'][0]}:{c['llama'][1]}, vLLM "
                      f"k={c['vllm']}" for n, c in chosen.items())
    readme = [f"# vLLM, llama-server and the embedded engine on one CPU ({time.strftime('%Y-%m-%d')})", "",
              "```bash", command, "```", "",
              f"- **Commit** `{commit}`" + (f", tree dirty ({len(dirty)} paths, {sum(' autotune/' in d for d in dirty)} "
                                            "under autotune/: results.json `dirty`)" if dirty else ", clean tree")
              + f"; {seconds} s in all.",
              (f"- **Machine** {info['cpu']}, {info['cores_visible']} cores, shared with other work; load average "
               f"{info['loadavg_start'][0]:.2f} at the start, {info['loadavg_end'][0]:.2f} at the end; "
               f"{args.threads} compute thread(s) per server (HTTP and scheduling threads not counted). "
               f"llama-server build {info['llama_server_build']}, {info['vllm']}, torch {info['torch']}."),
              (f"- **Model** SmolLM2-135M: `{path.name}` (embedded `--quantization gguf`, llama-server); vLLM reads "
               "the HF copy of it (float32 weights dequantised from the same blocks). **The numerics differ**: vLLM "
               "computes on float weights, the other two on the 4-bit blocks, so texts differ too."),
              (f"- **Selection** (first {args.select_prompts} prompts per workload; not a result): vLLM plain "
               f"numerics `{vllm_plain}` of {plain_options}; {picks}."),
              (f"- **ignore_eos** on a short prompt, (tokens, finish) without / with: {eos}. llama-server honours it "
               "with a -inf logit bias on its end-of-generation tokens, the other two by generating past them: "
               "texts can part after the first end token, token counts do not."),
              f"- **Idle CPU** (CPU s per s, each server's processes while no request runs): {idle_cpu}.",
              (f"- **Load** (1-minute average) during the confirmation: "
               f"{ {n: [min(c['loadavg_1min']), max(c['loadavg_1min'])] for n, c in confirmation.items()} }."),
              "- **Texts**: " + "; ".join(
                  f"{n}: n-gram = own plain {c['spec_text_equals_plain']}, plain = embedded plain "
                  f"{c['plain_text_equals_embedded_plain']} of {args.pairs}" for n, c in confirmation.items()) + ".",
              "",
              "## Confirmation (other prompts; the reported numbers)", "", *lines, "",
              "## Launches (start to healthy, plus one 16-token warm-up request)", "",
              "| server | config | seconds |", "| --- | --- | --- |", *launch_lines, ""]
    (out / "README.md").write_text("\n".join(readme))
    console.print(f"wrote {out}/results.json, README.md; {seconds} s")


if __name__ == "__main__":
    main()
