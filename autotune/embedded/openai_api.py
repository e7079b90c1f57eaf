"""The OpenAI wire format of the embedded server: request validation and response bodies.

Requests (`/v1/completions`, `/v1/chat/completions`) accept: `prompt` (a string, a token id list, or a
list holding one of those) or `messages` (each an object with `role` system | developer | user |
assistant and `content`, a string or a list of text parts; `name` is ignored), `model` (a string:
this server's model or empty), `max_tokens` (or `max_completion_tokens`, which wins when both are
given), `temperature` [0, 2], `top_p` (0, 1], `top_k` (0 or -1 = off), `repetition_penalty` (0, 10] (the limits
config.MAX_TEMPERATURE and MAX_REPETITION_PENALTY, the engine's own),
`stop` (string or list; matched on the detokenized text, which is cut before it), `seed`, `ignore_eos`
(vLLM/SGLang extension), `n` and `best_of` (1 only), `stream`, `stream_options` (only with stream:
`include_usage`; `continuous_usage_stats` is accepted and ignored), and the extensions `draft_length`
(per-request k, 0..MAX_DRAFT_LENGTH; it turns the estimator's stop rule off) and `draft_trace` (a boolean:
usage then carries spec_draft_trace). Numbers must be finite JSON numbers of the right kind: a string,
a boolean or 16.0 where an integer is required is refused.

The context, as vLLM does it: a request whose prompt plus max_tokens exceeds the context is refused with
400 ("This model's maximum context length is N tokens. However, you requested M tokens (P in the
messages, C in the completion)..."). Only a default is capped where the context ends (finish_reason
"length"): 16 for completions, the rest of the context for chat.

Fields other servers implement and this one does not (UNSUPPORTED: logprobs, tools, penalties,
response_format, guided decoding, ...) are refused with 400 naming the field, unless they hold the
value that means "off" (`logprobs: false`, `presence_penalty: 0`, `tools: []`, ...): serving the request
without them would change its output silently. Any other unknown field (`user`, `metadata`, `store`,
`service_tier`, ...) is ignored, as vLLM ignores fields it does not know (it logs them; so does this).
Anything invalid raises BadRequest, which the server turns into HTTP 400 with an OpenAI-style error
whose `param` is the field.

`usage` carries, besides OpenAI's prompt_tokens, completion_tokens and total_tokens, what the bench
harness and the tuner read:
  spec_verify_steps     target forward passes that produced tokens (prefill excluded)
  spec_draft_tokens     tokens the drafter proposed
  spec_accepted_tokens  proposed tokens the target accepted
  accept_length         tokens per verify step, (accepted + verify steps) / verify steps (SGLang's
                        definition: 1.0 = no speculation gain); 0 when no verify step ran
  accept_rate           accepted / proposed; 0 when nothing was proposed
  prompt_entropy        mean next-token entropy (nats) over the prompt's first 32 tokens; null if
                        the engine did not measure it
  spec_rejections       verify steps that stopped at a rejected proposal (alpha's maximum likelihood
                        is accepted / (accepted + rejections))
  spec_draft_seconds    time spent drafting in this request's steps (a batched step counts whole)
  spec_verify_seconds   time spent in the target's verify passes of this request's steps
  spec_draft_trace      with draft_trace only: per verify step [entropies, top-1 probabilities, accepted] of
                        its proposed tokens (the draft's laws; n-gram: the target's at the last accepted token)
"""
import functools
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Annotated

from jinja2.exceptions import TemplateError
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from autotune.embedded.config import (
    MAX_DRAFT_LENGTH,
    MAX_REPETITION_PENALTY,
    MAX_TEMPERATURE,
    GenerationEvent,
    SamplingParams,
)

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat runs to the context end
INT32_MAX = 2**31 - 1
ROLES = ("system", "developer", "user", "assistant")  # tool and function turns need tool calls: not served
# Implemented elsewhere (OpenAI, vLLM, SGLang), not here: refused unless the value is one that means "off".
UNSUPPORTED = {
    "logprobs": (None, False), "top_logprobs": (None, 0), "prompt_logprobs": (None,), "echo": (None, False),
    "suffix": (None,), "logit_bias": (None, {}), "presence_penalty": (None, 0), "frequency_penalty": (None, 0),
    "min_p": (None, 0), "min_tokens": (None, 0), "stop_token_ids": (None, []), "bad_words": (None, []),
    "tools": (None, []), "tool_choice": (None, "none", "auto"), "functions": (None, []),
    "function_call": (None, "none", "auto"), "response_format": (None, {"type": "text"}),
    "guided_json": (None,), "guided_regex": (None,), "guided_choice": (None,), "guided_grammar": (None,),
    "structured_outputs": (None,), "use_beam_search": (None, False), "length_penalty": (None, 1),
    "include_stop_str_in_output": (None, False), "skip_special_tokens": (None, True),
    "add_generation_prompt": (None, True), "continue_final_message": (None, False), "modalities": (None, ["text"]),
    "audio": (None,), "prediction": (None,), "reasoning_effort": (None,), "web_search_options": (None,),
}
KNOWN = {"model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
         "repetition_penalty", "stop", "seed", "ignore_eos", "n", "best_of", "stream", "stream_options",
         "draft_length", "draft_trace", *UNSUPPORTED}


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.message, self.param = message, param


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}


@dataclass
class ParsedRequest:
    chat: bool
    model: str
    prompt_ids: list[int]
    prompt_text: str
    params: SamplingParams
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    ignored: list[str] = field(default_factory=list)  # unknown fields, ignored (the server logs them)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None  # per-chunk usage (vLLM): accepted, not sent


NonEmpty = Annotated[str, Field(min_length=1)]


class RequestFields(BaseModel):
    """What both endpoints take besides the prompt, typed and bounded: strict (a string, a boolean or 16.0
    where an integer belongs is refused), the sampling limits the engine's own (config.MAX_*)."""
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)
    model: str | None = None
    n: int | None = None
    best_of: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=MAX_TEMPERATURE)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=-1, le=INT32_MAX)] | None = None  # -1 and 0: off
    repetition_penalty: Annotated[float, Field(gt=0, le=MAX_REPETITION_PENALTY)] | None = None
    seed: Annotated[int, Field(ge=-(2**63), le=2**63 - 1)] | None = None  # torch takes int64
    ignore_eos: bool | None = None
    draft_length: Annotated[int, Field(ge=0, le=MAX_DRAFT_LENGTH)] | None = None
    draft_trace: bool | None = None
    stop: NonEmpty | list[NonEmpty] | None = None


class CompletionRequest(RequestFields):
    prompt: object = None  # a string or token ids: checked against the tokenizer (_prompt)


class ChatRequest(RequestFields):
    messages: object = None  # {role, content} objects: checked against the chat template (_prompt)


def request_fields(body: dict, chat: bool) -> RequestFields:
    try:
        return (ChatRequest if chat else CompletionRequest).model_validate(body)
    except ValidationError as e:
        first = e.errors(include_url=False)[0]
        name = str(first["loc"][0])
        raise BadRequest(f"'{name}': {first['msg']}, got {json.dumps(body.get(name))[:80]}", name) from None


def _is_off(value, off) -> bool:
    if type(off) is int:
        return type(value) in (int, float) and value == off  # 0 and 0.0 alike, never false
    return type(value) is type(off) and value == off


def _unsupported(body: dict):
    for name, offs in UNSUPPORTED.items():
        value = body.get(name)
        if not any(_is_off(value, off) for off in offs):
            raise BadRequest(f"'{name}' is not supported by this server (got {json.dumps(value)[:80]}); "
                             f"leave it out", name)


def _message_text(message, index: int) -> dict:
    where = f"messages[{index}]"
    if not isinstance(message, dict):
        raise BadRequest(f"{where} must be an object with 'role' and 'content'", "messages")
    if message.get("role") not in ROLES:
        raise BadRequest(f"{where}.role must be one of {', '.join(ROLES)}, got {message.get('role')!r}", "messages")
    if message.get("tool_calls"):
        raise BadRequest(f"{where}.tool_calls: tool calls are not supported by this server", "messages")
    content = message.get("content")
    if isinstance(content, list):  # OpenAI content parts; only text can be served
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
            raise BadRequest(f"{where}.content: only text parts are supported", "messages")
        content = "".join(p["text"] for p in content)
    if content is None:
        raise BadRequest(f"{where}.content is missing: every message needs a string or a list of text parts",
                         "messages")
    if not isinstance(content, str):
        raise BadRequest(f"{where}.content must be a string or a list of text parts", "messages")
    return {"role": message["role"], "content": content}


def _encode(tokenizer, text: str, param: str, max_seq_len: int) -> list[int]:
    # No token spells more than longest_token_chars characters (+1: one a token's bytes may start): a longer
    # text cannot fit however it tokenizes, and is refused before the tokenizer spends seconds on megabytes.
    if len(text) > max_seq_len * (longest_token_chars(tokenizer) + 1):
        raise BadRequest(f"'{param}' has {len(text)} characters: more than this server's context of {max_seq_len} "
                         f"tokens can hold", param)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise BadRequest(f"'{param}' is not valid Unicode (a lone surrogate escape)", param) from None
    ids = tokenizer.encode(text)
    if not ids:  # e.g. "\x1d": the tokenizer's normalizer drops it, leaving nothing to condition on
        raise BadRequest(f"'{param}' has no tokens: the model's tokenizer reads {text!r} as nothing", param)
    return ids


@functools.cache
def longest_token_chars(tokenizer) -> int:
    return max(len(tokenizer.decode([i], skip_special_tokens=False)) for i in range(tokenizer.vocab_size))


def _prompt(body: dict, chat: bool, tokenizer, max_seq_len: int) -> tuple[list[int], str]:
    if chat:
        if body.get("prompt") is not None:
            raise BadRequest("'prompt' belongs to /v1/completions; chat takes 'messages'", "prompt")
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("'messages' must be a non-empty list of {role, content} objects", "messages")
        try:
            text = tokenizer.apply_chat_template([_message_text(m, i) for i, m in enumerate(messages)])
        except (ValueError, TemplateError) as e:  # no template, or the template refuses these messages
            raise BadRequest(f"messages: {e}", "messages") from None
        return _encode(tokenizer, text, "messages", max_seq_len), text
    if body.get("messages") is not None:
        raise BadRequest("'messages' belongs to /v1/chat/completions; completions take 'prompt'", "messages")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one prompt
    if isinstance(prompt, str) and prompt:
        return _encode(tokenizer, prompt, "prompt", max_seq_len), prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if not all(0 <= t < tokenizer.vocab_size for t in prompt):
            raise BadRequest(f"'prompt' token ids must be in [0, {tokenizer.vocab_size})", "prompt")
        return list(prompt), ""
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        raise BadRequest("one prompt per request: 'prompt' must be a string or a list of token ids", "prompt")
    raise BadRequest("'prompt' must be a non-empty string or a non-empty list of token ids", "prompt")


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def parse_request(raw: bytes, chat: bool, tokenizer, model_name: str, max_seq_len: int) -> ParsedRequest:
    """Validate a completions (chat=False) or chat completions request body against the engine: every
    field's type and range first, then the prompt (tokenized) against the context."""
    try:
        body = json.loads(raw, parse_constant=_refuse_constant)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:  # JSONDecodeError is a ValueError
        raise BadRequest(f"request body is not valid JSON: {str(e)[:200]}") from None
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    fields = request_fields(body, chat)
    model = fields.model or model_name
    if model != model_name:
        raise BadRequest(f"model {model!r} is not served here; this server serves {model_name!r}", "model")
    for name in ("n", "best_of"):
        if getattr(fields, name) not in (None, 1):
            raise BadRequest(f"only {name}=1 is supported", name)
    _unsupported(body)
    if fields.stream_options is not None and not fields.stream:
        raise BadRequest("'stream_options' is only allowed when 'stream' is true", "stream_options")
    include_usage = bool(fields.stream_options and fields.stream_options.include_usage)
    asked = {"max_completion_tokens": fields.max_completion_tokens, "max_tokens": fields.max_tokens}
    params = SamplingParams(
        max_tokens=0,  # set below, once the prompt's length is known
        temperature=float(fields.temperature or 0.0),
        top_p=float(1.0 if fields.top_p is None else fields.top_p),
        top_k=max(fields.top_k or 0, 0),
        repetition_penalty=float(1.0 if fields.repetition_penalty is None else fields.repetition_penalty),
        ignore_eos=bool(fields.ignore_eos),
        seed=fields.seed,
        draft_length=fields.draft_length,
        draft_trace=bool(fields.draft_trace),
    )
    stop = [fields.stop] if isinstance(fields.stop, str) else fields.stop or []

    prompt_ids, prompt_text = _prompt(body, chat, tokenizer, max_seq_len)
    where = "messages" if chat else "prompt"
    if len(prompt_ids) >= max_seq_len:
        raise BadRequest(f"This model's maximum context length is {max_seq_len} tokens. However, you requested "
                         f"{len(prompt_ids)} tokens in the {where}, leaving no room for the completion. Please reduce "
                         f"the length of the {where}.", where)
    room = max_seq_len - len(prompt_ids)
    name = "max_completion_tokens" if asked["max_completion_tokens"] is not None else "max_tokens"
    if asked[name] is None:  # the default, capped where the KV cache ends (finish_reason "length" says so)
        params.max_tokens = room if chat else min(COMPLETIONS_DEFAULT_MAX_TOKENS, room)
    elif asked[name] > room:
        raise BadRequest(f"This model's maximum context length is {max_seq_len} tokens. However, you requested "
                         f"{len(prompt_ids) + asked[name]} tokens ({len(prompt_ids)} in the {where}, {asked[name]} in "
                         f"the completion). Please reduce the length of the {where} or completion.", name)
    else:
        params.max_tokens = asked[name]
    return ParsedRequest(
        chat=chat, model=model, prompt_ids=prompt_ids, prompt_text=prompt_text, params=params, stop=stop,
        stream=bool(fields.stream), include_usage=include_usage, ignored=sorted(set(body) - KNOWN),
    )


class StopStrings:
    """Cuts streamed text before the first stop string; holds back a tail that may begin one."""

    def __init__(self, stops: list[str]):
        self.stops, self.pending, self.stopped = stops, "", False

    def feed(self, text: str) -> str:
        """Text that is safe to emit now. After a stop string is seen, always ''."""
        if self.stopped:
            return ""
        self.pending += text
        hits = [i for i in (self.pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped = True
            out, self.pending = self.pending[: min(hits)], ""
            return out
        keep = max((n for s in self.stops for n in range(min(len(s) - 1, len(self.pending)), 0, -1)
                    if self.pending.endswith(s[:n])), default=0)
        out, self.pending = self.pending[: len(self.pending) - keep], self.pending[len(self.pending) - keep:]
        return out

    def flush(self) -> str:
        out, self.pending = ("" if self.stopped else self.pending), ""
        return out


def usage(prompt_tokens: int, completion_tokens: int, final: GenerationEvent) -> dict:
    spec = final.spec
    steps = spec.verify_steps if spec else 0
    accepted = spec.accepted_tokens if spec else 0
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "spec_verify_steps": steps,
        "spec_draft_tokens": spec.draft_tokens if spec else 0,
        "spec_accepted_tokens": accepted,
        "accept_length": (accepted + steps) / steps if steps else 0.0,
        "accept_rate": spec.accept_rate if spec else 0.0,
        "prompt_entropy": final.prompt_entropy,
        "spec_rejections": spec.rejections if spec else 0,
        "spec_draft_seconds": round(spec.draft_seconds, 6) if spec else 0.0,
        "spec_verify_seconds": round(spec.verify_seconds, 6) if spec else 0.0,
        **({"spec_draft_trace": spec.trace} if spec and spec.trace else {}),
    }


class ResponseFormat:
    """Builds the JSON bodies of one request: whole responses and stream chunks."""

    def __init__(self, parsed: ParsedRequest):
        self.chat, self.model = parsed.chat, parsed.model
        self.id = f"{'chatcmpl' if self.chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.include_usage = parsed.include_usage

    def _envelope(self, obj: str, choices: list, **extra) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices, **extra}

    def response(self, text: str, finish_reason: str, usage_: dict) -> dict:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": finish_reason}
            return self._envelope("chat.completion", [choice], usage=usage_)
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        return self._envelope("text_completion", [choice], usage=usage_)

    def chunk(self, text: str, finish_reason: str | None = None, first: bool = False) -> dict:
        extra = {"usage": None} if self.include_usage else {}
        if self.chat:
            delta = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            return self._envelope("chat.completion.chunk", [choice], **extra)
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        return self._envelope("text_completion", [choice], **extra)

    def usage_chunk(self, usage_: dict) -> dict:
        return self._envelope("chat.completion.chunk" if self.chat else "text_completion", [], usage=usage_)
