"""The OpenAI wire format of the embedded server: request validation and response bodies.

Requests (`/v1/completions`, `/v1/chat/completions`) accept: `prompt` (string or token id list) or
`messages`, `max_tokens` (or `max_completion_tokens`; default 16 for completions, the rest of the
context for chat; always capped where the context ends, finish_reason "length"), `temperature`
[0, 2], `top_p` (0, 1], `top_k` (0 or -1 = off), `repetition_penalty` (0, 10], `stop` (string or
list; matched on the detokenized text, which is cut before it), `seed`, `ignore_eos` (vLLM/SGLang
extension), `n` (1 only), `stream`, `stream_options.include_usage`, and the extension `draft_length`
(per-request k, 0..MAX_DRAFT_LENGTH). Unknown fields are ignored, as OpenAI-compatible servers do.
Anything invalid raises BadRequest, which the server turns into HTTP 400 with an OpenAI-style error.

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
"""
import json
import time
import uuid
from dataclasses import dataclass, field

from jinja2.exceptions import TemplateError

from autotune.embedded.config import MAX_DRAFT_LENGTH, GenerationEvent, SamplingParams

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat runs to the context end
INT32_MAX = 2**31 - 1


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


def _number(body: dict, name: str, default, low=None, high=None, low_open=False, integer=False):
    value = body.get(name)
    if value is None:
        return default
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds):
        raise BadRequest(f"'{name}' must be {'an integer' if integer else 'a number'}, got {value!r}", name)
    too_low = low is not None and (value <= low if low_open else value < low)
    if too_low or (high is not None and value > high):
        if high is None:
            bounds = f"{'>' if low_open else '>='} {low}"
        else:
            bounds = f"in {'(' if low_open else '['}{low}, {high}]"
        raise BadRequest(f"'{name}' must be {bounds}, got {value!r}", name)
    return value


def _flag(body: dict, name: str, default: bool = False) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise BadRequest(f"'{name}' must be true or false, got {value!r}", name)
    return value


def _stop_strings(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise BadRequest("'stop' must be a non-empty string or a list of non-empty strings", "stop")
    return stops


def _message_text(message, index: int) -> dict:
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise BadRequest(f"messages[{index}] must be an object with a string 'role'", "messages")
    content = message.get("content")
    if isinstance(content, list):  # OpenAI content parts; only text can be served
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
            raise BadRequest(f"messages[{index}].content: only text parts are supported", "messages")
        content = "".join(p["text"] for p in content)
    if content is None:
        content = ""
    if not isinstance(content, str):
        raise BadRequest(f"messages[{index}].content must be a string or a list of text parts", "messages")
    return {"role": message["role"], "content": content}


def _prompt(body: dict, chat: bool, tokenizer) -> tuple[list[int], str]:
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("'messages' must be a non-empty list of {role, content} objects", "messages")
        try:
            text = tokenizer.apply_chat_template([_message_text(m, i) for i, m in enumerate(messages)])
        except (ValueError, TemplateError) as e:  # no template, or the template refuses these messages
            raise BadRequest(f"messages: {e}", "messages") from None
        return tokenizer.encode(text), text
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return tokenizer.encode(prompt), prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if not all(0 <= t < tokenizer.vocab_size for t in prompt):
            raise BadRequest(f"'prompt' token ids must be in [0, {tokenizer.vocab_size})", "prompt")
        return list(prompt), ""
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        raise BadRequest("one prompt per request: 'prompt' must be a string or a list of token ids", "prompt")
    raise BadRequest("'prompt' must be a non-empty string or a non-empty list of token ids", "prompt")


def parse_request(raw: bytes, chat: bool, tokenizer, model_name: str, max_seq_len: int) -> ParsedRequest:
    """Validate a completions (chat=False) or chat completions request body against the engine."""
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BadRequest(f"request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    model = body.get("model") or model_name
    if model != model_name:
        raise BadRequest(f"model {model!r} is not served here; this server serves {model_name!r}", "model")
    if _number(body, "n", 1, integer=True) != 1 or _number(body, "best_of", 1, integer=True) != 1:
        raise BadRequest("only n=1 is supported", "n")
    stream_options = body.get("stream_options") or {}
    if not isinstance(stream_options, dict):
        raise BadRequest("'stream_options' must be an object", "stream_options")

    prompt_ids, prompt_text = _prompt(body, chat, tokenizer)
    if not prompt_ids:
        raise BadRequest("the prompt is empty", "prompt")
    room = max_seq_len - len(prompt_ids)
    if room < 1:
        raise BadRequest(
            f"the prompt has {len(prompt_ids)} tokens; this server's context holds {max_seq_len} tokens "
            f"including the completion", "prompt")
    name = "max_completion_tokens" if body.get("max_tokens") is None else "max_tokens"
    max_tokens = _number(body, name, None, low=1, integer=True)
    if max_tokens is None:
        max_tokens = room if chat else COMPLETIONS_DEFAULT_MAX_TOKENS
    top_k = _number(body, "top_k", 0, low=-1, high=INT32_MAX, integer=True)
    params = SamplingParams(
        max_tokens=min(max_tokens, room),  # the KV cache ends there; finish_reason "length" says so
        temperature=float(_number(body, "temperature", 0.0, low=0, high=2)),
        top_p=float(_number(body, "top_p", 1.0, low=0, high=1, low_open=True)),
        top_k=max(top_k, 0),
        repetition_penalty=float(_number(body, "repetition_penalty", 1.0, low=0, high=10, low_open=True)),
        ignore_eos=_flag(body, "ignore_eos"),
        seed=_number(body, "seed", None, low=-(2**63), high=2**63 - 1, integer=True),  # torch takes int64
        draft_length=_number(body, "draft_length", None, low=0, high=MAX_DRAFT_LENGTH, integer=True),
    )
    return ParsedRequest(
        chat=chat, model=model, prompt_ids=prompt_ids, prompt_text=prompt_text, params=params,
        stop=_stop_strings(body), stream=_flag(body, "stream"),
        include_usage=_flag(stream_options, "include_usage"),
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
