"""Engine adapters: turn a configuration into a launch command and know each engine's rules.

`get_adapter(name)` -> EngineAdapter (autotune/engines/base.py); launching lives in launcher.py.
"""
from autotune.engines.base import EngineAdapter

ENGINES = ("embedded", "sglang", "vllm")


def get_adapter(name: str) -> EngineAdapter:
    if name == "embedded":
        from autotune.engines.embedded import EmbeddedAdapter

        return EmbeddedAdapter()
    if name == "sglang":
        from autotune.engines.sglang import SGLangAdapter

        return SGLangAdapter()
    if name == "vllm":
        from autotune.engines.vllm import VLLMAdapter

        return VLLMAdapter()
    raise ValueError(f"unknown engine {name!r}; known: {', '.join(ENGINES)}")
