"""The bundled model as an HF checkpoint directory, for engines that read only that format (vLLM, SGLang).

Written once per machine from the bundled GGUF (autotune/embedded/hf_export.py) into the cache, and kept only
once it is checked: the engine's own transformers (in the engine's Python) loads the directory and decodes
greedily, and every token must equal what the embedded engine decodes from the GGUF itself, in float32. Two
independent readers of the weights agreeing is what makes the copy the same model.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from autotune import cache_dir
from autotune.embedded.bundled import bundled_gguf_path

CHECK_PROMPTS = ("Write a Python function that adds two numbers.", "What is the capital of France?")
CHECK_TOKENS = 16
CHECKED = "autotune-check.json"  # written last: a directory without it is not used
# Runs in the engine's Python (which has transformers, as every vLLM and SGLang does): greedy ids per prompt.
_TRANSFORMERS_GREEDY = """
import json, sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
path, prompts, n = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
tok = AutoTokenizer.from_pretrained(path)
model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
out = []
for p in prompts:
    ids = tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, return_dict=True,
                                  return_tensors="pt")["input_ids"]
    with torch.no_grad():
        gen = model.generate(ids, max_new_tokens=n, do_sample=False)
    out.append(gen[0, ids.shape[1]:].tolist())
print(json.dumps(out))
"""


def embedded_greedy(prompts=CHECK_PROMPTS, n: int = CHECK_TOKENS) -> list[list[int]]:
    """The embedded engine's greedy ids for each chat prompt (up to a stop token), from the bundled GGUF, float32
    on the CPU."""
    import torch

    from autotune.embedded.model import KVCache
    from autotune.embedded.weights import load_model

    loaded = load_model(None, "float32")
    out = []
    for prompt in prompts:
        ids = loaded.tokenizer.encode(loaded.tokenizer.apply_chat_template([{"role": "user", "content": prompt}]))
        cache = KVCache(loaded.args, 1, len(ids) + n, torch.float32)
        x, pos, tokens = torch.tensor([ids]), torch.arange(len(ids))[None], []
        with torch.no_grad():
            for i in range(n):
                token = int(loaded.model(x, pos, cache)[0, -1].argmax())
                tokens.append(token)
                if token in loaded.tokenizer.stop_token_ids:  # where generate() stops too
                    break
                x, pos = torch.tensor([[token]]), torch.tensor([[len(ids) + i]])
        out.append(tokens)
    return out


def engine_greedy(python: str, directory: Path, prompts=CHECK_PROMPTS, n: int = CHECK_TOKENS) -> list[list[int]]:
    done = subprocess.run([python, "-c", _TRANSFORMERS_GREEDY, str(directory), json.dumps(list(prompts)), str(n)],
                          capture_output=True, text=True, timeout=600, check=False,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"})
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"{python} could not load {directory} with transformers: {last}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def bundled_hf_dir(python: str) -> Path:
    """The checked HF directory of the bundled model (made on first use: about a minute on 2 cores)."""
    from autotune.embedded.hf_export import write_hf_dir
    from autotune.embedded.weights import BUNDLED_SHA256

    final = cache_dir("models", f"smollm2-135m-instruct-{BUNDLED_SHA256[:12]}-hf")
    if (final / CHECKED).is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    print(f"making the bundled model's HF copy (once per machine; checked against the GGUF): {final}",
          file=sys.stderr, flush=True)
    stage = Path(tempfile.mkdtemp(prefix=".stage-", dir=final.parent))
    try:
        write_hf_dir(bundled_gguf_path(), stage)
        ours, theirs = embedded_greedy(), engine_greedy(python, stage)
        if ours != theirs:
            raise RuntimeError(f"the HF copy of {bundled_gguf_path().name} decodes differently from the GGUF "
                               f"(embedded {ours}, transformers {theirs})")
        (stage / CHECKED).write_text(json.dumps({"gguf_sha256": BUNDLED_SHA256, "prompts": list(CHECK_PROMPTS),
                                                 "greedy_ids": ours, "checked_with": python}, indent=1) + "\n")
        shutil.rmtree(final, ignore_errors=True)  # a leftover without the check file
        try:
            stage.rename(final)
        except OSError:  # another process finished first: its copy is as good
            if not (final / CHECKED).is_file():
                raise
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return final


class ServesHFDirectories:
    """What vLLM and SGLang share as engines that read only HF checkpoint directories: with no --model they serve
    the bundled model's checked copy (made in the engine's own Python, `self.python`), and they tokenize a
    directory's tokenizer.json, so outputs are compared token by token."""
    python: str

    def default_model(self) -> str | None:
        return str(bundled_hf_dir(self.python))

    def model_or_default(self, model: str | None) -> str | None:
        """The model a launch loads: the one given, else the bundled copy where the engine is installed."""
        return model or (self.default_model() if self.installed() else None)

    def preset_model(self, preset, hub_repo, given):
        from autotune.embedded.bundled import BUNDLED_PRESET

        return self.default_model() if preset == BUNDLED_PRESET and self.installed() else hub_repo or given

    def tokenizer(self, model):
        """An HF directory's tokenizer.json (the bundled model's copy when none is given)."""
        from autotune.embedded.tokenizer import tokenizer_from_hf_dir

        path = Path(model) if model else Path(self.default_model())
        if not (path / "tokenizer.json").is_file():
            return None
        return tokenizer_from_hf_dir(path, json.loads((path / "config.json").read_text()))
