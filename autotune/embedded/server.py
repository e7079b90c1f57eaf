"""The embedded engine's HTTP server: the OpenAI API, health, Prometheus metrics and runtime knobs.

Endpoints:
  POST /v1/completions, POST /v1/chat/completions   OpenAI API, streamed (SSE) or not; see openai_api
  GET  /v1/models                                    the one model served
  GET  /health                                       200 once the model is loaded (503 while shutting down)
  GET  /metrics                                      Prometheus text; see metrics
  GET  /admin/runtime, POST /admin/runtime           read / change runtime knobs (JSON object:
                                                     draft_length, draft_policy, ngram_min, ngram_max)
                                                     without a restart; 400 on bad values

Requests queue in the engine when every slot is busy. A client that disconnects has its request
cancelled, which frees its slot. With a request timeout (`autotune serve --request-timeout S`; default
none, as in vLLM), a request still unfinished S seconds after it arrived, queued or generating, is
cancelled in the engine and ends as llama-server ends one past its `t_max_predict_ms`: a normal response
with what was generated so far and finish_reason "length" (streams: a last chunk saying so), counted in
autotune_request_timeouts_total and logged. SIGTERM: stop accepting, abort what is in flight, exit 0.
"""
import asyncio
import json
import logging
import signal
import socket
import time
from typing import NamedTuple

import uvicorn
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from autotune.embedded import metrics
from autotune.embedded.config import GenerationEvent, GenerationRequest
from autotune.embedded.openai_api import (
    BadRequest,
    ParsedRequest,
    ResponseFormat,
    StopStrings,
    error_body,
    parse_request,
    usage,
)
from autotune.embedded.tokenizer import StreamDecoder

log = logging.getLogger(__name__)


def _error(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None):
    return JSONResponse(error_body(message, kind, param), status_code=status)


class Piece(NamedTuple):
    text: str
    finish_reason: str | None = None  # set on the last piece only, with usage
    usage: dict | None = None
    error: str | None = None  # the engine's message when finish_reason is "error"


class _Run:
    """One request in the engine, seen from the event loop: engine events in, text pieces out."""

    def __init__(self, engine, parsed: ParsedRequest, deadline: float | None, counts: metrics.HttpCounts):
        self.engine, self.parsed = engine, parsed
        self.deadline, self.counts = deadline, counts  # time.monotonic() at which the request is cancelled
        self.queue: asyncio.Queue[GenerationEvent] = asyncio.Queue()
        self.finished = self.timed_out = False
        loop = asyncio.get_running_loop()

        def on_event(event: GenerationEvent):  # called on the engine's thread
            try:
                loop.call_soon_threadsafe(self.queue.put_nowait, event)
            except RuntimeError:  # the event loop is closed: the server is gone
                pass

        tokenizer = engine.tokenizer
        stop_ids = frozenset() if parsed.params.ignore_eos else tokenizer.stop_token_ids
        request = GenerationRequest(parsed.prompt_ids, parsed.params, stop_ids, parsed.prompt_text)
        self.id = engine.submit(request, on_event)

    async def pieces(self):
        """Yields text pieces while generating, then one last piece with the finish reason and usage."""
        decoder, stops = StreamDecoder(self.engine.tokenizer), StopStrings(self.parsed.stop)
        received = 0
        while True:
            event = await self._next_event()
            received += len(event.new_token_ids)
            text = stops.feed(decoder.push(event.new_token_ids))
            if stops.stopped and event.finish_reason is None:
                self.engine.cancel(self.id)  # the rest is cut off anyway: free the slot now
                while event.finish_reason is None:
                    event = await self.queue.get()
            if event.finish_reason is None:
                if text:
                    yield Piece(text)
                continue
            self.finished = True
            text += stops.feed(decoder.flush()) + stops.flush()
            # A stop string ends the request early; count what was generated up to it.
            completion = received if stops.stopped else event.completion_tokens
            finish = "stop" if stops.stopped else event.finish_reason
            if self.timed_out and finish == "abort":  # cancelled by us at the deadline, not by a shutdown
                finish = "length"
            yield Piece(text, finish, usage(len(self.parsed.prompt_ids), completion, event), event.error)
            return

    async def _next_event(self) -> GenerationEvent:
        if self.deadline is None or self.timed_out:
            return await self.queue.get()
        try:
            return await asyncio.wait_for(self.queue.get(), self.deadline - time.monotonic())
        except asyncio.TimeoutError:
            self.timed_out = True
            self.counts.timeouts += 1
            log.info("request timeout: cancelled after %d prompt tokens", len(self.parsed.prompt_ids))
            self.engine.cancel(self.id)  # its events up to the abort still arrive, then the slot is free
            return await self.queue.get()

    def close(self):
        if not self.finished:
            self.finished = True
            self.engine.cancel(self.id)


class _State:
    draining = False  # set at shutdown: refuse new generations, report unhealthy


class _CountRequests:
    """ASGI middleware: every HTTP request, by path and the status answered (refused ones included)."""

    def __init__(self, app, counts: metrics.HttpCounts, paths: set[str]):
        self.app, self.counts, self.paths = app, counts, paths

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = None

        async def send_counted(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        path = scope["path"] if scope["path"] in self.paths else "other"  # a bounded set of label values
        try:
            await self.app(scope, receive, send_counted)
        except Exception:
            status = status or 500  # the server's error handler, outside this middleware, answers it
            raise
        finally:
            self.counts.by_status[path, status or 499] += 1  # 499: the client left before any response


def build_app(engine, request_timeout: float | None = None) -> Starlette:
    """The server's routes; `request_timeout`: seconds after which a request is cancelled (None: never)."""
    state, counts = _State(), metrics.HttpCounts()

    def log_done(parsed: ParsedRequest, last: Piece, started: float):
        log.info("%s %s prompt=%d completion=%d %.2fs accept_length=%.2f",
                 "chat" if parsed.chat else "completion", last.finish_reason, last.usage["prompt_tokens"],
                 last.usage["completion_tokens"], time.monotonic() - started, last.usage["accept_length"])

    async def generate(request: Request, chat: bool) -> Response:
        started = time.monotonic()
        try:
            parsed = parse_request(await request.body(), chat, engine.tokenizer, engine.model_name,
                                   engine.max_seq_len)
        except BadRequest as e:
            log.info("%s 400: %s", request.url.path, e.message)
            return _error(400, e.message, param=e.param)
        if parsed.ignored:
            log.info("%s: ignored unknown fields %s", request.url.path, ", ".join(parsed.ignored))
        if state.draining:
            return _error(503, "the server is shutting down", "server_error")
        fmt = ResponseFormat(parsed)
        run = _Run(engine, parsed, started + request_timeout if request_timeout else None, counts)
        if parsed.stream:
            return StreamingResponse(sse(run, fmt, started), media_type="text/event-stream")

        async def collect() -> tuple[str, Piece]:
            parts = []
            async for piece in run.pieces():
                parts.append(piece.text)
            return "".join(parts), piece

        collecting = asyncio.ensure_future(collect())
        gone = asyncio.ensure_future(_client_gone(request))
        try:
            await asyncio.wait([collecting, gone], return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not collecting.done():
                collecting.cancel()
            run.close()
        if not collecting.done() or collecting.cancelled():
            log.info("%s: client disconnected, request cancelled", request.url.path)
            return Response(status_code=499)
        text, last = collecting.result()
        if last.finish_reason == "error":
            return _error(500, last.error or "generation failed", "server_error")
        log_done(parsed, last, started)
        return JSONResponse(fmt.response(text, last.finish_reason, last.usage))

    async def sse(run: _Run, fmt: ResponseFormat, started: float):
        def data(obj) -> str:
            return f"data: {json.dumps(obj)}\n\n"

        try:
            if fmt.chat:
                yield data(fmt.chunk("", first=True))
            async for piece in run.pieces():
                if piece.finish_reason is None:
                    yield data(fmt.chunk(piece.text))
                elif piece.finish_reason == "error":
                    yield data(error_body(piece.error or "generation failed", "server_error"))
                else:
                    if piece.text:
                        yield data(fmt.chunk(piece.text))
                    yield data(fmt.chunk("", piece.finish_reason))
                    if fmt.include_usage:
                        yield data(fmt.usage_chunk(piece.usage))
                    log_done(run.parsed, piece, started)
            yield "data: [DONE]\n\n"
        finally:  # also reached when the client disconnects (the stream task is cancelled)
            if not run.finished:
                log.info("stream: client disconnected, request cancelled")
            run.close()

    async def completions(request: Request) -> Response:
        return await generate(request, chat=False)

    async def chat_completions(request: Request) -> Response:
        return await generate(request, chat=True)

    async def models(request: Request) -> Response:
        card = {"id": engine.model_name, "object": "model", "created": 0, "owned_by": "autotune",
                "max_model_len": engine.max_seq_len}
        return JSONResponse({"object": "list", "data": [card]})

    async def health(request: Request) -> Response:
        if state.draining:
            return JSONResponse({"status": "shutting down"}, status_code=503)
        return JSONResponse({"status": "ok", "model": engine.model_name, "device": str(engine.device)})

    registry = metrics.registry(lambda: engine.stats(), counts)  # read at each scrape, as they are then

    async def prometheus(request: Request) -> Response:
        return Response(metrics.render(registry), media_type=metrics.CONTENT_TYPE)

    async def runtime(request: Request) -> Response:
        if request.method == "GET":
            return JSONResponse(engine.update_runtime())
        try:
            knobs = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            return _error(400, f"request body is not valid JSON: {e}")
        if not isinstance(knobs, dict):
            return _error(400, "request body must be a JSON object of runtime knobs")
        try:
            current = engine.update_runtime(**knobs)
        except ValueError as e:
            return _error(400, str(e))
        log.info("runtime knobs now %s", current)
        return JSONResponse(current)

    async def internal_error(request: Request, exc: Exception) -> Response:
        log.exception("%s failed", request.url.path)
        return _error(500, f"internal error: {type(exc).__name__}: {exc}", "server_error")

    routes = [
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/models", models),
        Route("/health", health),
        Route("/metrics", prometheus),
        Route("/admin/runtime", runtime, methods=["GET", "POST"]),
    ]
    app = Starlette(routes=routes, exception_handlers={Exception: internal_error},
                    middleware=[Middleware(_CountRequests, counts=counts, paths={r.path for r in routes})])
    app.state.server = state
    return app


async def _client_gone(request: Request):
    """Returns when the client of a (fully read) request disconnects."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class _Server(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, engine, state: _State):
        super().__init__(config)
        self.engine, self.state = engine, state

    async def shutdown(self, sockets=None):
        # Abort in-flight requests first, or uvicorn would wait for every stream to finish.
        self.state.draining = True
        await asyncio.to_thread(self.engine.stop)
        await super().shutdown(sockets)


def bind_error(host: str, port: int) -> str | None:
    """Why host:port cannot be served on, checked before the slow model load; None if it can."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        with socket.socket(infos[0][0], socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
            probe.bind(infos[0][4])
    except OSError as e:
        return f"cannot listen on {host}:{port}: {e.strerror or e}"
    return None


def serve(engine, host: str = "127.0.0.1", port: int = 30000, log_level: str = "info",
          request_timeout: float | None = None) -> None:
    """Serve a loaded engine until SIGTERM or Ctrl-C; returns after a graceful shutdown."""
    app = build_app(engine, request_timeout)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False,
                            timeout_graceful_shutdown=10)
    server = _Server(config, engine, app.state.server)
    # uvicorn re-raises the signal it shut down on, which would kill us with -SIGTERM: make it a no-op.
    signal.signal(signal.SIGTERM, lambda *_: None)
    engine.start()
    try:
        server.run()
    finally:
        if not app.state.server.draining:  # uvicorn never got to its shutdown (e.g. the port was taken)
            engine.stop()
