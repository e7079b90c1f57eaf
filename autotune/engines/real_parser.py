"""The engines' own argument parsers, loaded from an installed sglang or vllm.

Run as a child process (`python -c "$(cat real_parser.py)" vllm ARGS...`, prints a JSON list of
errors; `vllm --batch` reads a JSON list of argument lists on stdin and prints one list of errors each): importing an engine takes seconds and patches global state (logging, torch, import hooks),
none of which the tuner's own process should inherit.

On a machine without a GPU both engines install with `--no-deps` (see
scripts/capture_engine_schema.py); SGLang then imports triton and torchvision, which are absent, so
they are served from SGLang's own `_platform_stubs._MockModule` (import-only stand-ins; nothing runs).
"""
import argparse
import contextlib
import importlib.abc
import importlib.machinery
import importlib.util
import io
import json
import os
import sys
import types


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers imports of the named top-level packages (and their submodules) with mock modules."""

    def __init__(self, mock_module_cls):
        self.mock_module_cls = mock_module_cls
        self.roots: set[str] = set()

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in self.roots:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        return self.mock_module_cls(spec.name)

    def exec_module(self, module):
        pass


class _StandIn(types.ModuleType):
    """An import-only stand-in module: every attribute is another stand-in (nothing of it runs)."""

    __version__ = "0.0"  # what transformers compares before importing parts of torchvision

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _StandIn(f"{self.__name__}.{name}")


def _stub_missing_sglang_imports() -> _StubFinder | None:
    missing = [m for m in ("triton", "torchvision") if importlib.util.find_spec(m) is None]
    if not missing:
        return None
    if "triton" in missing:  # torch decides "no triton" for itself first, so it never sees the stand-in.
        import torch._dynamo
        import torch._inductor.compile_fx  # noqa: F401

    root = importlib.util.find_spec("sglang").submodule_search_locations[0]
    path = os.path.join(root, "_platform_stubs.py")
    if not os.path.exists(path):
        # sglang 0.5.17 ships no stubs (0.5.23 does) and imports torchvision.io as it starts (srt/utils/common.py), and its
        # configs register image processors, which transformers allows only with torchvision: both stood in now
        finder = _StubFinder(_StandIn)
        finder.roots.update(missing)
        sys.meta_path.insert(0, finder)
        return finder
    spec = importlib.util.spec_from_file_location("_sglang_platform_stubs", path)
    stubs = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = stubs  # dataclasses in it look their module up by name
    spec.loader.exec_module(stubs)
    finder = _StubFinder(stubs._MockModule)
    finder.roots.update(m for m in missing if m == "triton")
    sys.meta_path.insert(0, finder)
    return finder


def sglang_parser() -> argparse.ArgumentParser:
    finder = _stub_missing_sglang_imports()
    from sglang.srt.server_args import ServerArgs

    if finder is not None and importlib.util.find_spec("torchvision") is None:
        finder.roots.add("torchvision")  # only after transformers has decided it is absent
    parser = argparse.ArgumentParser(prog="sglang serve")
    ServerArgs.add_cli_args(parser)
    return parser


def vllm_parser() -> argparse.ArgumentParser:
    _vllm_device_env()
    try:
        from vllm.entrypoints.common.cli_args import make_arg_parser
    except ModuleNotFoundError:  # 0.32 kept it under launchers/
        from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    return make_arg_parser(FlexibleArgumentParser(prog="vllm serve"))


def _vllm_device_env() -> None:
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # else: "Failed to infer device type"


def _value_of(args: list[str], *flags: str) -> str | None:
    for i, tok in enumerate(args):
        name, eq, inline = tok.partition("=")
        if name in flags:
            return inline if eq else (args[i + 1] if i + 1 < len(args) else None)
    return None


def _parse(parse, args: list[str]) -> tuple[object, list[str]]:
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return parse(args), []
    except SystemExit:
        lines = [ln for ln in err.getvalue().splitlines() if ln.strip()]
        return None, [lines[-1] if lines else "the parser rejected the arguments"]


def _one_line(text: str, limit: int = 400) -> str:
    return " ".join(text.split())[:limit]


def sglang_errors(args: list[str]) -> list[str]:
    sglang_parser()  # installs the import stand-ins where needed
    from sglang.srt.server_args import prepare_server_args

    try:  # sglang 0.5.17 resolves and validates as it builds ServerArgs (__post_init__); 0.5.23 in resolve_once
        server_args, errors = _parse(prepare_server_args, args)
    except Exception as e:  # noqa: BLE001 (the engine's verdict, whatever its exception type)
        return [_one_line(f"sglang: {type(e).__name__}: {e}")]
    model = _value_of(args, "--model-path", "--model")
    # Validation reads the model's config.json: only possible for a local directory.
    if server_args is not None and model and os.path.isdir(model):
        try:
            if hasattr(server_args, "resolve_once"):
                server_args.resolve_once()
            server_args.check_server_args()
        except Exception as e:  # noqa: BLE001 (the engine's verdict, whatever its exception type)
            errors.append(_one_line(f"sglang: {type(e).__name__}: {e}"))
    return errors


def vllm_errors(args: list[str]) -> list[str]:
    parser = vllm_parser()
    from vllm.engine.arg_utils import EngineArgs

    ns, errors = _parse(parser.parse_args, args)
    model = _value_of(args, "--model") or (ns.model_tag if ns is not None else None)
    if ns is not None and model and os.path.isdir(model):
        try:
            if ns.model_tag:
                ns.model = ns.model_tag
            EngineArgs.from_cli_args(ns).create_engine_config()
        except Exception as e:  # noqa: BLE001
            errors.append(_one_line(f"vllm: {type(e).__name__}: {e}"))
    return errors


if __name__ == "__main__":
    # `ENGINE ARGS...` -> a JSON list of errors; `ENGINE --batch` with a JSON list of argument lists on stdin -> a
    # JSON list of those lists (one import of the engine for many commands)
    engine, engine_args = sys.argv[1], sys.argv[2:]
    errors_of = {"sglang": sglang_errors, "vllm": vllm_errors}[engine]
    batch = json.loads(sys.stdin.read()) if engine_args == ["--batch"] else None
    with contextlib.redirect_stdout(sys.stderr):  # engines log to stdout; only the verdict goes there
        found = [errors_of(args) for args in batch] if batch is not None else errors_of(engine_args)
    print(json.dumps(found))
