"""The HTTP half of the server: an OpenAI-compatible FastAPI app over an Engine.

Endpoints: ``GET /v1/models``, ``POST /v1/completions``,
``POST /v1/chat/completions`` (request fields: dllm_ops/serve/protocol.py),
``GET /health`` (200, with ``engine_pid`` when the engine runs in a process
of its own; 503 while draining or once that process died) and ``GET /metrics``
(Prometheus text). Errors are OpenAI bodies ``{"error": {"message", "type",
"param", "code"}}``: 400 for a bad request, 404 for another model's name or
path, 429 with ``Retry-After`` when the engine's queue is full, 500 for a
failed decode, 503 while draining.

The engine calls back from its own thread with ``Progress`` (the committed
left-to-right prefix grew), then one ``Finished`` or ``Failed``; the events
cross into the event loop with ``call_soon_threadsafe``. A streamed answer
sends a chunk per growth of its text (dllm_ops/serve/answer_text.py), a last
chunk with finish_reason, the usage chunk if asked, and ``data: [DONE]``. A
client that goes away has its sequence cancelled.
"""
from __future__ import annotations

import asyncio
import json
import logging
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from ..config import DecodeConfig
from ..errors import DllmOpsError, ServeError
from .answer_text import AnswerText
from .protocol import ChatCompletionRequest, CompletionRequest, DecodeJob, parse_body, prepare
from .requests import Failed, Finished, Progress
from .requests import Request as EngineRequest
from .responses import SSE_DONE, ResponseShape, Usage, error_body, sse

log = logging.getLogger("dllm_ops.serve")

#: the status counted for a request whose client went away before its answer
CLIENT_CLOSED = 499


@dataclass
class _Outcome:
    finish_reason: str
    usage: Usage


class _EventQueue:
    """The engine thread's events for one request, delivered into the event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()

    def __call__(self, event) -> None:   # the engine's thread
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, event)
        except RuntimeError:   # the loop is closed: nobody waits for this answer any more
            pass


async def _answer(job: DecodeJob, handle, events: _EventQueue, text: AnswerText):
    """``(text piece, None)`` while the answer grows, then ``(last piece, _Outcome)``."""
    while True:
        event = await events.queue.get()
        if isinstance(event, Progress):
            piece = text.update(list(event.token_ids)[: job.max_tokens])
            if piece.stopped:
                handle.cancel()
                yield piece.text, _Outcome("stop", Usage(len(job.prompt_ids), piece.completion_tokens))
                return
            if piece.text:
                yield piece.text, None
        elif isinstance(event, Finished):
            piece = text.finish(list(event.token_ids)[: job.max_tokens])
            if piece.stopped:
                outcome = _Outcome("stop", Usage(event.prompt_tokens, piece.completion_tokens))
            else:
                outcome = _Outcome(event.finish_reason, Usage(event.prompt_tokens, event.completion_tokens))
            yield piece.text, outcome
            return
        elif isinstance(event, Failed):
            raise ServeError(event.message, status=event.status, code="decode_failed")


class _App:
    """The routes' shared state: engine, tokenizer, defaults, metrics, draining."""

    def __init__(self, engine, tokenizer, model_name: str, defaults: DecodeConfig, *,
                 context_length: int, metrics=None, request_timeout: float | None = None):
        self.engine, self.tokenizer, self.model_name = engine, tokenizer, model_name
        self.defaults, self.context_length = defaults, context_length
        self.metrics, self.request_timeout = metrics, request_timeout
        self.draining = False

    def count(self, status: int) -> None:
        if self.metrics is not None:
            self.metrics.requests.labels(status=str(status)).inc()

    def error(self, e: ServeError) -> JSONResponse:
        """The OpenAI error response of ``e`` (429: with the engine's Retry-After)."""
        self.count(e.status)
        message = str(e).removeprefix(f"{ServeError.api}: ")
        headers = None
        if e.status == 429:
            retry = getattr(e, "retry_after", None) or 1
            headers = {"Retry-After": str(max(1, round(retry)))}
        return JSONResponse(error_body(message, status=e.status, param=e.param, code=e.code),
                            status_code=e.status, headers=headers)

    async def job(self, request: Request, kind) -> DecodeJob:
        if self.draining:
            raise ServeError("the server is shutting down", status=503, code="draining")
        raw = await request.body()
        try:
            data = json.loads(raw)
        except ValueError as e:
            raise ServeError(f"the request body is not valid JSON ({e})", code="invalid_json") from None
        req = parse_body(data, kind)
        if req.model != self.model_name:
            raise ServeError(f"model {req.model!r} is not served here; this server serves "
                             f"{self.model_name!r}", param="model", code="model_not_found", status=404)
        return prepare(req, self.tokenizer, self.defaults, self.context_length)

    async def submit(self, job: DecodeJob, request_id: str, events: _EventQueue):
        request = EngineRequest(prompt_ids=job.prompt_ids, config=job.config,
                                max_tokens=job.max_tokens, timeout_s=self.request_timeout,
                                request_id=request_id)
        try:
            return await self.engine.asubmit(request, events)
        except ServeError:   # QueueFull (429), EngineStopped (503), a refused request (400)
            raise
        except DllmOpsError as e:   # the decode's own checks (the prompt, the configuration)
            raise ServeError(str(e), code="invalid_request") from None

    async def complete(self, request: Request, kind, chat: bool):
        try:
            job = await self.job(request, kind)
            request_id = uuid.uuid4().hex
            events = _EventQueue(asyncio.get_running_loop())
            handle = await self.submit(job, request_id, events)
        except ServeError as e:
            return self.error(e)
        shape = ResponseShape(chat=chat, request_id=request_id, model=self.model_name,
                              include_usage=job.include_usage)
        text = AnswerText(self.tokenizer, job.stop)
        if job.stream:
            return StreamingResponse(self.stream(job, handle, events, text, shape),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return await self.whole(request, job, handle, events, text, shape)

    async def whole(self, request: Request, job, handle, events, text, shape):
        watcher = asyncio.create_task(_cancel_on_disconnect(request, handle))
        parts = []
        try:
            async for piece, outcome in _answer(job, handle, events, text):
                parts.append(piece)
                if outcome is not None:
                    self.count(200)
                    return JSONResponse(shape.body("".join(parts), outcome.finish_reason, outcome.usage))
        except ServeError as e:
            return self.error(e)
        except asyncio.CancelledError:
            handle.cancel()
            self.count(CLIENT_CLOSED)
            raise
        finally:
            watcher.cancel()
        return self.error(ServeError("the engine ended the answer without a result", status=500))

    async def stream(self, job, handle, events, text, shape):
        finished = False
        try:
            first = True
            async for piece, outcome in _answer(job, handle, events, text):
                if piece or first and shape.chat:
                    yield sse(shape.chunk(piece, first=first))
                    first = False
                if outcome is not None:
                    yield sse(shape.chunk(None, outcome.finish_reason))
                    if job.include_usage:
                        yield sse(shape.usage_chunk(outcome.usage))
                    finished = True
                    self.count(200)
            yield SSE_DONE
        except ServeError as e:
            finished = True
            self.count(e.status)
            message = str(e).removeprefix(f"{ServeError.api}: ")
            yield sse(error_body(message, status=e.status, param=e.param, code=e.code))
            yield SSE_DONE
        finally:
            if not finished:   # the client went away (the stream was cancelled)
                handle.cancel()
                self.count(CLIENT_CLOSED)


async def _cancel_on_disconnect(request: Request, handle) -> None:
    """Cancel the sequence when the client of a non-streamed request goes away."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            handle.cancel()
            return


class _ReplicaHeader:
    """ASGI middleware: ``x-dllm-replica`` on every response. Plain ASGI (not
    ``@app.middleware``), so streamed bodies and disconnects pass untouched."""

    def __init__(self, app, name: str):
        self.app, self.header = app, (b"x-dllm-replica", name.encode())

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_named(message):
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), self.header]
            await send(message)

        await self.app(scope, receive, send_named)


def _name_the_replica(app: FastAPI, replica: dict, metrics) -> None:
    name = str(replica["replica"])
    app.add_middleware(_ReplicaHeader, name=name)
    if metrics is not None:
        from prometheus_client import Gauge
        Gauge("dllm_replica_info", "The replica that answers this scrape (Ray Serve)", ["replica"],
              registry=metrics.registry).labels(replica=name).set(1)


def create_app(engine, tokenizer, model_name: str, defaults: DecodeConfig, *, context_length: int,
               metrics=None, request_timeout: float | None = None,
               drain_timeout: float = 30.0, replica: dict | None = None) -> FastAPI:
    """The FastAPI app serving ``engine`` (started with the app, drained with
    ``engine.shutdown(drain_timeout)`` when the app shuts down). ``replica``
    (``{"replica": id, "pid": ...}``, one of several under Ray Serve:
    dllm_ops/serve/replicas.py) names the replica in every response's
    ``x-dllm-replica`` header, in ``/health`` and as ``dllm_replica_info``."""
    state = _App(engine, tokenizer, model_name, defaults, context_length=context_length,
                 metrics=metrics, request_timeout=request_timeout)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        yield
        state.draining = True
        drained = await asyncio.to_thread(engine.shutdown, drain_timeout)
        if not drained:
            log.warning("drain timeout (%.1f s) passed with sequences still running", drain_timeout)

    app = FastAPI(title="dllm_ops", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.serving = state
    if replica is not None:
        _name_the_replica(app, replica, metrics)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException):
        return state.error(ServeError(str(exc.detail), status=exc.status_code))

    @app.get("/health")
    async def health():
        if state.draining:
            return JSONResponse({"status": "draining", **(replica or {})}, status_code=503)
        if not engine.alive:   # an engine process that died: nothing can be answered
            return JSONResponse({"status": "engine_failed", **(replica or {})}, status_code=503)
        pid = getattr(engine, "pid", None)   # an engine process's
        return {"status": "ok", **({"engine_pid": pid} if pid is not None else {}), **(replica or {})}

    @app.get("/metrics")
    async def metrics_text():
        if metrics is None:
            return PlainTextResponse("")
        # off the event loop: an engine in another process is asked for its series
        return Response(await asyncio.to_thread(metrics.render), media_type=metrics.content_type)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0,
                                            "owned_by": "dllm_ops"}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await state.complete(request, CompletionRequest, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await state.complete(request, ChatCompletionRequest, chat=True)

    return app
