"""Every launch command `autotune estimate` ranks for SGLang and vLLM, checked by the engines' own parsers.

    python3 scripts/check_emitted_commands.py emit OUT.json            # the commands (any Python with autotune)
    /tmp/venv-sglang/bin/python scripts/check_emitted_commands.py check OUT.json sglang RESULT.json
    /tmp/venv-vllm/bin/python   scripts/check_emitted_commands.py check OUT.json vllm RESULT.json

`emit` enumerates each engine's space as `autotune estimate` does (rank.candidate_configs) for three GPU
profiles (Ampere with Marlin FP8, Hopper, a 24 GB card) x 1 and 4 GPUs x three model presets x each kind
of draft checkpoint (none, EAGLE-1, EAGLE-3, DFlash, standalone), keeps those the adapter's rules and the
hardware/checkpoint constraints accept (what estimate would rank, before memory), one per combination
of the main axes (COVER: tp, quantization, KV dtype, drafter, tree or chain, memory fraction; the first,
so with the space's default draft lengths), and
writes the distinct argv lists. The target and drafts are small local config.json
directories (written next to OUT.json) so that the engines' validation, which reads the model's config,
can run without downloading anything; the predictions use the presets' shapes. `check` runs in a venv
with the engine installed (--no-deps: scripts/capture_engine_schema.py says how) and applies
autotune/engines/real_parser.py's checks to each command: SGLang's prepare_server_args + resolve_once +
check_server_args (with --device cpu added, as that module needs on a machine without a GPU), vLLM's
parser + EngineArgs.create_engine_config().
"""
import dataclasses
import json
import struct
import sys
from pathlib import Path

PROFILES = ("a100-80gb-sxm4", "h100-sxm5", "rtx-3090")
MODELS = ("llama-3.1-8b", "qwen3.5-27b", "gemma-2-27b")
COVER = ("tp_size", "tensor_parallel_size", "quantization", "kv_cache_dtype", "speculative_algorithm", "speculative_method",
         "speculative_eagle_topk", "mem_fraction_static", "gpu_memory_utilization")
LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 32, "hidden_size": 4096,
         "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256,
         "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "torch_dtype": "bfloat16",
         "hidden_act": "silu", "tie_word_embeddings": False, "bos_token_id": 128000, "eos_token_id": 128009}
# A target with one MTP layer for the MTP / NEXTN configurations: DeepSeek-V3's layout, small (a hybrid
# Qwen3-Next target is refused by SGLang's validation on a CPU: "extra_buffer requires platform support for
# Mamba cache state snapshots").
MTP_TARGET = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "num_hidden_layers": 4,
              "hidden_size": 1024, "num_attention_heads": 16, "num_key_value_heads": 16, "intermediate_size": 2816,
              "moe_intermediate_size": 256, "n_routed_experts": 8, "n_shared_experts": 1, "num_experts_per_tok": 2,
              "first_k_dense_replace": 1, "moe_layer_freq": 1, "n_group": 1, "topk_group": 1,
              "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "topk_method": "noaux_tc", "norm_topk_prob": True,
              "kv_lora_rank": 128, "q_lora_rank": 256, "qk_nope_head_dim": 64, "qk_rope_head_dim": 32, "v_head_dim": 64,
              "vocab_size": 129280, "max_position_embeddings": 16384, "rms_norm_eps": 1e-6, "rope_theta": 10000,
              "torch_dtype": "bfloat16", "hidden_act": "silu", "tie_word_embeddings": False, "num_nextn_predict_layers": 1}
# What a 4-bit checkpoint's config.json says (AutoAWQ's and GPTQModel's quantization_config).
FORMATS = {"awq": {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"},
           "gptq": {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True}}
HEAD = {**LLAMA, "num_hidden_layers": 1}
# EAGLE-1 as its authors released it (LlamaForCausalLM + fc over 2 x hidden: the name vLLM accepts) and as
# SGLang names it (LlamaForCausalLMEagle: what SGLang loads, vLLM refuses); EAGLE-3 and DFlash heads by their
# architecture names.
DRAFTS = {"eagle": HEAD,
          "eagle-sglang": {**HEAD, "architectures": ["LlamaForCausalLMEagle"]},
          "eagle3": {**HEAD, "architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": 32000},
          "dflash": {**HEAD, "num_hidden_layers": 5, "architectures": ["DFlashDraftModel"], "block_size": 16,
                     "dflash_config": {"target_layer_ids": [1, 8, 15, 22, 29], "mask_token_id": 128002}},
          "standalone": {**LLAMA, "num_hidden_layers": 16, "hidden_size": 2048, "num_attention_heads": 32,
                         "intermediate_size": 8192}}


def emit(out: Path) -> None:
    from autotune.engines import get_adapter
    from autotune.hardware import get_profile, planned
    from autotune.predict import load_model, read_draft
    from autotune.predict.rank import candidate_configs
    from autotune.space import load_space
    from autotune.space.constraints import CHECKPOINT_FORMATS, ModelShape, hardware_violations

    root = out.parent / "models"
    targets = {"target": LLAMA, "target-mtp": MTP_TARGET}
    targets |= {f"{name}-{fmt}": {**config, "quantization_config": q} for name, config in list(targets.items())
                for fmt, q in FORMATS.items()}
    for name, config in {**targets, **DRAFTS}.items():
        (root / name).mkdir(parents=True, exist_ok=True)
        (root / name / "config.json").write_text(json.dumps(config))
    fc = {"fc.weight": {"dtype": "BF16", "shape": [4096, 8192], "data_offsets": [0, 0]}}  # header only: no weights read
    header = json.dumps(fc).encode()
    for name in ("eagle", "eagle-sglang"):
        (root / name / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)

    def target_for(engine, config) -> Path:
        """The local target a configuration needs: MTP layers for mtp/NEXTN, the 4-bit format it reads."""
        name = "target-mtp" if engine.knobs(config).drafter == "mtp" else "target"
        fmt = CHECKPOINT_FORMATS.get(str(config.get("quantization")).lower())
        return root / (f"{name}-{fmt}" if fmt else name)
    commands = {}
    for engine_name in ("sglang", "vllm"):
        engine, space, seen, covered = get_adapter(engine_name), load_space(engine_name), set(), set()
        candidates = candidate_configs(space, engine)
        for profile in map(get_profile, PROFILES):
            for gpus in (1, 4):
                hw = dataclasses.replace(planned(profile), gpus=planned(profile).gpus * gpus)
                for model in map(load_model, MODELS):
                    for draft in (None, *DRAFTS):
                        path = str(root / draft) if draft else None
                        shape = ModelShape.of(model, read_draft(path) if path else None)
                        for config in candidates:
                            key = (tuple(config.get(k) for k in COVER), draft)
                            if key in covered or engine.check(config, hw, has_draft_model=bool(draft)) or \
                                    hardware_violations(config, hw, shape, adapter=engine):
                                continue
                            covered.add(key)
                            argv, _ = engine.command(config, model=str(target_for(engine, config)), draft_model=path,
                                                     host="127.0.0.1",
                                                     port=engine.facts.default_port)
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
