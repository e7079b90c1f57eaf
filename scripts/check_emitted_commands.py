"""Every launch command `autotune estimate` ranks for SGLang and vLLM, checked by the engines' own parsers.

    python3 scripts/check_emitted_commands.py emit OUT.json            # the commands (any Python with autotune)
    /tmp/venv-sglang/bin/python scripts/check_emitted_commands.py check OUT.json sglang RESULT.json
    /tmp/venv-vllm/bin/python   scripts/check_emitted_commands.py check OUT.json vllm RESULT.json

`emit` ranks each engine's space for three GPU profiles (Ampere with Marlin FP8, Hopper, a 24 GB card) x 1
and 4 GPUs x three model presets x each kind of draft checkpoint (none, EAGLE-1, EAGLE-3, DFlash,
standalone) and keeps what `autotune estimate` would print (the top TOP) plus the best configuration of
every combination of the main axes (COVER: tp, quantization, KV dtype, drafter, its draft shape), and
writes the distinct argv lists. The target and drafts are small local config.json
directories (written next to OUT.json) so that the engines' validation, which reads the model's config,
can run without downloading anything; the predictions use the presets' shapes. `check` runs in a venv
with the engine installed (--no-deps: scripts/capture_engine_schema.py says how) and applies
autotune/engines/real_parser.py's checks to each command: SGLang's prepare_server_args + resolve_once +
check_server_args (with --device cpu added, as that module needs on a machine without a GPU), vLLM's
parser + EngineArgs.create_engine_config().
"""
import json
import sys
from pathlib import Path

PROFILES = ("a100-80gb-sxm4", "h100-sxm5", "rtx-3090")
MODELS = ("llama-3.1-8b", "qwen3.5-27b", "gemma-2-27b")
TOP = 20
COVER = ("tp_size", "tensor_parallel_size", "quantization", "kv_cache_dtype", "speculative_algorithm", "speculative_method",
         "speculative_num_steps", "speculative_eagle_topk", "speculative_num_draft_tokens", "num_speculative_tokens")
LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 32, "hidden_size": 4096,
         "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256,
         "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "torch_dtype": "bfloat16",
         "hidden_act": "silu", "tie_word_embeddings": False, "bos_token_id": 128000, "eos_token_id": 128009}
HEAD = {**LLAMA, "num_hidden_layers": 1}
DRAFTS = {"eagle": {**HEAD, "architectures": ["LlamaForCausalLMEagle"]},
          "eagle3": {**HEAD, "architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": 32000},
          "dflash": {**HEAD, "num_hidden_layers": 5, "architectures": ["DFlashDraftModel"], "block_size": 16,
                     "dflash_config": {"target_layer_ids": [1, 8, 15, 22, 29], "mask_token_id": 128002}},
          "standalone": {**LLAMA, "num_hidden_layers": 16, "hidden_size": 2048, "num_attention_heads": 32,
                         "intermediate_size": 8192}}


def emit(out: Path) -> None:
    from autotune.engines import get_adapter
    from autotune.hardware import get_profile
    from autotune.predict import draft_kind, load_model, rank_configs
    from autotune.space import load_space

    root = out.parent / "models"
    target = root / "target"
    for name, config in {"target": LLAMA, **DRAFTS}.items():
        (root / name).mkdir(parents=True, exist_ok=True)
        (root / name / "config.json").write_text(json.dumps(config))
    commands = {}
    for engine_name in ("sglang", "vllm"):
        engine, space, seen = get_adapter(engine_name), load_space(engine_name), set()
        for profile in map(get_profile, PROFILES):
            for gpus in (1, 4):
                for model in map(load_model, MODELS):
                    for draft in (None, *DRAFTS):
                        path = str(root / draft) if draft else None
                        ranked = rank_configs(space, model, profile, gpus, top=10_000, engine=engine,
                                              has_draft_model=bool(draft), draft_kind=draft_kind(path) if path else None)
                        covered, kept = set(), []
                        for i, (config, _) in enumerate(ranked):
                            key = tuple(config.get(k) for k in COVER)
                            if i < TOP or key not in covered:
                                kept.append(config)
                            covered.add(key)
                        for config in kept:
                            argv, _ = engine.command(config, model=str(target), draft_model=path, host="127.0.0.1",
                                                     port=engine.default_port)
                            seen.add(tuple(engine.engine_args(argv)))
        commands[engine_name] = sorted(map(list, seen))
    out.write_text(json.dumps(commands, indent=1))
    print(", ".join(f"{e}: {len(c)} distinct commands" for e, c in commands.items()))


def check(commands_file: Path, engine: str, result: Path) -> None:
    from autotune.engines import real_parser

    errors_of = {"sglang": lambda a: real_parser.sglang_errors([*a, "--device", "cpu"]), "vllm": real_parser.vllm_errors}[engine]
    commands = json.loads(commands_file.read_text())[engine]
    failures = []
    for i, args in enumerate(commands):
        errors = errors_of(args)
        if errors:
            failures.append({"args": args, "errors": errors})
        if i % 50 == 0:
            print(f"{i}/{len(commands)} checked, {len(failures)} refused", file=sys.stderr, flush=True)
    summary = {"engine": engine, "commands": len(commands), "refused": len(failures), "failures": failures}
    result.write_text(json.dumps(summary, indent=1))
    print(f"{engine}: {len(commands) - len(failures)} of {len(commands)} commands accepted")


if __name__ == "__main__":
    if sys.argv[1] == "emit":
        emit(Path(sys.argv[2]))
    else:
        check(Path(sys.argv[2]), sys.argv[3], Path(sys.argv[4]))
