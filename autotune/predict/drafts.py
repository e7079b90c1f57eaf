"""What a draft checkpoint is (an EAGLE-1 or EAGLE-3 head, a DFlash head, a standalone model), read from its
config and tensor headers like the engines read it: `read_draft` gives the record each engine adapter maps
to the drafters it would run it with (`adapter.draft_problem`)."""
from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

DRAFT_KINDS = ("eagle", "eagle3", "dflash", "standalone")


@dataclass(frozen=True)
class DraftCheckpoint:
    """A --draft-model as the engines will see it: its kind (DRAFT_KINDS), the architecture names its
    config declares (what the engines' model registries look up; empty where only --draft-kind said what it
    is), its config's model_type, its GGUF architecture (llama.cpp's -md file), the name as given (vLLM
    guesses a method from it) and where its files were read (a hub id's cached snapshot; None: nowhere)."""
    name: str
    kind: str
    architectures: tuple[str, ...] = ()
    model_type: str | None = None
    gguf_architecture: str | None = None
    files: str | None = None


def read_draft(name: str, kind: str | None = None) -> DraftCheckpoint:
    """The draft checkpoint `name` (a directory, a GGUF file, or a hub id whose config.json this machine's
    Hugging Face cache holds), checked against `kind` (--draft-kind) when both say something; only `kind`
    when nothing can be read. ValueError (one line) when neither does: every drafter family would otherwise
    be offered for a checkpoint that is only one of them."""
    if kind is not None and kind not in DRAFT_KINDS:
        raise ValueError(f"--draft-kind {kind}: not one of {', '.join(DRAFT_KINDS)}")
    path = Path(name)
    if path.is_file() and path.suffix == ".gguf":
        arch = _gguf_architecture(path)
        # llama.cpp names a draft GGUF's kind by its architecture (src/llama-arch.cpp, build 11434:
        # LLM_ARCH_EAGLE3 "eagle3", LLM_ARCH_DFLASH "dflash"); any other architecture is a model of its own
        found = DraftCheckpoint(name, arch if arch in ("eagle3", "dflash") else "standalone", gguf_architecture=arch,
                                files=name)
    else:
        directory = path if (path / "config.json").is_file() else _hub_snapshot(name)
        found = _from_config(name, directory) if directory is not None else None
    if found is None and kind is None:
        raise ValueError(f"--draft-model {name}: no config.json here to tell what it is (a hub id not in this "
                         "machine's Hugging Face cache); pass its local directory, fetch its config.json "
                         f"(huggingface-cli download {name} config.json), or say --draft-kind "
                         f"{'|'.join(DRAFT_KINDS)}")
    if found is None:
        return DraftCheckpoint(name, kind)
    if kind is not None and kind != found.kind:
        raise ValueError(f"--draft-kind {kind}: the config of {name} says it is {found.kind} "
                         f"({', '.join(found.architectures) or found.gguf_architecture})")
    return found


def _gguf_architecture(path: Path) -> str:
    """general.architecture of a GGUF file (a draft need not carry general.file_type, which read_header wants)."""
    from autotune.embedded.gguf_header import read_header

    meta = read_header(path).meta  # ValueError naming the file for junk
    if "general.architecture" not in meta:
        raise ValueError(f"{path}: its GGUF header names no general.architecture")
    return str(meta["general.architecture"])


def _hub_snapshot(repo_id: str) -> Path | None:
    """The snapshot directory of a hub id in the local Hugging Face cache that holds its config.json
    (huggingface_hub's layout: <cache>/models--owner--name/snapshots/<revision>/, refs/main naming the
    revision); None when it is not there. Nothing is downloaded."""
    if repo_id.count("/") != 1 or Path(repo_id).exists():
        return None
    cache = os.environ.get("HF_HUB_CACHE") or str(Path(os.environ.get("HF_HOME") or "~/.cache/huggingface") / "hub")
    repo = Path(cache).expanduser() / ("models--" + repo_id.replace("/", "--"))
    ref = repo / "refs" / "main"
    snapshots = [repo / "snapshots" / ref.read_text().strip()] if ref.is_file() else \
        sorted((repo / "snapshots").glob("*"), key=lambda p: p.stat().st_mtime, reverse=True)
    return next((s for s in snapshots if (s / "config.json").is_file()), None)


def _from_config(name: str, directory: Path) -> DraftCheckpoint:
    c = _config(directory)
    return DraftCheckpoint(name, _kind(directory, c), tuple(str(a) for a in c.get("architectures") or []),
                           c.get("model_type"), files=str(directory))


def draft_kind(path: str | Path) -> str | None:
    """What a draft checkpoint directory is: "eagle" (an EAGLE-1/2 head: fc over 2 x hidden), "eagle3"
    (fc over 3 x hidden, a reduced-vocabulary head), "dflash" (a DFlash block drafter), "standalone" (a
    small model of its own); None when the path has no config.json (a hub id: nothing to read here)."""
    directory = Path(path)
    if not (directory / "config.json").is_file():
        return None
    return _kind(directory, _config(directory))


def _config(directory: Path) -> dict:
    config_file = directory / "config.json"
    try:
        return json.loads(config_file.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{config_file}: not a usable model config ({type(e).__name__}: {e})") from None


def _kind(directory: Path, c: dict) -> str:
    """Read like the engines read it: the architecture names (vLLM's EAGLEConfig keeps a name that starts
    or ends with Eagle3 / DFlash, vllm/transformers_utils/configs/eagle.py; SGLang's LlamaForCausalLMEagle
    and LlamaForCausalLMEagle3), the DFlash / EAGLE-3 config fields, and where the names say nothing (the
    original EAGLE releases call themselves LlamaForCausalLM) the width of the head's `fc` weight."""
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
