"""Engine adapters, one module each, behind one registry: `get_adapter(name)` -> EngineAdapter
(autotune/engines/base.py). An engine is its adapter module (its behaviour, protocol.py, and its frozen facts,
facts.py), its search space (search_spaces/<name>.yaml) and its flag schema (autotune/engines/schemas/);
launching lives in launcher.py. docs/contributing.md lists every file an engine touches.
"""
import importlib

from autotune.engines.base import EngineAdapter

# name -> "module:class"; imported on first use (an adapter may pull in its engine's dependencies).
REGISTRY = {
    "embedded": "autotune.engines.embedded:EmbeddedAdapter",
    "sglang": "autotune.engines.sglang:SGLangAdapter",
    "vllm": "autotune.engines.vllm:VLLMAdapter",
    "llamacpp": "autotune.engines.llamacpp:LlamaCppAdapter",
}
ENGINES = tuple(REGISTRY)


def get_adapter(name: str) -> EngineAdapter:
    if name not in REGISTRY:
        raise ValueError(f"unknown engine {name!r}; known: {', '.join(ENGINES)}")
    module, cls = REGISTRY[name].split(":")
    return getattr(importlib.import_module(module), cls)()
