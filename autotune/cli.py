"""The `autotune` command line: parses arguments, calls into the packages, prints.

Each command imports what it runs inside its function: `autotune --help` and a one-line error on bad
input must not wait for torch, the engines and plotly to load.
"""
import dataclasses
import time
from typing import Annotated

import typer

# Plain click help, not rich panels: a command's help fits a screen (rich's boxes take twice the lines) and
# text such as "[values]" is printed as written, not read as markup.
app = typer.Typer(
    no_args_is_help=True,
    add_completion=False,
    rich_markup_mode=None,
    context_settings={"max_content_width": 100},
    help="Find, prove and hand over the fastest launch configuration of a speculative-decoding LLM server. "
         "Studies live in ./studies of the working directory unless --studies-dir or $AUTOTUNE_STUDIES_DIR "
         "says otherwise.",
)


def _print_version(asked: bool) -> None:
    if asked:
        from autotune import __version__

        typer.echo(f"autotune {__version__}")
        raise typer.Exit()


def configure_output() -> None:
    """Logging, warning filters and Optuna's verbosity, set once for every command here; library
    modules leave them alone (a test calling them directly sees what Optuna says)."""
    import warnings

    import optuna

    from autotune.study.optuna_compat import ASK_WITH_HEARTBEAT_WARNING

    optuna.logging.set_verbosity(optuna.logging.WARNING)  # a line per trial would bury the live view
    # Our ask/tell runners beat themselves (study/parallel.py); Optuna's warning is meant for optimize() users.
    warnings.filterwarnings("ignore", message=ASK_WITH_HEARTBEAT_WARNING)
    # Study.set_metric_names (study/storage.py) is "experimental" to Optuna; the pinned version is tested here, and
    # the warning at the top of every run tells a user nothing they can act on.
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)


@app.callback()
def _options(version: bool = typer.Option(False, "--version", is_eager=True, callback=_print_version,
                                          help="Print the version and exit.")):
    configure_output()  # the options every command shares come before its name: only --version, so far


def _studies_dir_option():
    """--studies-dir, the same on every command that writes or reads studies."""
    return typer.Option(None, "--studies-dir", metavar="DIR",
                        help="studies' folder (default: $AUTOTUNE_STUDIES_DIR or ./studies)")


# -- autotune serve: the embedded engine ------------------------------------------------------------
from autotune.embedded import config as _engine_config  # dataclasses only: cheap to import

_SERVE_DEFAULTS = _engine_config.EngineConfig()
_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


def _serve_flag_error(device: str, port: int, log_level: str, threads: int | None) -> str | None:
    """The first serve-only flag the engine cannot start with (the engine validates its own config)."""
    if not (device in ("auto", "cpu", "cuda") or (device.startswith("cuda:") and device[5:].isdigit())):
        return f"--device must be auto, cpu, cuda or cuda:N, got {device!r}"
    if threads is not None and threads < 1:
        return f"--threads must be >= 1, got {threads}"
    if not 0 < port < 65536:
        return f"--port must be in 1..65535, got {port}"
    if log_level not in _LOG_LEVELS:
        return f"--log-level must be one of {', '.join(_LOG_LEVELS)}, got {log_level!r}"
    return None


@app.command()
def serve(
    model: str = typer.Option(None, help="GGUF file or HF directory (default: the bundled SmolLM2-135M)"),
    draft_model: str = typer.Option(None, help="draft checkpoint for --drafter draft_model (default: none)"),
    drafter: str = typer.Option(_SERVE_DEFAULTS.drafter, help=" | ".join(_engine_config.DRAFTERS)),
    draft_length: int = typer.Option(_SERVE_DEFAULTS.draft_length, help="tokens proposed per verify step (k)"),
    draft_policy: str = typer.Option(_SERVE_DEFAULTS.draft_policy, help=" | ".join(_engine_config.DRAFT_POLICIES)),
    draft_estimator: str = typer.Option(None, help="estimator.json/.py for --draft-policy estimator (default: none)"),
    draft_schedule: str = typer.Option(None, help="batch size -> draft length YAML/JSON, applied every step "
                                       "(default: none)"),
    early_exit_layers: int = typer.Option(_SERVE_DEFAULTS.early_exit_layers, help="layers for --drafter early_exit"),
    ngram_min: int = typer.Option(_SERVE_DEFAULTS.ngram_min, help="shortest prompt-lookup match"),
    ngram_max: int = typer.Option(_SERVE_DEFAULTS.ngram_max, help="longest prompt-lookup match"),
    verify_slots: int = typer.Option(_SERVE_DEFAULTS.verify_slots, help="sequences decoded together per step"),
    prefill_ubatch: int = typer.Option(_SERVE_DEFAULTS.prefill_ubatch, help="prompt tokens per prefill chunk"),
    dtype: str = typer.Option(_SERVE_DEFAULTS.dtype, help=" | ".join(_engine_config.DTYPES)),
    quantization: str = typer.Option(_SERVE_DEFAULTS.quantization, help=" | ".join(_engine_config.QUANTIZATIONS)),
    compile: str = typer.Option(_SERVE_DEFAULTS.compile, help=" | ".join(_engine_config.COMPILE_BACKENDS)),
    cuda_graph_batch_sizes: str = typer.Option("", help="CUDA graphs to capture, e.g. 1,2,4 (default: none)"),
    step_shape: str = typer.Option(_SERVE_DEFAULTS.step_shape, help=" | ".join(_engine_config.STEP_SHAPES)
                                   + " (fixed: one shape per step)"),
    step_attention: str = typer.Option(_SERVE_DEFAULTS.step_attention, help=" | ".join(_engine_config.STEP_ATTENTIONS)
                                       + " (auto: triton where it runs)"),
    prefill_graphs: str = typer.Option(_SERVE_DEFAULTS.prefill_graphs, help=" | ".join(_engine_config.PREFILL_GRAPHS)
                                       + " (on: prefill replays CUDA graphs too)"),
    threads: int = typer.Option(None, help="torch CPU threads (default: torch's)"),
    device: str = typer.Option(_SERVE_DEFAULTS.device, help="auto | cpu | cuda | cuda:N"),
    max_seq_len: int = typer.Option(_SERVE_DEFAULTS.max_seq_len, help="context length (KV cache per slot)"),
    seed: int = typer.Option(_SERVE_DEFAULTS.seed, help="seed of the engine's sampler"),
    host: str = typer.Option("127.0.0.1", help="address to bind"),
    port: int = typer.Option(30000, help="port to bind"),
    log_level: str = typer.Option("info", help=" | ".join(_LOG_LEVELS)),
    request_timeout: float = typer.Option(
        None, metavar="SECONDS", help="end a request this long after it came, finish_reason length "
        "(default: no limit)"),
):
    """Serve a model with autotune's own PyTorch speculative-decoding engine: OpenAI API, /health, /metrics."""
    options = dict(locals())  # the parsed flags: EngineConfig's fields by name, and the server's own
    try:
        graph_sizes = [int(s) for s in cuda_graph_batch_sizes.split(",") if s.strip()]
    except ValueError:
        graph_sizes = [0]
    problem = _serve_flag_error(device, port, log_level, threads)
    if any(s < 1 for s in graph_sizes):
        problem = f"--cuda-graph-batch-sizes must be positive integers like 1,2,4, got {cuda_graph_batch_sizes!r}"
    if request_timeout is not None and not 0 < request_timeout < float("inf"):
        problem = f"--request-timeout must be a positive number of seconds, got {request_timeout:g}"
    if problem:
        typer.echo(f"error: {problem}", err=True)
        raise typer.Exit(2)
    options["cuda_graph_batch_sizes"] = graph_sizes
    config = _engine_config.EngineConfig(**{f.name: options[f.name] for f in dataclasses.fields(_engine_config.EngineConfig)})

    import logging
    import os
    import sys

    import torch

    from autotune.embedded.scheduler import Engine
    from autotune.embedded.server import bind_error
    from autotune.embedded.server import serve as serve_engine

    if device.startswith("cuda") and not torch.cuda.is_available():
        typer.echo(f"error: --device {device}: no CUDA device is available here", err=True)
        raise typer.Exit(2)
    problem = bind_error(host, port)  # before the model load, not 20 s later
    if problem:
        typer.echo(f"error: {problem}", err=True)
        raise typer.Exit(1)
    logging.basicConfig(level=logging.DEBUG if log_level == "trace" else log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        engine = Engine(config)  # validates the config (one-line ValueError), then loads the model
    except (ValueError, OSError, RuntimeError) as e:  # bad model path, vocabulary mismatch, no CUDA...
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2)
    serve_engine(engine, host=host, port=port, log_level=log_level, request_timeout=request_timeout)
    # Shut down cleanly by now; skip interpreter teardown, which takes seconds once torch and uvicorn are loaded.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# -- autotune probe: what the machine is -------------------------------------------------------------
@app.command()
def probe(
    json_output: bool = typer.Option(False, "--json", help="print JSON instead of tables"),
    gpu: str = typer.Option("auto", help="auto (measure this machine) | cpu | a hardware profile name (plan for it)"),
):
    """Report the GPUs, driver, CPU and hardware profile, each fact with its evidence."""
    from autotune.hardware import probe as probe_hardware

    try:
        hardware = probe_hardware(gpu)
    except ValueError as e:  # unknown profile name, or a broken profile file
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2)
    if json_output:
        import json

        typer.echo(json.dumps(hardware.to_dict(), indent=2))
        return
    from rich.console import Console

    from autotune.hardware.show import tables

    console = Console()
    for table in tables(hardware):
        console.print(table)
    for warning in hardware.warnings:
        console.print(f"[yellow]warning:[/] {warning}")
    for note in hardware.notes:
        console.print(f"[dim]note: {note}[/]")


# -- autotune run: the tuner --------------------------------------------------------------------------
@app.command()
def run(
    gpu: str = typer.Option("auto", help="auto (this machine) | cpu | a hardware profile"),
    engine: str = typer.Option("embedded", help="embedded | llamacpp | sglang | vllm"),
    engine_binary: str = typer.Option(None, help="your llama-server (llamacpp) or a vLLM env's Python (vllm) "
                                                 "(default: the one bash setup.sh ENGINE made)"),
    model: str = typer.Option(None, help="GGUF file or HF directory (default: the bundled SmolLM2-135M)"),
    draft_model: str = typer.Option(None, help="draft checkpoint: adds drafter=draft_model (default: none)"),
    workload: str = typer.Option("code", help="chat, code, mixed, ... or a JSONL/ShareGPT file"),
    slo: str = typer.Option(None, help='e.g. "p95_ttft_ms<500; p95_itl_ms<=40" (default: none)'),
    objective: str = typer.Option("throughput", help="throughput | latency | pareto"),
    trials: int = typer.Option(None, help="measured trials at most (default 25, none with --budget)"),
    budget: str = typer.Option(None, help="wall clock of the whole run, e.g. 30m, 1h (default: the engine's)"),
    study: str = typer.Option(None, help="study name (default: <engine>-<workload>-<time>)"),
    studies_dir: str = _studies_dir_option(),
    storage: str = typer.Option(None, help="Optuna storage URL (default: sqlite in the study's directory)"),
    resume: bool = typer.Option(False, help="continue --study (killed trials: failed)"),
    set_: Annotated[list[str] | None, typer.Option(
        "--set", metavar="NAME=VALUE", help="name=value | name=a,b | name=low..high (default: none)")] = None,
    space: str = typer.Option(None, help="a space YAML or a narrowing file (default: the engine's space)"),
    concurrency: int = typer.Option(None, help="requests in flight per benchmark (default: the engine's load)"),
    num_requests: int = typer.Option(None, help="least requests per benchmark (default: the engine's, per stream)"),
    max_tokens: int = typer.Option(None, help="output tokens per request at most (default: the engine's load)"),
    min_measure: float = typer.Option(10.0, help="min seconds a benchmark lasts (0: as asked)"),
    load_profile: str = typer.Option(None, help='every benchmark runs these phases, e.g. "ramp" or "1:20s,4:20s"; '
                                                "objective: throughput pooled over them (default: one load)"),
    seed: int = typer.Option(0, help="seed of the sampler and the benchmark"),
    parallel: str = typer.Option("1", help="trials side by side: auto | N"),
    plan_only: bool = typer.Option(False, "--plan", help="print the plan (space, load, budget, first trials); "
                                                         "launch nothing"),
    estimator: bool = typer.Option(True, help="then fit the draft-length estimator"),
    fit_schedule: bool = typer.Option(False, help="then fit the winner a batch size -> draft length schedule "
                                                  "(always when --load-profile varies the concurrency)"),
):
    """Tune an engine's launch configuration here (Optuna), validate the best, export best/launch.sh, report."""
    started = time.time()  # --budget counts from here: probing, trials, validation, estimator, report
    from rich.console import Console

    from autotune import pipeline
    from autotune.study import loop, plan

    try:
        opts = plan.options_from_cli(
            engine=engine, model=model, draft_model=draft_model, workload=workload, slo=slo, objective=objective,
            trials=trials, budget=budget, study=study, storage=storage, resume=resume, sets=set_ or [], space=space,
            concurrency=concurrency, num_requests=num_requests, max_tokens=max_tokens, min_measure_s=min_measure,
            gpu=gpu, seed=seed, studies_root=studies_dir,
            parallel=parallel, engine_binary=engine_binary, load_profile=load_profile, fit_schedule=fit_schedule)
        if not plan_only:  # the first second shows a phase, however long probing and the model take
            typer.echo(f"probing: this machine, {engine} and the model")
        the_plan = plan.build(opts)
        if plan_only:
            typer.echo("\n".join(plan.describe(the_plan, loop.planned_queue(the_plan))))
            return
        budget = pipeline.run_budget(the_plan, estimator=estimator, start=started)
        outcome = loop.run_study(the_plan, console=Console(), budget=budget)
    except (ValueError, OSError) as e:  # bad input: nothing in the study was touched
        typer.echo(f"error: {str(e).splitlines()[0] if str(e) else type(e).__name__}", err=True)
        raise typer.Exit(2)
    if outcome.interrupted and outcome.best is None:
        raise typer.Exit(130)
    if outcome.best is None:
        raise typer.Exit(1)
    if not outcome.interrupted:  # prove the winner on fresh launches, hand it over, explain it
        try:
            done = pipeline.finish(outcome.directory, outcome.storage, run_options=opts, estimator=estimator,
                                   budget=budget, settings=pipeline.run_settings(the_plan))
        except KeyboardInterrupt:
            typer.echo(f"error: validation interrupted; the study is kept in {outcome.directory}", err=True)
            raise typer.Exit(130)
        if done["estimator"]:
            typer.echo(f"draft-length estimator: {done['estimator']}")
        for line in pipeline.closing_lines(done, outcome.directory, outcome.storage, budget):  # what was exported, last
            typer.echo(line)


# -- autotune worker: more hands for a study in a shared storage -----------------------------------------
@app.command()
def worker(
    study: str = typer.Option(..., help="name of the study to join (made by autotune run --storage URL)"),
    storage: str = typer.Option(..., help="its storage: postgresql://.., mysql://.., sqlite:///.. or a journal file"),
    parallel: str = typer.Option("auto", help="trials side by side on this machine: auto | N"),
    trials: int = typer.Option(None, help="stop once the study holds this many measured trials (default: the study's)"),
    budget: str = typer.Option(None, help="this worker's wall clock, e.g. 2h (default: what is left of the study's)"),
    gpu: str = typer.Option("auto", help="auto (this machine) | cpu | a hardware profile"),
    studies_dir: str = _studies_dir_option(),
):
    """Join a study from this or another machine and run its trials.

    Runs until the study holds its trial count or its budget is spent; logs go to the study's directory."""
    from rich.console import Console

    from autotune.study import worker as joiner

    try:
        outcome = joiner.join(study, storage, parallel=parallel, trials=trials, budget=budget, gpu=gpu,
                              studies_root=studies_dir, console=Console())
    except (ValueError, OSError) as e:
        typer.echo(f"error: {str(e).splitlines()[0] if str(e) else type(e).__name__}", err=True)
        raise typer.Exit(2)
    if outcome.interrupted:
        raise typer.Exit(130)


# -- autotune bench: load an OpenAI-compatible server, measure it ---------------------------------------
@app.command()
def bench(
    url: str = typer.Option(..., help="server base URL, e.g. http://127.0.0.1:30000"),
    workload: str = typer.Option("chat", help="shipped set (chat, code, long-prefill, repetitive, mixed) "
                                              "or a .jsonl of OpenAI bodies / ShareGPT .json"),
    concurrency: int = typer.Option(None, help="closed loop: requests in flight (default 1); with --rate: a cap"),
    rate: float = typer.Option(None, help="open loop: Poisson arrivals per second, inf: all at once (default: closed)"),
    sweep: str = typer.Option(None, help="concurrency levels, one run each, e.g. 1,2,4,8 (default: --concurrency)"),
    duration: float = typer.Option(None, help="stop sending after this many seconds (default: no limit)"),
    num_requests: int = typer.Option(None, help="stop after this many requests (default: one pass over the workload)"),
    warmup: int = typer.Option(0, help="requests sent first and not measured"),
    seed: int = typer.Option(0, help="workload order and arrival times"),
    max_tokens: int = typer.Option(None, help="every request's max_tokens (default: the workload's)"),
    slo: str = typer.Option(None, help='e.g. "p95_ttft_ms<500; error_rate<0.01" (default: none)'),
    out: str = typer.Option(None, help="results .json, rows also in the .parquet beside it (default: none)"),
    api: str = typer.Option(None, help="send every request as chat | completions (default: as the workload says)"),
    model: str = typer.Option(None, help="model name to send (default: the first one /v1/models lists)"),
    server_pid: int = typer.Option(None, help="server process id, for its peak RSS (default: none)"),
    request_timeout: float = typer.Option(120.0, help="seconds one request may take in all"),
    ignore_eos: bool = typer.Option(True, help="ask the server to run to max_tokens (vLLM/SGLang extension)"),
    extra_body: str = typer.Option(None, help='JSON merged into every request, e.g. \'{"draft_length": 2}\' '
                                              "(default: none)"),
    load_profile: str = typer.Option(None, help='phases back to back, e.g. "1:20s,4:20s,8:64req", "2/s:30s", '
                                                '"ramp:1-16:60s" or "ramp" (default: none)'),
):
    """Benchmark an OpenAI-compatible server.

    TTFT, ITL, TPOT, E2E, throughput, goodput and the server's acceptance."""
    import json

    from rich.console import Console

    from autotune.bench import load_workload, parse_slo, run_sweep, save_results, summary_table

    try:
        levels = [int(x) for x in sweep.split(",") if x.strip()] if sweep else [concurrency]
        if sweep and (not levels or min(levels) < 1):
            raise ValueError
    except ValueError:
        typer.echo(f"error: --sweep must be positive integers like 1,2,4,8, got {sweep!r}", err=True)
        raise typer.Exit(2)
    try:
        extra = json.loads(extra_body) if extra_body else None
        if extra is not None and not isinstance(extra, dict):
            raise ValueError("not an object")
    except ValueError as e:
        typer.echo(f"error: --extra-body must be a JSON object: {e}", err=True)
        raise typer.Exit(2)
    if api not in (None, "chat", "completions"):
        typer.echo(f"error: --api must be chat or completions, got {api!r}", err=True)
        raise typer.Exit(2)
    if load_profile and any(v is not None for v in (concurrency, rate, sweep, duration, num_requests)):
        typer.echo("error: --load-profile sets the load and length of each phase: drop --concurrency, --rate, "
                   "--sweep, --duration and --num-requests", err=True)
        raise typer.Exit(2)
    console = Console()
    try:
        loaded = load_workload(workload, seed)
        parsed_slo = parse_slo(slo) if slo else None
        if out and not out.endswith(".json"):
            raise ValueError(f"--out must name a .json file (the .parquet is written beside it), got {out!r}")
        d = loaded.describe()
        console.print(f"workload {d['name']}: {d['requests']} requests {d['apis']}, prompt chars mean "
                      f"{d['prompt_chars_mean']} ({d['prompt_chars_min']}..{d['prompt_chars_max']}), max_tokens "
                      f"mean {d['max_tokens_mean']}, temperatures {d['temperatures']}")
        if load_profile:
            return _bench_profile(console, url, loaded, load_profile, out, warmup=warmup, seed=seed,
                                  max_tokens=max_tokens, slo=parsed_slo, server_pid=server_pid,
                                  request_timeout=request_timeout, extra_body=extra, model=model, api=api,
                                  ignore_eos=ignore_eos)
        results = run_sweep(url, loaded, levels, rate=rate, num_requests=num_requests, duration=duration,
                            warmup=warmup, seed=seed, max_tokens=max_tokens, slo=parsed_slo, server_pid=server_pid,
                            request_timeout=request_timeout, extra_body=extra, model=model, api=api,
                            ignore_eos=ignore_eos)
    except ValueError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2)
    except KeyboardInterrupt:
        typer.echo("error: interrupted", err=True)
        raise typer.Exit(130)
    console.print(summary_table(results))
    if out:
        paths = save_results(results, out)
        console.print(f"wrote {paths[0]} and {paths[1]}")
    if not any(r.summary["completed"] for r in results):
        typer.echo(f"error: no request completed: {results[-1].summary['errors_by_kind']}", err=True)
        raise typer.Exit(1)


def _bench_profile(console, url, workload, spec: str, out: str | None, **kwargs):
    """`autotune bench --load-profile`: the phases back to back, a row each, then the pooled line."""
    from autotune.bench import BenchResult, save_results
    from autotune.bench.load_profile import parse_load_profile
    from autotune.bench.runner import overall_line, phase_table, run_profile

    result = run_profile(url, workload, parse_load_profile(spec), **kwargs)
    console.print(phase_table(result))
    console.print(overall_line(result.summary))
    if out:
        paths = save_results([BenchResult(result.requests, result.summary)], out)
        console.print(f"wrote {paths[0]} and {paths[1]}")
    if not result.summary["completed"]:
        typer.echo(f"error: no request completed: {result.summary['errors_by_kind']}", err=True)
        raise typer.Exit(1)


# -- autotune estimate: predicted memory and speed, ranked, before any launch ------------------------------
@app.command()
def estimate(
    model: str = typer.Option(..., help="a preset (e.g. llama-3.1-8b, qwen3-32b), an HF checkpoint dir or a .gguf file"),
    gpu: str = typer.Option("auto", help="auto (this machine) | cpu | a hardware profile name"),
    num_gpus: int = typer.Option(None, help="GPUs to plan for (default: this machine's count, or 1 for a profile)"),
    engine: str = typer.Option("sglang", help="sglang | vllm | llamacpp | embedded"),
    draft_model: str = typer.Option(None, help="draft checkpoint or EAGLE head, for the drafters that need one "
                                               "(default: none)"),
    draft_kind: str = typer.Option(None, help="eagle | eagle3 | dflash | standalone: what --draft-model is "
                                   "(default: read from its config.json)"),
    alpha: float = typer.Option(None, help="a flat per-token draft acceptance in (0, 1) (default: the drafter family's per-position prior, fitted to published accept lengths: autotune/data/acceptance.yaml)"),
    concurrency: int = typer.Option(1, help="concurrent streams to rank by (1 = single stream)"),
    context_len: int = typer.Option(None, help="tokens one sequence must fit (default 4096; embedded: 2048)"),
    top: int = typer.Option(10, help="configurations to show"),
    set_: Annotated[list[str] | None, typer.Option(
        "--set", metavar="NAME=VALUE", help="as for run: name=value | name=a,b | name=low..high (default: none)")] = None,
    space: str = typer.Option(None, help="a space YAML or a narrowing file (default: the engine's space)"),
    json_output: bool = typer.Option(False, "--json", help="print JSON instead of a table"),
):
    """Rank an engine's configurations by PREDICTED speed and memory, launching nothing."""
    from autotune.engines import get_adapter
    from autotune.predict.report import estimate_report
    from autotune.study.plan import user_space

    try:
        adapter = get_adapter(engine)
        text = estimate_report(model=model, gpu=gpu, num_gpus=num_gpus, engine=adapter,
                               draft_model=draft_model, draft_kind=draft_kind, alpha=alpha, concurrency=concurrency,
                               context_len=context_len, top=top, as_json=json_output,
                               space=user_space(adapter, space, set_ or [], model))
    except ValueError as e:
        typer.echo(f"error: {str(e).splitlines()[0]}", err=True)
        raise typer.Exit(2)
    typer.echo(text)


# -- autotune validate / export / report / show: what a study hands over ------------------------------
_STUDY_HELP = "study name (under --studies-dir) or its directory"
_STORAGE_HELP = "Optuna storage URL (default: sqlite in the study's directory)"


def _study_ref(study: str, studies_dir: str | None) -> str:
    """STUDY as the readers take it: with --studies-dir, the study of that name there (an absolute path stays)."""
    if not studies_dir:
        return study
    from autotune.study import storage as store

    return str(store.study_dir(study, studies_dir))


def _number(value: float | None, width: int = 0) -> str:
    """value to 3 decimals, or '-' where there is none (a modelled speed for a k the fit never measured)."""
    return ("-" if value is None else f"{value:.3f}").rjust(width)


def _fail(e: BaseException, code: int = 2):
    typer.echo(f"error: {str(e).splitlines()[0] if str(e) else type(e).__name__}", err=True)
    raise typer.Exit(code)


from autotune.validate.settings import ValidationSettings  # pydantic only: cheap to import at start-up

_VALIDATION = ValidationSettings()


@app.command()
def validate(
    study: str = typer.Argument(..., help=_STUDY_HELP),
    top: int = typer.Option(None, help=f"best distinct configurations to relaunch [default: {_VALIDATION.top}]"),
    repeats: int = typer.Option(None, help=f"benchmarks of each, on one fresh server [default: {_VALIDATION.repeats}]"),
    studies_dir: str = _studies_dir_option(),
    storage: str = typer.Option(None, help=_STORAGE_HELP),
    slo: str = typer.Option(None, help="SLO to re-check on every repeat (default: the study's)"),
    max_noise: float = typer.Option(
        None, help=f"demote when the objective's MAD exceeds this share of its median [default: {_VALIDATION.max_noise}]"),
    quality_prompts: int = typer.Option(
        None, help=f"greedy prompts compared with the baseline [default: {_VALIDATION.quality_prompts}]"),
    quality_tokens: int = typer.Option(
        None, help=f"tokens generated per greedy prompt [default: {_VALIDATION.quality_tokens}]"),
    concurrency: int = typer.Option(None, help="requests in flight (default: the study's load)"),
    num_requests: int = typer.Option(None, help="requests per benchmark (default: the study's load)"),
    max_tokens: int = typer.Option(None, help="output tokens per request at most (default: the study's load)"),
):
    """Relaunch the study's best configurations fresh and pick the winner.

    Benchmarks each several times, compares greedy outputs with the defaults', writes best/validation.json."""
    from autotune.validate.run import validate as validate_study

    given = {"top": top, "repeats": repeats, "max_noise": max_noise, "quality_prompts": quality_prompts,
             "quality_tokens": quality_tokens}  # unset: the defaults (the [default] in the help)
    try:
        doc = validate_study(_study_ref(study, studies_dir), storage=storage, slo=slo,
                             settings=_VALIDATION.updated(given),
                             load={"concurrency": concurrency, "num_requests": num_requests, "max_tokens": max_tokens})
    except (ValueError, OSError) as e:
        _fail(e)
    except KeyboardInterrupt:
        _fail(RuntimeError("interrupted"), 130)
    for c in doc.candidates:
        s = c.stats.get(doc.metric)
        median = f"{s.median:.4g} (MAD {s.rel_mad:.1%})" if s and s.median is not None else "-"
        typer.echo(f"trial {c.trial}: {c.status} {doc.metric} median {median}"
                   + (f": {'; '.join(r.text for r in c.reasons)}" if c.reasons else ""))
    if doc.winner is None:
        typer.echo("error: no configuration passed validation", err=True)
        raise typer.Exit(1)
    gain = doc.winner.gain_over_baseline
    typer.echo(f"winner: trial {doc.winner.trial}" + (f", {gain:.2f}x the baseline" if gain else "")
               + (f" (warning: {doc.winner.warning})" if doc.winner.warning else ""))


@app.command()
def export(
    study: str = typer.Argument(..., help=_STUDY_HELP),
    format: str = typer.Option("all", "--format", help="sh | yaml | json | docker | all (comma-separated)"),
    out: str = typer.Option(None, help="directory (default: the study's best/)"),
    studies_dir: str = _studies_dir_option(),
    storage: str = typer.Option(None, help=_STORAGE_HELP),
):
    """Write the winner to best/: launch.sh, config.yaml, launch.json, docker-run.sh.

    With provenance.json: where its numbers came from."""
    from autotune import export as exporter

    formats = exporter.FORMATS if format == "all" else tuple(f.strip() for f in format.split(",") if f.strip())
    try:
        paths = exporter.export(_study_ref(study, studies_dir), storage=storage, formats=formats, out=out)
    except (ValueError, OSError) as e:
        _fail(e)
    for path in paths:
        typer.echo(str(path))


@app.command()
def report(
    study: str = typer.Argument(..., help=_STUDY_HELP),
    out: str = typer.Option(None, help="HTML file (default: the study's report.html)"),
    png: bool = typer.Option(True, help="PNG copies of the key plots (needs Chrome/Chromium)"),
    studies_dir: str = _studies_dir_option(),
    storage: str = typer.Option(None, help=_STORAGE_HELP),
):
    """Write the study's self-contained HTML report (and PNGs of the key plots)."""
    from autotune import report as reporter

    try:
        path = reporter.write_report(_study_ref(study, studies_dir), storage=storage, out=out, png=png)
    except (ValueError, OSError) as e:
        _fail(e)
    typer.echo(str(path))


@app.command()
def show(
    study: str = typer.Argument(..., help=_STUDY_HELP),
    studies_dir: str = _studies_dir_option(),
    storage: str = typer.Option(None, help=_STORAGE_HELP),
):
    """Print a study's summary: winner, gain, top configurations, failures."""
    from autotune import report as reporter

    try:
        reporter.show(_study_ref(study, studies_dir), storage=storage)
    except (ValueError, OSError) as e:
        _fail(e)


# -- autotune ci: re-check (and re-tune) after the environment changed --------------------------------
@app.command()
def ci(
    study: str = typer.Argument(..., help=_STUDY_HELP),
    tolerance: str = typer.Option("5%", help="allowed loss of the objective before re-tuning, e.g. 5% or 0.05"),
    retune_budget: str = typer.Option("20m", help="wall-clock budget of the re-tune, e.g. 20m, 1h"),
    retune_trials: int = typer.Option(25, help="measured trials of the re-tune at most"),
    force: bool = typer.Option(False, help="re-check even when the environment is unchanged"),
    json_output: bool = typer.Option(False, "--json", help="print the result as JSON on stdout"),
    studies_dir: str = _studies_dir_option(),
    storage: str = typer.Option(None, help=_STORAGE_HELP),
):
    """Re-check the exported best after a driver, CUDA, torch or engine change.

    Re-tunes (into the study's ci/ folder) when it broke or fell behind; exit 1 then."""
    import json as _json

    from rich.console import Console

    from autotune import ci as checker
    from autotune.study.plan import parse_duration

    try:
        share = checker.parse_tolerance(tolerance)
        try:
            budget_s = parse_duration(retune_budget)
        except ValueError:
            raise ValueError(f"--retune-budget {retune_budget!r}: expected a duration such as 90s, 20m, 1h") from None
        if retune_trials < 1:
            raise ValueError("--retune-trials must be at least 1")
        result = checker.check(_study_ref(study, studies_dir), storage=storage, tolerance=share, retune_budget_s=budget_s,
                               retune_trials=retune_trials, force=force, console=Console(stderr=True))
    except (ValueError, OSError) as e:
        _fail(e)
    except KeyboardInterrupt:
        _fail(RuntimeError("interrupted"), 130)
    if json_output:
        typer.echo(_json.dumps(result, indent=2, default=str))
    else:
        for line in checker.describe(result):
            typer.echo(line)
    raise typer.Exit(result["exit_code"])

# -- autotune bundle: an engine's wheels for an offline (air-gapped) machine --------------------------
from autotune.bundle.command import bundle  # grouped with its command, as serve's config is

app.command()(bundle)

# -- autotune estimator fit / eval: the per-request draft-length estimator ------------------------------
estimator_app = typer.Typer(no_args_is_help=True, help="Fit and evaluate the runtime draft-length estimator.")
app.add_typer(estimator_app, name="estimator")


def _study_path(study: str, studies_dir: str | None):
    from pathlib import Path

    from autotune.study import storage as store

    return Path(study) if not studies_dir and Path(study).is_dir() else store.study_dir(study, studies_dir)


def _estimator_errors():
    import httpx

    from autotune.engines.launcher import LaunchError

    return ValueError, OSError, KeyError, LaunchError, httpx.HTTPError


@estimator_app.command("fit")
def estimator_fit(
    study: str = typer.Argument(..., help=_STUDY_HELP + " (fitted on its requests/trial-N.parquet)"),
    studies_dir: str = _studies_dir_option(),
    out: str = typer.Option(None, help="where estimator.json and draft_length_estimator.py go (default: the study's dir)"),
    collect: bool = typer.Option(True, help="without per-request data in the study, collect it on a live embedded server"),
    drafter: str = typer.Option("ngram", help="drafter of the collection pass"),
    data: str = typer.Option(None, help="a parquet of per-request rows to fit on (default: the study's rows)"),
    stop_rule: bool = typer.Option(True, help="fit the runtime stop rule too (a short traced pass on the embedded "
                                   "engine where the rows carry no proposal traces)"),
):
    """Fit the per-request draft-length cap and the runtime stop rule.

    The cap: k per prompt-feature bucket x temperature band; the stop rule: from each proposed token's draft
    entropy and acceptance. Writes estimator.json and the standalone draft_length_estimator.py."""
    from pathlib import Path

    import pandas as pd

    from autotune import estimator as est

    directory = _study_path(study, studies_dir)
    if not data and not directory.is_dir():  # else a collection pass would start for a study that is not there
        _fail(ValueError(f"no study {study!r}: {directory} does not exist"))
    try:
        if data:
            rows = pd.read_parquet(data)
            fitted = est.fit(rows, source=f"rows {data}")
            fitted.info["engine_config"] = {"drafter": drafter, "draft_length": int(rows["k"].mode()[0])}
            path = fitted.write(Path(out or directory))
        else:
            path = est.fit_from_study(directory, out, collect_if_missing=collect,
                                      config={"drafter": drafter, "draft_length": 4}, stop_rule=stop_rule)
    except _estimator_errors() as e:
        _fail(e)
    except KeyboardInterrupt:
        _fail(RuntimeError("interrupted"), 130)
    doc = __import__("json").loads(path.read_text())
    quality = ", ".join(f"{n} {q['spearman']}" for n, q in doc["feature_quality"].items() if q["spearman"] is not None)
    typer.echo(f"fitted on {doc['requests']} requests ({doc['source']}); Spearman vs alpha: {quality or 'n/a'}")
    typer.echo(f"feature {doc['feature']} (fallback {doc['fallback_feature']}), thresholds {doc['thresholds']}, "
               f"c = {doc['c']} ({doc['c_from']})")
    for cell in doc["buckets"]:
        typer.echo(f"  temperature {cell['temperature']} {doc['feature']} {cell[doc['feature']]}: "
                   f"{cell['requests']} requests, alpha {cell['alpha']} ({cell['alpha_from']}), k {cell['k']}")
    rule = doc.get("stop_rule")
    if rule:
        typer.echo(f"stop rule: draft {rule['signal']} above {rule['thresholds']} (per temperature band; null: never), "
                   f"AUC {rule['auc']} on {rule['tokens']} tokens, replayed speedup over plain {rule['expected_speedup']}")
        for engine, applied in doc["engine_settings"].items():
            typer.echo(f"  {engine} {applied['version']}: {applied['settings']}; not applied: {applied['not_applied']}")
    typer.echo(f"wrote {path} and {path.with_name('draft_length_estimator.py')}")


@estimator_app.command("eval")
def estimator_eval(
    estimator: str = typer.Option(None, help="estimator.json (default: the study's)"),
    study: str = typer.Option(None, help=_STUDY_HELP + " (default: none; give it or --estimator)"),
    studies_dir: str = _studies_dir_option(),
    workload: str = typer.Option("mixed", help="held-out workload (shipped name or JSONL)"),
    fixed: str = typer.Option(None, help="fixed draft lengths to compare, e.g. 2,4,6 (default: the table's k and the config's)"),
    repeats: int = typer.Option(2, help="passes over the workload (median)"),
    max_tokens: int = typer.Option(32, help="cap on output tokens per request"),
    limit: int = typer.Option(None, help="first N requests of the workload only (default: all)"),
    out: str = typer.Option(None, help="directory for eval.json and the server log (default: next to the estimator)"),
):
    """Measure the estimator against the best fixed draft length, on one server.

    Requests alternate between the two; greedy outputs must match."""
    from pathlib import Path

    from autotune import estimator as est

    if not estimator and not study:
        _fail(ValueError("give --estimator FILE or --study STUDY"))
    path = Path(estimator) if estimator else _study_path(study, studies_dir) / "estimator.json"
    try:
        ks = [int(k) for k in fixed.split(",")] if fixed else None
        if repeats < 1 or max_tokens < 1:
            raise ValueError("--repeats and --max-tokens must be >= 1")
        doc = est.evaluate(path, Path(out) if out else path.parent / "estimator-eval", workload=workload, fixed=ks,
                           repeats=repeats, max_tokens=max_tokens, limit=limit)
    except _estimator_errors() as e:
        _fail(e)
    except KeyboardInterrupt:
        _fail(RuntimeError("interrupted"), 130)
    best = doc["best_fixed"]
    typer.echo("tok/s (all repeats pooled): " + ", ".join(f"{a} {v:.2f}" for a, v in doc["tok_s"].items()))
    typer.echo("modelled tokens per verify-step time (engine counters, c = fitted): "
               + ", ".join(f"{a} {_number(v)}" for a, v in doc["modelled_speed"].items()))
    typer.echo(f"{'band':>4} {'bucket':>6} {'reqs':>4} {'k':>2} {'alpha':>6} {'estimator':>9} {best:>9} {'ratio':>6} "
               f"{'modelled':>8}")
    for r in doc["buckets"]:
        alpha = f"{r['alpha']:.3f}" if r["alpha"] is not None else "-"
        typer.echo(f"{r['band']:>4} {r['bucket']:>6} {r['requests']:>4} {r['k']:>2} {alpha:>6} "
                   f"{r['estimator_tok_s']:>9.2f} {r[best + '_tok_s']:>9.2f} {r['ratio']:>6.3f} {_number(r['modelled_ratio'], 8)}")
    low, high = doc["gain_interval_90"]
    typer.echo(f"estimator vs best fixed ({best}): {doc['gain']:+.1%} (90% bootstrap {low:+.1%}..{high:+.1%}; median "
               f"paired per-request ratio {doc['paired_ratio_median']:.3f}) over {doc['requests']} requests x {doc['repeats']}")
    if doc["greedy_outputs_differ"]:
        typer.echo(f"error: greedy outputs differ from {best} on requests {doc['greedy_outputs_differ']}", err=True)
        raise typer.Exit(1)
    typer.echo(f"greedy outputs identical on all {doc['greedy_requests']} temperature-0 requests")


def main() -> None:
    """Console entry point: a usage error (bad flag, wrong type) is one line on stderr and exit 2."""
    from typer._click import exceptions as click_errors  # typer vendors its own click

    try:
        code = app(standalone_mode=False)
    except click_errors.NoArgsIsHelpError as e:
        typer.echo(e.format_message(), err=True)
        raise SystemExit(2)
    except click_errors.UsageError as e:
        command = e.ctx.command_path if e.ctx else "autotune"
        typer.echo(f"error: {e.format_message()} (see: {command} --help)", err=True)
        raise SystemExit(2)
    raise SystemExit(code or 0)


if __name__ == "__main__":
    main()
