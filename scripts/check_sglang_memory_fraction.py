"""SGLang's own mem_fraction_static resolution against autotune's (SGLangAdapter.default_memory_fraction).

    /tmp/venv-sglang/bin/python scripts/check_sglang_memory_fraction.py MODEL_DIR

Runs SGLang 0.5.23's argument resolution (prepare_server_args + resolve_once, arg_groups/memory_hook.py) on
a CPU with two facts of a CUDA machine patched in: the GPU's memory (get_device_memory_capacity) and CUDA's
default prefill-graph backend (breakable). On a CPU SGLang sizes decode graphs from torch_compile_max_bs,
so autotune is given the decode max batch SGLang resolved; everything else (chunked prefill by GPU size,
TP slack, prefill-graph sizes, the 10 GiB floor) each side works out for itself. MODEL_DIR: a local
directory with a config.json (validation reads it). Prints one line per case and exits 1 on a mismatch.
"""
import sys

GPUS_MIB = (24576, 46068, 81559, 143771)  # RTX 3090/4090, L40S, H100 80GB, H200 (what nvidia-smi reports)


def main(model_dir: str) -> int:
    from autotune.engines import get_adapter, real_parser

    real_parser.sglang_parser()  # the import stand-ins for triton / torchvision on a CPU machine
    import sglang.srt.arg_groups.memory_hook as memory_hook
    import sglang.srt.model_executor.cuda_graph_config as graph_config
    from sglang.srt.arg_groups.model_override_base import resolved_view
    from sglang.srt.server_args import prepare_server_args

    graph_config.default_prefill_backend = lambda: graph_config.Backend.BREAKABLE
    adapter, failures = get_adapter("sglang"), 0
    for mib in GPUS_MIB:
        for tp in (1, 4):
            memory_hook.get_device_memory_capacity = lambda *a, mib=mib, **k: mib
            args = prepare_server_args(["--model-path", model_dir, "--device", "cpu", "--tp-size", str(tp)])
            args.resolve_once()
            view = resolved_view(args)
            decode_bs = view.cuda_graph_config.decode.max_bs
            ours = adapter.default_memory_fraction(tp, mib, {"cuda_graph_max_bs_decode": decode_bs})
            same = abs(ours - view.mem_fraction_static) < 1e-9
            failures += not same
            print(f"{mib} MiB, tp {tp}: chunked_prefill {view.chunked_prefill_size}, decode graphs to {decode_bs}: "
                  f"sglang {view.mem_fraction_static}, autotune {ours}{'' if same else '  MISMATCH'}", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
