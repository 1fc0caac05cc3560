"""The engine in a process of its own, so HTTP and decoding each have a core.

In one process, the HTTP half (request parsing, tokenizing, each answer's
text and SSE chunks) and the engine's loop share one interpreter lock: at
high concurrency the server's CPU is one saturated core, the two halves
taking turns (``python -m bench serve``'s ``srv_cpu`` against ``engine``).
:class:`EngineProcess` runs :class:`~dllm_ops.serve.engine.Engine` in a child
process (``multiprocessing``'s spawn: the child imports torch and loads the
model itself, and the parent never touches the device) and gives the HTTP
half the engine's submitter side:

- ``submit`` / ``asubmit`` send the request and wait for the child's
  answer, which is the engine's own: a handle, or the error ``Engine.submit``
  raised (the bad field's 400, ``QueueFull``'s 429 with its ``retry_after``,
  ``EngineStopped``'s 503), so a client sees the same statuses either way.
- A request's events (``Progress``, then ``Finished`` or ``Failed``) come back
  batched once per engine call and reach its ``on_event`` from the parent's
  reader thread; ``cancel`` reaches the engine at its next call.
- The engine's Prometheus series are read from the child at each scrape and
  served beside the parent's own requests counter (:class:`EngineSeries`).
- ``shutdown(drain_timeout)`` drains the engine in the child (the same rule)
  and waits for the child to exit.

If the child dies (a crash, the OOM killer), every request in flight fails
with 500, new ones get 503 and ``alive`` turns False (``/health`` answers
503). The child ignores SIGINT and SIGTERM: the parent drains it, and the
child exits on its own when the parent's end of the pipe closes.

Messages (tuples over one duplex ``multiprocessing`` pipe; each side sends
under a lock, since its threads share the pipe):
parent -> child ``("submit", n, key, Request)``, ``("cancel", key)``,
``("metrics", n)``, ``("shutdown", n, drain_timeout)``;
child -> parent ``("ready", pid)`` or ``("failed", error)`` once at start,
then ``("events", [(key, event), ...])`` and ``("reply", n, ok, value)``.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import multiprocessing
import os
import pickle
import signal
import threading
import time
from dataclasses import dataclass, field

from ..errors import DllmOpsError, ServeError
from .admission import EngineStopped
from .engine import Engine
from .metrics import ServerMetrics
from .requests import INTERNAL_ERROR, Failed, Finished, Request

log = logging.getLogger("dllm_ops.serve")

#: how long a call into the child may take to be answered (it answers between
#: two model calls' Python work, so this only bounds a child that hangs)
REPLY_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class EngineSpec:
    """What the child needs to build the engine: the model (``load_model``'s
    flags) and ``Engine``'s keyword arguments."""
    model: str
    dtype: str = "auto"                 # a model_flags.DTYPES key (auto: by device)
    device: str | None = None
    threads: int | None = None
    engine: dict = field(default_factory=dict)   # max_running, kv_budget, max_queue, stacking
    log_level: str = "info"


def portable_error(e: BaseException) -> BaseException:
    """``e`` if it survives pickling as itself, else a ServeError carrying its
    message (a DllmOpsError stays a 400; anything else is the server's 500)."""
    try:
        back = pickle.loads(pickle.dumps(e))
        if type(back) is type(e) and str(back) == str(e):
            return e
    except Exception:   # noqa: BLE001 -- an exception that does not pickle is rebuilt below
        pass
    if isinstance(e, DllmOpsError):
        return ServeError(str(e), param=getattr(e, "param", None), code=getattr(e, "code", None),
                          status=getattr(e, "status", 400))
    return ServeError(f"the engine failed: {type(e).__name__}: {e}", status=500, code="internal_error")


# ---- the child ---------------------------------------------------------------------------

class _Sender:
    """One pipe end shared by threads: sends are whole messages, one at a time."""

    def __init__(self, conn):
        self.conn, self.lock = conn, threading.Lock()

    def send(self, message) -> None:
        with self.lock:
            self.conn.send(message)


class _ChildEngine(Engine):
    """The engine in the child: events wait in an outbox while a call runs and
    leave in one message after it (one pipe write per call, not per request)."""

    def __init__(self, sender: _Sender, *args, **kw):
        super().__init__(*args, **kw)
        self._sender, self._outbox, self._ticking = sender, [], 0
        self.handles: dict[int, object] = {}

    def post(self, key: int, event) -> None:   # a request's on_event (the engine's thread)
        if isinstance(event, (Finished, Failed)):
            self.handles.pop(key, None)
        self._outbox.append((key, event))
        if not self._ticking:
            self.flush()

    def flush(self) -> None:
        if self._outbox:
            batch, self._outbox = self._outbox, []
            self._sender.send(("events", batch))

    def tick(self) -> bool:
        self._ticking += 1
        try:
            return super().tick()
        finally:
            self._ticking -= 1
            if not self._ticking:
                self.flush()


def _load_engine(spec: EngineSpec, sender: _Sender) -> _ChildEngine:
    from argparse import Namespace

    from ..model_flags import load_model
    model, _, _ = load_model(Namespace(model=spec.model, dtype=spec.dtype, device=spec.device,
                                       threads=spec.threads))
    return _ChildEngine(sender, model, model.tokenizer, metrics=ServerMetrics(), **spec.engine)


def engine_main(conn, spec: EngineSpec) -> None:
    """The child's body: load, say ready, run the engine, serve the parent's messages."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)    # the parent drains us
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=spec.log_level.upper(), format="%(levelname)s: engine: %(message)s")
    sender = _Sender(conn)
    try:
        engine = _load_engine(spec, sender)
    except BaseException as e:   # noqa: BLE001 -- the parent reports it and exits 1
        sender.send(("failed", portable_error(e)))
        return
    sender.send(("ready", os.getpid()))
    engine.start()
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):   # the parent is gone: nobody waits for an answer
            engine.shutdown(0.0)
            return
        kind, *rest = message
        if kind == "submit":
            n, key, request = rest
            try:
                handle = engine.submit(request, lambda event, key=key: engine.post(key, event))
            except Exception as e:   # noqa: BLE001 -- the submitter gets the engine's refusal
                sender.send(("reply", n, False, portable_error(e)))
                continue
            engine.handles[key] = handle
            if handle.done():    # ended before it was stored (post() found nothing to drop)
                engine.handles.pop(key, None)
            sender.send(("reply", n, True, None))
        elif kind == "cancel":
            handle = engine.handles.get(rest[0])
            if handle is not None:
                handle.cancel()
        elif kind == "metrics":
            sender.send(("reply", rest[0], True, list(engine.metrics.registry.collect())))
        elif kind == "shutdown":
            n, timeout = rest
            drained = engine.shutdown(timeout)
            engine.flush()
            sender.send(("reply", n, True, drained))
            return


# ---- the parent ----------------------------------------------------------------------------

class RemoteHandle:
    """The submitter's side of a request in the child (``SequenceHandle``'s methods)."""

    def __init__(self, owner: "EngineProcess", key: int, request_id: str, on_event):
        self._owner, self._key, self.request_id, self._on_event = owner, key, request_id, on_event
        self._done = threading.Event()
        self.outcome: Finished | Failed | None = None

    def cancel(self) -> None:
        """Abort the request at the engine's next call (``Failed(499)`` unless it had ended)."""
        if not self._done.is_set():
            self._owner._send_quietly(("cancel", self._key))

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        return self._done.wait(timeout)

    def deliver(self, event) -> None:   # the parent's reader thread
        if self._done.is_set():
            return
        if isinstance(event, (Finished, Failed)):
            self.outcome = event
        try:
            self._on_event(event)
        except Exception:   # noqa: BLE001 -- the listener is gone; stop decoding for it
            log.exception("request %s: the event callback raised; cancelling it", self.request_id)
            self.cancel()
        if self.outcome is not None:
            self._done.set()


class EngineSeries:
    """A Prometheus collector: the child engine's series, read at each scrape
    (the parent's own ``dllm_requests`` is left to the parent's counter)."""

    def __init__(self, owner: "EngineProcess"):
        self.owner = owner

    def describe(self):   # no fixed names: registering must not call the child
        return []

    def collect(self):
        for family in self.owner.metric_families():
            if family.name != "dllm_requests":
                yield family


class EngineProcess:
    """An :class:`Engine` in a child process, with the engine's submitter side
    (see the module docstring). ``metrics`` is the parent's registry (its
    requests counter); the engine's series join it at each scrape."""

    def __init__(self, spec: EngineSpec, *, metrics: ServerMetrics | None = None,
                 ready_timeout: float = 600.0):
        self.spec, self.ready_timeout = spec, ready_timeout
        self.metrics = metrics if metrics is not None else ServerMetrics(engine_series=False)
        self.metrics.registry.register(EngineSeries(self))
        self.pid: int | None = None
        self._proc = self._conn = None
        self._send_lock, self._state_lock = threading.Lock(), threading.Lock()
        self._handles: dict[int, RemoteHandle] = {}
        self._replies: dict[int, concurrent.futures.Future] = {}
        self._numbers = itertools.count()
        self._gone: str | None = None      # why the child can no longer be reached
        self._stopping = False

    # ---- life --------------------------------------------------------------------------
    def start(self) -> None:
        """Start the child and wait until its model is loaded (the child's load
        error is raised here). A second call does nothing."""
        if self._proc is not None:
            return
        ctx = multiprocessing.get_context("spawn")
        ours, theirs = ctx.Pipe(duplex=True)
        self._proc = ctx.Process(target=engine_main, args=(theirs, self.spec), name="dllm-engine",
                                 daemon=True)
        self._proc.start()
        theirs.close()
        self._conn = ours
        deadline = time.monotonic() + self.ready_timeout
        while not ours.poll(0.2):
            if not self._proc.is_alive():
                break
            if time.monotonic() > deadline:
                self._proc.kill()
                raise RuntimeError(f"dllm_ops serve: the engine process did not load the model within "
                                   f"{self.ready_timeout:.0f} s")
        try:
            kind, value = ours.recv()
        except (EOFError, OSError):   # it died without a word (a crash, the OOM killer)
            self._proc.join(30)
            self._gone = f"the engine process exited with status {self._proc.exitcode} while loading"
            raise RuntimeError(f"dllm_ops serve: {self._gone}") from None
        if kind == "failed":
            self._proc.join(30)
            self._gone = "the engine process failed to start"
            raise value
        self.pid = value
        threading.Thread(target=self._read, name="dllm-engine-reader", daemon=True).start()

    @property
    def alive(self) -> bool:
        """The child runs and answers (False once it exited or after shutdown)."""
        return self._proc is not None and self._gone is None and self._proc.is_alive()

    def shutdown(self, drain_timeout: float | None = None) -> bool:
        """The engine's drain in the child (``Engine.shutdown``), then the child's exit.
        True when every running sequence finished."""
        if self._proc is None:
            return True
        self._stopping = True
        drained = False
        if self._gone is None:
            try:
                wait = None if drain_timeout is None else drain_timeout + REPLY_TIMEOUT_S
                drained = bool(self._call("shutdown", drain_timeout).result(wait))
            except Exception as e:   # noqa: BLE001 -- the child is gone or hangs: it is stopped below
                log.warning("the engine process did not drain: %s", e)
        self._proc.join(30)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(10)
        self._lost("the engine process was shut down")
        return drained

    # ---- the submitter's side ----------------------------------------------------------------
    def _submission(self, request: Request, on_event):
        if not isinstance(request, Request):
            raise ServeError(f"expected a Request, got {type(request).__name__}")
        key = next(self._numbers)
        handle = RemoteHandle(self, key, request.request_id, on_event)
        with self._state_lock:
            self._handles[key] = handle   # before the child can send its first event
        return key, handle, self._call("submit", key, request)

    def _submitted(self, key: int, handle: RemoteHandle, reply: concurrent.futures.Future):
        with self._state_lock:   # whoever pops a reply sets it: the reader, _lost or this
            unanswered = self._replies.pop(reply.number, None) is not None
        if unanswered:   # a child that hangs: the request must not decode for nobody
            self._send_quietly(("cancel", key))
            reply.set_exception(EngineStopped(f"the engine did not take the request within "
                                              f"{REPLY_TIMEOUT_S:.0f} s"))
        if reply.exception() is not None:
            with self._state_lock:
                self._handles.pop(key, None)
            raise reply.exception()
        return handle

    def submit(self, request: Request, on_event) -> RemoteHandle:
        """``Engine.submit`` in the child: a handle, or the error it raised."""
        key, handle, reply = self._submission(request, on_event)
        concurrent.futures.wait([reply], REPLY_TIMEOUT_S)
        return self._submitted(key, handle, reply)

    async def asubmit(self, request: Request, on_event) -> RemoteHandle:
        """:meth:`submit` without blocking the event loop."""
        key, handle, reply = self._submission(request, on_event)
        await asyncio.wait([asyncio.wrap_future(reply)], timeout=REPLY_TIMEOUT_S)
        return self._submitted(key, handle, reply)

    def metric_families(self) -> list:
        """The child engine's Prometheus metric families (none once it is gone)."""
        if self._gone is not None or self._proc is None:
            return []
        try:
            return self._call("metrics").result(REPLY_TIMEOUT_S)
        except Exception as e:   # noqa: BLE001 -- a scrape shows what it can
            log.warning("the engine's metrics could not be read: %s", e)
            return []

    # ---- the pipe --------------------------------------------------------------------------
    def _call(self, kind: str, *args) -> concurrent.futures.Future:
        reply: concurrent.futures.Future = concurrent.futures.Future()
        n = reply.number = next(self._numbers)
        with self._state_lock:
            if self._gone is not None or self._conn is None:
                reply.set_exception(self._gone_error() if self._gone is not None
                                    else EngineStopped("the engine has not been started"))
                return reply
            self._replies[n] = reply
        try:
            self._send((kind, n, *args))
        except (OSError, ValueError) as e:
            self._lost(f"the engine process cannot be reached ({e})")
        return reply

    def _send(self, message) -> None:
        with self._send_lock:
            self._conn.send(message)

    def _send_quietly(self, message) -> None:
        try:
            self._send(message)
        except (OSError, ValueError):   # the child is gone: nothing to cancel
            pass

    def _gone_error(self) -> ServeError:
        return EngineStopped(f"the engine is not running ({self._gone})")

    def _read(self) -> None:
        """The reader thread: the child's events and replies, until its pipe closes."""
        while True:
            try:
                message = self._conn.recv()
            except (EOFError, OSError):
                break
            if message[0] == "events":
                for key, event in message[1]:
                    with self._state_lock:
                        handle = (self._handles.pop(key, None) if isinstance(event, (Finished, Failed))
                                  else self._handles.get(key))
                    if handle is not None:
                        handle.deliver(event)
            elif message[0] == "reply":
                _, n, ok, value = message
                with self._state_lock:
                    reply = self._replies.pop(n, None)
                if reply is not None:
                    reply.set_result(value) if ok else reply.set_exception(value)
        self._proc.join(5)
        status = self._proc.exitcode
        if not self._stopping:
            log.error("the engine process exited (status %s)", status)
        self._lost(f"the engine process exited (status {status})")

    def _lost(self, why: str) -> None:
        """The child is gone: requests in flight fail (500), pending calls raise."""
        with self._state_lock:
            if self._gone is None:
                self._gone = why
            handles, self._handles = list(self._handles.values()), {}
            replies, self._replies = list(self._replies.values()), {}
        error = self._gone_error()
        for reply in replies:
            reply.set_exception(error)
        for handle in handles:
            handle.deliver(Failed(INTERNAL_ERROR, f"the decode was lost: {self._gone}"))


__all__ = ["EngineProcess", "EngineSpec", "RemoteHandle", "EngineSeries", "engine_main",
           "portable_error"]
