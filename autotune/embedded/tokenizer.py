"""Tokenizer and chat template, built from a GGUF's metadata or an HF directory's tokenizer.json.

The byte-level BPE of a GGUF (`tokenizer.ggml.model = gpt2`) is rebuilt with the `tokenizers`
library the way transformers' GGUF loader builds it, so token ids match Hugging Face's exactly.
"""
import hashlib
import json
from datetime import datetime
from pathlib import Path

from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, pre_tokenizers, processors
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers.models import BPE

# Text split before BPE, by `tokenizer.ggml.pre`; names missing here use GPT-2's own split.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZER_SPLITS = {
    "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT, "smaug-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT,
}
GPT2_STYLE_PRE = {"default", "gpt2", "smollm", "gpt-2", "starcoder", "refact", "olmo"}
# Tokens that end a chat turn in common templates; each counts as a stop token when in the vocabulary.
CHAT_END_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end_of_text|>", "<|endoftext|>", "<end_of_turn>",
                   "<|end|>")
CONTROL, USER_DEFINED = 3, 4  # llama.cpp token types


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's printable spelling of each byte (the alphabet byte-level vocabularies are written in)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1))
    chars, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in chars:
            chars[b], extra = chr(256 + extra), extra + 1
    return chars


class Tokenizer:
    def __init__(self, backend: BackendTokenizer, eos_token_id: int | None, bos_token_id: int | None,
                 chat_template: str | None, extra_stop_ids: tuple[int, ...] = ()):
        self.backend = backend
        self.eos_token_id, self.bos_token_id = eos_token_id, bos_token_id
        self.chat_template = chat_template
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        stops = {i for i in (eos_token_id, *extra_stop_ids) if i is not None}
        stops |= {i for t in CHAT_END_TOKENS if (i := backend.token_to_id(t)) is not None}
        self.stop_token_ids = frozenset(stops)
        self._template = None

    # -- text <-> ids -------------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """add_special_tokens=True: what the model expects around a raw prompt (a BOS for models that
        want one); chat text from apply_chat_template already carries its own, so encode it without."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def vocab_fingerprint(self) -> str:
        """sha256 of the token list in id order: equal fingerprints mean interchangeable token ids."""
        tokens = "\n".join(self.backend.id_to_token(i) or "" for i in range(self.vocab_size))
        return hashlib.sha256(tokens.encode("utf-8")).hexdigest()

    # -- chat ---------------------------------------------------------------------------------------
    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if not self.chat_template:
            raise ValueError("this model has no chat template; use /v1/completions with a plain prompt")
        if self._template is None:
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=["jinja2.ext.loopcontrols"])
            env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False: json.dumps(
                x, indent=indent, ensure_ascii=ensure_ascii)
            env.globals["raise_exception"] = _raise_template_error
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            self._template = env.from_string(self.chat_template)
        special = {name: self.token(i) if i is not None else None
                   for name, i in (("bos_token", self.bos_token_id), ("eos_token", self.eos_token_id))}
        return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt, **special)


def _raise_template_error(message: str):
    raise TemplateError(message)


class StreamDecoder:
    """Turns token ids arriving one step at a time into text, holding back incomplete UTF-8.

    Decodes a short window (the last emitted tokens plus the new ones) rather than the whole
    sequence, and emits only text that no later token can change.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self.tokenizer, self.skip_special_tokens = tokenizer, skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0  # window start: context so the decoder sees word boundaries
        self.read_offset = 0  # tokens before this have been emitted

    def push(self, new_ids: list[int]) -> str:
        self.ids.extend(new_ids)
        emitted, text = self._window()
        if len(text) <= len(emitted) or text.endswith("\ufffd"):
            return ""  # an incomplete multibyte character: wait for the next token
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return text[len(emitted):]

    def flush(self) -> str:
        """Whatever is still held back at the end of the sequence (replacement characters included)."""
        emitted, text = self._window()
        self.prefix_offset = self.read_offset = len(self.ids)
        return text[len(emitted):]

    def _window(self) -> tuple[str, str]:
        """The window's text already emitted, and its text with every token so far."""
        decode = self.tokenizer.decode
        return (decode(self.ids[self.prefix_offset:self.read_offset], self.skip_special_tokens),
                decode(self.ids[self.prefix_offset:], self.skip_special_tokens))


# -- builders -----------------------------------------------------------------------------------------
def tokenizer_from_gguf(meta: dict) -> Tokenizer:
    """meta: the GGUF's fields by key (tokenizer.ggml.*, tokenizer.chat_template)."""
    kind = meta.get("tokenizer.ggml.model")
    tokens = meta["tokenizer.ggml.tokens"]
    types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    if kind == "gpt2":
        backend, whole = _byte_level_backend(meta)
    elif kind == "llama":
        backend, whole = _sentencepiece_backend(meta), set(tokens)
    else:
        raise ValueError(f"GGUF tokenizer {kind!r} is not supported (supported: 'gpt2' byte-level BPE, 'llama')")
    # Control tokens (<|im_end|>, <s>...) and user-defined ones must stay whole, never cut into pieces.
    backend.add_special_tokens([AddedToken(t, normalized=False, special=True)
                                for t, k in zip(tokens, types) if k == CONTROL and t in whole])
    backend.add_tokens([AddedToken(t, normalized=False, special=False)
                        for t, k in zip(tokens, types) if k == USER_DEFINED and t in whole])
    bos = meta.get("tokenizer.ggml.bos_token_id")
    if meta.get("tokenizer.ggml.add_bos_token", kind == "llama") and bos is not None:
        backend.post_processor = processors.TemplateProcessing(
            single=f"{tokens[bos]} $A", pair=f"{tokens[bos]} $A {tokens[bos]} $B", special_tokens=[(tokens[bos], bos)])
    extra = tuple(meta[k] for k in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id") if k in meta)
    return Tokenizer(backend, meta.get("tokenizer.ggml.eos_token_id"), bos, meta.get("tokenizer.chat_template"), extra)


def _byte_level_backend(meta: dict) -> tuple[BackendTokenizer, set[str]]:
    """GPT-2 style BPE over bytes; returns the tokenizer and the tokens spelled in its byte alphabet."""
    alphabet = _byte_alphabet()
    spelled = set(alphabet.values())
    tokens = meta["tokenizer.ggml.tokens"]
    vocab = {(t if set(t) <= spelled else "".join(alphabet[b] for b in t.encode("utf-8"))): i
             for i, t in enumerate(tokens)}
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    backend = BackendTokenizer(BPE(vocab=vocab, merges=merges, fuse_unk=False))
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre in PRE_TOKENIZER_SPLITS:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(PRE_TOKENIZER_SPLITS[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    elif pre in GPT2_STYLE_PRE:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        supported = sorted(GPT2_STYLE_PRE | set(PRE_TOKENIZER_SPLITS))
        raise ValueError(f"GGUF pre-tokenizer {pre!r} is not supported (supported: {', '.join(supported)})")
    backend.decoder = decoders.ByteLevel()
    return backend, {t for t in tokens if set(t) <= spelled}


def _sentencepiece_backend(meta: dict) -> BackendTokenizer:
    """SentencePiece BPE (llama, mistral): "▁" for spaces, <0xNN> byte fallback, merges by score.

    The file has scores, not merges: every split of a token into two vocabulary tokens is a merge,
    ranked by the merged token's score (ties: longer left piece first), as transformers does.
    """
    tokens, scores = meta["tokenizer.ggml.tokens"], meta.get("tokenizer.ggml.scores")
    if scores is None:
        raise ValueError("GGUF sentencepiece tokenizer without tokenizer.ggml.scores")
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = []
    for token, score in zip(tokens, scores):
        pairs = [(token[:cut], token[cut:]) for cut in range(1, len(token))]
        pairs = sorted((p for p in pairs if p[0] in vocab and p[1] in vocab), key=lambda p: (vocab[p[0]], vocab[p[1]]))
        merges += [(score, left, right) for left, right in pairs]
    merges.sort(key=lambda m: (m[0], len(m[1]), len(m[2])), reverse=True)
    backend = BackendTokenizer(BPE(vocab=vocab, merges=[(l, r) for _, l, r in merges], fuse_unk=True,
                                   byte_fallback=True))
    prefix = meta.get("tokenizer.ggml.add_space_prefix", True)
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first" if prefix else "never",
                                                     split=False)
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    backend.decoder = decoders.Sequence(steps + ([decoders.Strip(content=" ", left=1)] if prefix else []))
    return backend


def tokenizer_from_hf_dir(directory: Path, config: dict) -> Tokenizer:
    path = directory / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"{directory}: no tokenizer.json (the embedded engine needs a fast tokenizer file)")
    backend = BackendTokenizer.from_file(str(path))
    tok_config = _read_json(directory / "tokenizer_config.json")
    template = tok_config.get("chat_template")
    if (directory / "chat_template.jinja").is_file():
        template = (directory / "chat_template.jinja").read_text()

    def token_id(name: str, config_key: str) -> int | None:
        value = tok_config.get(name)
        value = value.get("content") if isinstance(value, dict) else value
        if isinstance(value, str) and backend.token_to_id(value) is not None:
            return backend.token_to_id(value)
        ids = config.get(config_key)
        return ids[0] if isinstance(ids, list) else ids

    generation = _read_json(directory / "generation_config.json").get("eos_token_id")
    extra = tuple(generation if isinstance(generation, list) else [generation] if generation is not None else [])
    return Tokenizer(backend, token_id("eos_token", "eos_token_id"), token_id("bos_token", "bos_token_id"),
                     template, extra)


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}
