"""The `autotune` command line: parses arguments, calls into the packages, prints."""
import typer

app = typer.Typer(no_args_is_help=True, add_completion=False, help=__doc__)


# -- autotune serve: the embedded engine ------------------------------------------------------------
from autotune.embedded import config as _engine_config  # noqa: E402  (dataclasses only: cheap)

_SERVE_DEFAULTS = _engine_config.EngineConfig()
_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


def _serve_config_error(config, host: str, port: int, log_level: str) -> str | None:
    """The first flag value the engine cannot start with, as a message; None when all are fine."""
    choices = {"drafter": _engine_config.DRAFTERS, "draft_policy": _engine_config.DRAFT_POLICIES,
               "dtype": _engine_config.DTYPES, "quantization": _engine_config.QUANTIZATIONS,
               "compile": _engine_config.COMPILE_BACKENDS}
    for name, allowed in choices.items():
        if getattr(config, name) not in allowed:
            return f"--{name.replace('_', '-')} must be one of {', '.join(allowed)}, got {getattr(config, name)!r}"
    minimums = {"draft_length": 0, "early_exit_layers": 1, "ngram_min": 1, "ngram_max": 1, "verify_slots": 1,
                "prefill_ubatch": 1, "max_seq_len": 2, "threads": 1}
    for name, low in minimums.items():
        if getattr(config, name) is not None and getattr(config, name) < low:
            return f"--{name.replace('_', '-')} must be >= {low}, got {getattr(config, name)}"
    if config.ngram_max < config.ngram_min:
        return f"--ngram-max ({config.ngram_max}) must be >= --ngram-min ({config.ngram_min})"
    if config.drafter == "draft_model" and not config.draft_model:
        return "--drafter draft_model needs --draft-model PATH"
    if config.draft_policy == "estimator" and not config.draft_estimator:
        return "--draft-policy estimator needs --draft-estimator PATH"
    if not (config.device in ("auto", "cpu", "cuda") or
            (config.device.startswith("cuda:") and config.device[5:].isdigit())):
        return f"--device must be auto, cpu, cuda or cuda:N, got {config.device!r}"
    if not 0 < port < 65536:
        return f"--port must be in 1..65535, got {port}"
    if log_level not in _LOG_LEVELS:
        return f"--log-level must be one of {', '.join(_LOG_LEVELS)}, got {log_level!r}"
    return None


@app.command()
def serve(
    model: str = typer.Option(None, help="GGUF file or HF safetensors directory (default: the bundled SmolLM2-135M)"),
    draft_model: str = typer.Option(None, help="draft checkpoint for --drafter draft_model (same vocabulary)"),
    drafter: str = typer.Option(_SERVE_DEFAULTS.drafter, help=" | ".join(_engine_config.DRAFTERS)),
    draft_length: int = typer.Option(_SERVE_DEFAULTS.draft_length, help="tokens proposed per verify step (k)"),
    draft_policy: str = typer.Option(_SERVE_DEFAULTS.draft_policy, help=" | ".join(_engine_config.DRAFT_POLICIES)),
    draft_estimator: str = typer.Option(None, help="estimator.json for --draft-policy estimator"),
    early_exit_layers: int = typer.Option(_SERVE_DEFAULTS.early_exit_layers, help="layers for --drafter early_exit"),
    ngram_min: int = typer.Option(_SERVE_DEFAULTS.ngram_min, help="shortest prompt-lookup match"),
    ngram_max: int = typer.Option(_SERVE_DEFAULTS.ngram_max, help="longest prompt-lookup match"),
    verify_slots: int = typer.Option(_SERVE_DEFAULTS.verify_slots, help="sequences decoded together per step"),
    prefill_ubatch: int = typer.Option(_SERVE_DEFAULTS.prefill_ubatch, help="prompt tokens per prefill chunk"),
    dtype: str = typer.Option(_SERVE_DEFAULTS.dtype, help=" | ".join(_engine_config.DTYPES)),
    quantization: str = typer.Option(_SERVE_DEFAULTS.quantization, help=" | ".join(_engine_config.QUANTIZATIONS)),
    compile: str = typer.Option(_SERVE_DEFAULTS.compile, help=" | ".join(_engine_config.COMPILE_BACKENDS)),
    cuda_graph_batch_sizes: str = typer.Option("", help="comma-separated batch sizes to capture, e.g. 1,2,4 (CUDA)"),
    threads: int = typer.Option(None, help="torch CPU threads (default: torch's)"),
    device: str = typer.Option(_SERVE_DEFAULTS.device, help="auto | cpu | cuda | cuda:N"),
    max_seq_len: int = typer.Option(_SERVE_DEFAULTS.max_seq_len, help="context length (KV cache per slot)"),
    seed: int = typer.Option(_SERVE_DEFAULTS.seed, help="seed of the engine's sampler"),
    host: str = typer.Option("127.0.0.1", help="address to bind"),
    port: int = typer.Option(30000, help="port to bind"),
    log_level: str = typer.Option("info", help=" | ".join(_LOG_LEVELS)),
):
    """Serve a model with the embedded speculative-decoding engine (OpenAI API, /health, /metrics)."""
    try:
        graph_sizes = [int(s) for s in cuda_graph_batch_sizes.split(",") if s.strip()]
    except ValueError:
        graph_sizes = [0]
    if any(s < 1 for s in graph_sizes):
        typer.echo(f"error: --cuda-graph-batch-sizes must be positive integers like 1,2,4, "
                   f"got {cuda_graph_batch_sizes!r}", err=True)
        raise typer.Exit(2)
    config = _engine_config.EngineConfig(
        model=model, draft_model=draft_model, drafter=drafter, draft_length=draft_length, draft_policy=draft_policy,
        draft_estimator=draft_estimator, early_exit_layers=early_exit_layers, ngram_min=ngram_min,
        ngram_max=ngram_max, verify_slots=verify_slots, prefill_ubatch=prefill_ubatch, dtype=dtype,
        quantization=quantization, compile=compile, cuda_graph_batch_sizes=graph_sizes, threads=threads,
        device=device, max_seq_len=max_seq_len, seed=seed)
    problem = _serve_config_error(config, host, port, log_level)
    if problem:
        typer.echo(f"error: {problem}", err=True)
        raise typer.Exit(2)

    import logging

    logging.basicConfig(level=logging.DEBUG if log_level == "trace" else log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from autotune.embedded.scheduler import Engine
    from autotune.embedded.server import serve as serve_engine

    try:
        engine = Engine(config)
    except (ValueError, OSError, RuntimeError) as e:  # bad model path, vocabulary mismatch, no CUDA...
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2)
    serve_engine(engine, host=host, port=port, log_level=log_level)


# -- autotune probe: what the machine is -------------------------------------------------------------
@app.command()
def probe(
    json_output: bool = typer.Option(False, "--json", help="print JSON instead of tables"),
    gpu: str = typer.Option("auto", help="auto (measure this machine) | cpu | a hardware profile name (plan for it)"),
):
    """Report the GPUs, driver, CPU and matched hardware profile, each fact with its evidence."""
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


if __name__ == "__main__":
    app()
