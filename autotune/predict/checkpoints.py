"""Which checkpoint a configuration of a model preset loads.

AWQ, GPTQ and GGUF weights are properties of a checkpoint: no engine makes them from 16-bit weights at load
time, so a row with such weights loads a checkpoint in that format: the published one where
autotune/data/quantized_checkpoints.yaml names it, else one the user supplies. FP8 rows load the 16-bit
weights (both SGLang and vLLM quantize them at load time), and a checkpoint given by path is what it is
(autotune/space/constraints.py offers it only its own format)."""
from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import yaml

from autotune import package_path
from autotune.predict.gguf_types import read_header
from autotune.predict.knobs import Knobs
from autotune.space.constraints import CHECKPOINT_FORMATS

CHECKPOINTS_FILE = package_path("data", "quantized_checkpoints.yaml")
HUB = "https://huggingface.co/"


@dataclass(frozen=True)
class Checkpoint:
    """The checkpoint a row needs: `repo` where one is published, else None (the user supplies it)."""

    model: str  # the preset it is a checkpoint of
    format: str  # awq | gptq | gguf
    repo: str | None
    gguf_type: str | None = None  # the file of a GGUF repo (its llama-quantize type)

    @property
    def user_supplied(self) -> bool:
        return self.repo is None

    @property
    def load_as(self) -> str | None:
        """What the launch line names instead of the preset: the published repo, else a name for the user to
        replace; None for a GGUF file, which the engine's adapter names by its type (qwen3-8b-Q4_K_M.gguf)."""
        if self.format == "gguf":
            return None
        return self.repo or f"{self.model}-{self.format.upper()}"

    def describe(self) -> str:
        if self.gguf_type:  # a repo publishes some of the types; another is llama-quantize's output of one
            where = f"GGUF files of it: {self.repo} ({HUB}{self.repo})" if self.repo else "you supply"
            return f"a {self.gguf_type} GGUF file of {self.model} ({where})"
        if self.repo:
            return f"{self.format.upper()} checkpoint {self.repo} ({HUB}{self.repo})"
        return f"a {self.format.upper()} checkpoint of {self.model} you supply"


@functools.cache
def published() -> dict[str, dict[str, str]]:
    return yaml.safe_load(CHECKPOINTS_FILE.read_text())


def weight_format(k: Knobs) -> str | None:
    """awq / gptq / gguf when the configuration's weights come only from a checkpoint in that format."""
    if k.gguf_type:
        return "gguf"
    return CHECKPOINT_FORMATS.get(str(k.quantization).lower())


def checkpoint_for(preset: str, k: Knobs, target: str | None = None) -> Checkpoint | None:
    """The checkpoint `k` needs of the preset `preset`; None where its 16-bit weights serve (16-bit, FP8) or
    where `target`, what the engine is told to load, is a file or directory here (the user's own, or the
    bundled model) that holds those weights: a GGUF file of another weight format does not."""
    fmt = weight_format(k)
    if fmt is None or (target and Path(target).exists() and not _other_gguf_type(Path(target), k.gguf_type)):
        return None
    return Checkpoint(preset, fmt, published().get(preset, {}).get(fmt), k.gguf_type)


def _other_gguf_type(path: Path, gguf_type: str | None) -> bool:
    return bool(gguf_type) and path.is_file() and path.suffix == ".gguf" and read_header(path).file_type != gguf_type
