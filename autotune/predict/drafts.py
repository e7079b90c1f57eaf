"""What a draft checkpoint is (an EAGLE-1 or EAGLE-3 head, a DFlash head, a standalone model), read from its
config and tensor headers like the engines read it."""
from __future__ import annotations

import json
import struct
from pathlib import Path

DRAFT_KINDS = ("eagle", "eagle3", "dflash", "standalone")


def draft_kind(path: str | Path) -> str | None:
    """What a draft checkpoint directory is: "eagle" (an EAGLE-1/2 head: fc over 2 x hidden), "eagle3"
    (fc over 3 x hidden, a reduced-vocabulary head), "dflash" (a DFlash block drafter), "standalone" (a
    small model of its own); None when the path has no config.json (a hub id: nothing to read here).

    Read like the engines read it: the architecture names (vLLM's EAGLEConfig keeps a name that starts
    or ends with Eagle3 / DFlash, vllm/transformers_utils/configs/eagle.py; SGLang's LlamaForCausalLMEagle
    and LlamaForCausalLMEagle3), the DFlash / EAGLE-3 config fields, and where the names say nothing (the
    original EAGLE releases call themselves LlamaForCausalLM) the width of the head's `fc` weight."""
    directory = Path(path)
    config_file = directory / "config.json" if directory.is_dir() else None
    if config_file is None or not config_file.is_file():
        return None
    try:
        c = json.loads(config_file.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{config_file}: not a usable model config ({type(e).__name__}: {e})") from None
    names = [str(a) for a in c.get("architectures") or []]
    if any("dflash" in a.lower() for a in names) or "dflash_config" in c:
        return "dflash"
    if any(a.lower().startswith("eagle3") or a.lower().endswith("eagle3") for a in names) or "eagle_config" in c \
            or "draft_vocab_size" in c:
        return "eagle3"
    if any(a.lower().startswith("eagle") or a.lower().endswith("eagle") for a in names):
        return "eagle"
    fc = _tensor_shapes(directory).get("fc.weight")
    hidden = int(c.get("hidden_size") or 0)
    if fc and hidden and len(fc) == 2:
        return "eagle3" if fc[1] == 3 * hidden else "eagle"
    return "standalone"


def _tensor_shapes(directory: Path) -> dict[str, list[int]]:
    """Tensor name -> shape from the headers of the directory's safetensors files (no weights read)."""
    shapes = {}
    for file in sorted(directory.glob("*.safetensors")):
        try:
            with file.open("rb") as f:
                size = struct.unpack("<Q", f.read(8))[0]
                header = json.loads(f.read(min(size, 100_000_000)))
        except (OSError, ValueError, struct.error):
            continue
        shapes.update({k: v.get("shape") for k, v in header.items() if isinstance(v, dict)})
    return shapes
