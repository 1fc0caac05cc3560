"""The server's engine: continuous batching over resumable decoders.

One loop owns the model and runs one model call at a time (:meth:`Engine.tick`)
over every running sequence. A request whose configuration stacks
(dllm_ops/serve/stacked.py: ``none`` / ``prefix`` / ``dual``, full storage,
no reuse, a reveal rule that stacks) is a row of its cohort's
:class:`~dllm_ops.serve.stacked.StackedDecodes`, whose plan, K/V write,
attention and commit run once per call for all its rows; any other request
is its own B=1 :class:`dllm_ops.decode.Decoder`. A tick

1. retires what was cancelled (``SequenceHandle.cancel``) or ran past its
   ``timeout_s``, queued or running;
2. admits queued requests, first come first served, while fewer than
   ``max_running`` run and the reserved KV bytes of the running ones plus the
   newcomer's stay within ``kv_budget`` (dllm_ops/serve/admission.py; a
   cohort's whole slab counts, idle slots included, and a row that joins a
   full slab adds one slot of the cohort's width); a newcomer joins this very
   call;
3. plans each running decoder's and cohort's next call (``begin_call``), runs
   ONE fused forward over all of them (dllm_ops/serve/fused.py: every
   configuration shares every call), and commits each one's tokens from its
   own logits (``end_call``);
4. reports each sequence's committed answer prefix as it grows (events in
   dllm_ops/serve/requests.py) and retires the finished ones at once, freeing
   their caches.

A fault inside one sequence (its plan, its part of the forward, its commit)
fails that request with status 500; the others decode on. A fault inside a
cohort's stacked work cannot be told apart by row, so it fails the rows of
that cohort and no one else. ``start()`` runs
the loop in a daemon thread; tests call ``tick()`` themselves and place
submissions between ticks. ``submit`` is thread-safe and checks the request
before queueing it (a bad request raises the DllmOpsError naming the field).
"""
from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from ..decode import Decoder
from ..errors import DllmOpsError, ServeError
from ..models import DiffusionLM
from .admission import EngineStopped, QueueFull, check_request
from .fused import RowCall, fused_step
from .metrics import ServerMetrics
from .stacked import StackedDecodes, canvas_width, cohort_key, slot_nbytes
from .requests import (CANCELLED, INTERNAL_ERROR, STOPPED, TIMED_OUT, Failed, Finished, Progress,
                       Request, committed_answer)

log = logging.getLogger("dllm_ops.serve")


@dataclass(eq=False)
class _Sequence:
    """One request's life in the engine."""
    request: Request
    on_event: Callable
    kv_bytes: int                      # reserved peak KV bytes (admission)
    submitted: float                   # time.monotonic()
    decoder: Decoder | None = None     # while running on its own
    stack: StackedDecodes | None = None  # while running as a row of a cohort
    sent: int = 0                      # answer tokens reported so far
    cancel_requested: bool = False
    outcome: Finished | Failed | None = None
    done: threading.Event = field(default_factory=threading.Event)

    def expired(self, now: float) -> bool:
        t = self.request.timeout_s
        return t is not None and now - self.submitted > t


class SequenceHandle:
    """The submitter's side of a request: cancel it, or wait for its outcome."""

    def __init__(self, seq: _Sequence, engine: "Engine"):
        self._seq, self._engine = seq, engine

    @property
    def request_id(self) -> str:
        return self._seq.request.request_id

    def cancel(self) -> None:
        """Abort the request at the next tick (its slot and KV cache are freed;
        it ends with ``Failed(499)`` unless it had already ended)."""
        self._seq.cancel_requested = True
        self._engine._wake()

    def done(self) -> bool:
        return self._seq.done.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the request ended (True) or ``timeout`` seconds passed (False)."""
        return self._seq.done.wait(timeout)

    @property
    def outcome(self) -> Finished | Failed | None:
        """The final event, once the request ended."""
        return self._seq.outcome


def _positive_int(name: str, value, optional: bool = False):
    if value is None and optional:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ServeError(f"{name} = {value!r}: must be an integer >= 1" + (" or None" if optional else ""),
                         param=name)
    return value


class Engine:
    """Continuous batching over one model (see the module docstring).

    Args:
        max_running: sequences decoding at once.
        kv_budget: bytes of KV cache the running sequences may reserve (None:
            no bound); a request larger than the whole budget is refused.
        max_queue: requests waiting for admission; one more raises QueueFull.
        metrics: a ServerMetrics to update (default: the engine's own).
        stacking: run the requests whose configurations stack as rows of their
            cohort (False: every request its own Decoder, the engine before
            stacking; benchmarks compare the two).
    """

    def __init__(self, model: DiffusionLM, tokenizer=None, *, max_running: int = 16,
                 kv_budget: int | None = None, max_queue: int = 64,
                 metrics: ServerMetrics | None = None, stacking: bool = True):
        self.model, self.tokenizer = model, tokenizer
        self.max_running = _positive_int("max_running", max_running)
        self.kv_budget = _positive_int("kv_budget", kv_budget, optional=True)
        if not isinstance(max_queue, int) or isinstance(max_queue, bool) or max_queue < 0:
            raise ServeError(f"max_queue = {max_queue!r}: must be an integer >= 0", param="max_queue")
        self.max_queue = max_queue
        self.metrics = metrics if metrics is not None else ServerMetrics()
        self._cv = threading.Condition()                      # guards the queue and the flags
        self._queue: collections.deque[_Sequence] = collections.deque()
        self._running: list[_Sequence] = []                   # the ticking thread's
        self._reserved = 0                                    # KV bytes of the running Decoders
        self.stacking = bool(stacking)
        self._stacks: list[StackedDecodes] = []               # the ticking thread's cohorts
        self._tick_lock = threading.Lock()                    # one model call at a time
        self._stopping = False
        self._drain_deadline: float | None = None
        self._drained: bool | None = None
        self._thread: threading.Thread | None = None
        self._latency_ema: float | None = None

    # ---- the submitter's side (any thread) ---------------------------------------------
    def submit(self, request: Request, on_event: Callable) -> SequenceHandle:
        """Check and queue a request; ``on_event`` gets its events from the engine's
        thread. Raises the DllmOpsError of a bad request, QueueFull, or
        EngineStopped once shutdown began."""
        if self._stopping:
            raise EngineStopped()
        kv = check_request(self.model, request, self.kv_budget)
        seq = _Sequence(request, on_event, kv, time.monotonic())
        with self._cv:
            if self._stopping:
                raise EngineStopped()
            if len(self._queue) >= self.max_queue:
                raise QueueFull(f"the wait queue is full ({self.max_queue} requests); retry later",
                                retry_after=self.retry_after())
            self._queue.append(seq)
            self.metrics.queue_depth.set(len(self._queue))
            self._cv.notify_all()
        return SequenceHandle(seq, self)

    async def asubmit(self, request: Request, on_event: Callable) -> SequenceHandle:
        """:meth:`submit` for the HTTP layer's event loop (which also drives an
        engine in another process: dllm_ops/serve/engine_process.py)."""
        return self.submit(request, on_event)

    @property
    def alive(self) -> bool:
        """The loop runs, or has not been started (False once it stopped)."""
        return self._thread is None or self._thread.is_alive()

    def retry_after(self) -> float:
        """Seconds a refused client should wait: the recent request latency, at least 1."""
        return max(1.0, self._latency_ema or 1.0)

    @property
    def queued(self) -> int:
        return len(self._queue)

    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def kv_bytes_reserved(self) -> int:
        """The running Decoders' peak KV bytes plus every cohort's whole slab."""
        return self._reserved + sum(st.nbytes() for st in list(self._stacks))

    def kv_bytes_in_use(self) -> int:
        """KV bytes the running sequences' caches hold now (a cohort's whole slab)."""
        return (sum(s.decoder.state.cache.nbytes() for s in list(self._running) if s.decoder is not None)
                + sum(st.nbytes() for st in list(self._stacks)))

    def build_decoder(self, request: Request) -> Decoder:
        """The decoder of an admitted request that does not stack (tests override
        it to instrument one, with :meth:`cohort_of` sending that request here)."""
        return Decoder(self.model, [list(request.prompt_ids)], request.config)

    # ---- the loop ------------------------------------------------------------------------
    def tick(self) -> bool:
        """One round: retire, admit, one fused model call, commit and report.
        True when a model call ran."""
        with self._tick_lock:
            self._retire_cancelled_and_expired(time.monotonic())
            self._admit()
            ran = self._call()
            self._update_gauges()
            return ran

    def start(self) -> None:
        """Run the loop in a daemon thread (the thread then owns the model)."""
        with self._cv:
            if self._thread is not None:
                return
            self._thread = threading.Thread(target=self._loop, name="dllm-engine", daemon=True)
            self._thread.start()

    def shutdown(self, drain_timeout: float | None = None) -> bool:
        """Stop admitting (queued requests fail with 503), let the running ones
        finish for up to ``drain_timeout`` seconds (None: until done), then
        abort the rest (503). True when every running sequence finished."""
        with self._cv:
            if not self._stopping:
                self._stopping = True
                self._drain_deadline = None if drain_timeout is None else time.monotonic() + drain_timeout
            self._cv.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join()
            return bool(self._drained)
        return self._drain()

    def _wake(self) -> None:
        with self._cv:
            self._cv.notify_all()

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not (self._stopping or self._queue or self._running):
                    self._cv.wait()
                stopping = self._stopping
            if stopping:
                self._drained = self._drain()
                return
            try:
                self.tick()
            except Exception:   # noqa: BLE001 -- a bug in the engine itself must not kill the server
                log.exception("engine tick failed")
                self._fail_all(INTERNAL_ERROR, "the engine failed; see the server log")

    def _drain(self) -> bool:
        with self._cv:
            queued = list(self._queue)
            self._queue.clear()
        for seq in queued:
            self._end(seq, Failed(STOPPED, "the server is shutting down; the request was not started"))
        while self._running:
            deadline = self._drain_deadline
            if deadline is not None and time.monotonic() >= deadline:
                self._fail_all(STOPPED, "the server shut down before the answer was finished "
                                        "(drain timeout)")
                self._update_gauges()
                return False
            self.tick()
        self._update_gauges()
        return True

    # ---- one tick's parts (the ticking thread) --------------------------------------------
    def _retire_cancelled_and_expired(self, now: float) -> None:
        with self._cv:
            leaving = [s for s in self._queue if s.cancel_requested or s.expired(now)]
            for s in leaving:
                self._queue.remove(s)
        for s in leaving + [s for s in self._running if s.cancel_requested or s.expired(now)]:
            if s.cancel_requested:
                self._end(s, Failed(CANCELLED, "the request was cancelled"))
            else:
                self._end(s, Failed(TIMED_OUT, f"the request timed out after {s.request.timeout_s} s "
                                               f"(timeout_s)"))

    def cohort_of(self, request: Request) -> tuple | None:
        """The key of the cohorts a request may join, or None: it runs its own
        Decoder (:meth:`build_decoder`), also when one slot of its width would
        exceed the whole KV budget. (Tests that instrument a request's decoder
        route it to ``build_decoder`` here.)"""
        if not self.stacking:
            return None
        key = cohort_key(self.model, request.config)
        if (key is not None and self.kv_budget is not None
                and slot_nbytes(self.model, self._width_of(request)) > self.kv_budget):
            return None
        return key

    def _width_of(self, request: Request) -> int:
        return canvas_width(self.model, len(request.prompt_ids) + request.config.shape.gen_length)

    def _cohort_for(self, key: tuple, width: int) -> StackedDecodes | None:
        """The running cohort of ``key`` a row of ``width`` joins: of those it fits,
        the one its joining grows least (None: it starts its own)."""
        fitting = [st for st in self._stacks if st.key == key and st.fits(width)]
        return min(fitting, key=lambda st: st.join_nbytes(width), default=None)

    def _admit(self) -> None:
        while True:
            with self._cv:
                if not self._queue or len(self._running) >= self.max_running:
                    return
                seq = self._queue[0]
                key = self.cohort_of(seq.request)
                width = stack = None
                if key is None:
                    cost = seq.kv_bytes
                else:
                    width = self._width_of(seq.request)
                    stack = self._cohort_for(key, width)
                    cost = slot_nbytes(self.model, width) if stack is None else stack.join_nbytes(width)
                if self.kv_budget is not None and self.kv_bytes_reserved + cost > self.kv_budget:
                    return   # first come first served: a large request is not overtaken
                self._queue.popleft()
            self._start(seq, key, width, stack)

    def _start(self, seq: _Sequence, key: tuple | None, width: int | None, stack: StackedDecodes | None) -> None:
        """The admitted request's decode: a row of its cohort (``stack``, or a new
        one of ``width``), or its own Decoder (``key`` None)."""
        try:
            if key is None:
                seq.decoder = self.build_decoder(seq.request)
                self._reserved += seq.kv_bytes
            else:
                if stack is None:
                    stack = StackedDecodes(self.model, seq.request.config, width=width)
                    self._stacks.append(stack)
                stack.add(seq, list(seq.request.prompt_ids), seq.request.config)
                seq.stack = stack
        except DllmOpsError as e:
            self._drop_empty_cohorts()
            self._end(seq, Failed(400, str(e)))
            return
        except Exception as e:   # noqa: BLE001
            self._drop_empty_cohorts()
            self._fault(seq, "starting its decode", e)
            return
        self._running.append(seq)

    def _drop_empty_cohorts(self) -> None:
        """An empty cohort goes, and its slab with it."""
        self._stacks = [st for st in self._stacks if st.rows]

    def _call(self) -> bool:
        t0 = time.perf_counter()
        ready = []
        for seq in list(self._running):
            if seq.stack is not None:
                continue
            try:
                if not seq.decoder.ready():
                    self._report(seq, decode_ended=True)
                    continue
                ready.append((seq, seq.decoder.begin_call()))
            except Exception as e:   # noqa: BLE001 -- one request's fault is that request's
                self._fault(seq, "planning its model call", e)
        stacked = self._begin_cohort_calls()
        if not ready and not stacked:
            return False
        logits = fused_step(self.model, [RowCall.of(seq.decoder, call) for seq, call in ready]
                            + [call for _, _, call in stacked])
        committed = []
        for (seq, call), out in zip(ready, logits):
            if isinstance(out, Exception):
                self._fault(seq, "its part of the model call", out)
                continue
            try:
                seq.decoder.end_call(call, out)
            except Exception as e:   # noqa: BLE001
                self._fault(seq, "committing tokens", e)
                continue
            committed.append(seq)
        for (stack, owners, call), out in zip(stacked, logits[len(ready):]):
            if isinstance(out, Exception):
                self._fault_cohort(owners, "its part of the model call", out)
                continue
            try:
                stack.end_call(call, out)
            except Exception as e:   # noqa: BLE001
                self._fault_cohort(owners, "committing tokens", e)
                continue
            committed.extend(owners)
        seconds = time.perf_counter() - t0
        regions = {}
        for stack, owners, _ in stacked:
            if stack.rows:
                regions.update(zip([r.owner for r in stack.rows], stack.regions()))
        for seq in committed:
            if seq.stack is not None:
                seq.stack.row(seq).wall_s += seconds
                self._report(seq, region=regions[seq])
            elif seq.decoder is not None:
                seq.decoder.wall_s += seconds     # the decode's stats: the calls it took part in
                self._report(seq)
        self.metrics.model_calls.inc()
        self.metrics.call_seconds.observe(seconds)
        self.metrics.call_rows.observe(len(ready) + sum(len(owners) for _, owners, _ in stacked))
        return True

    def _begin_cohort_calls(self) -> list:
        """Each cohort's part of the call: ``(cohort, its rows' sequences, RowCall)``;
        rows whose decode is over are reported (and leave) first."""
        out = []
        for stack in list(self._stacks):
            try:
                over = stack.ready()
            except Exception as e:   # noqa: BLE001 -- the cohort's fault is its rows'
                self._fault_cohort([r.owner for r in stack.rows], "planning its model call", e)
                continue
            for seq in over:
                self._report(seq, decode_ended=True)
            if not stack.rows:
                continue
            owners = [r.owner for r in stack.rows]
            try:
                out.append((stack, owners, stack.begin_call()))
            except Exception as e:   # noqa: BLE001
                self._fault_cohort(owners, "planning its model call", e)
        return out

    def _fault_cohort(self, owners: list, doing: str, e: Exception) -> None:
        for seq in owners:
            self._fault(seq, doing, e)

    def _report(self, seq: _Sequence, decode_ended: bool = False, region: list[int] | None = None) -> None:
        """Send the growth of the committed answer; end the request once it is whole
        (``region``: the sequence's generated region, when the caller read it)."""
        dec, stack, c = seq.decoder, seq.stack, self.model.config
        if region is None:
            if stack is not None:
                region = stack.regions()[stack.index(seq)]
            else:
                region = dec.state.x[0, dec.state.gen_start:].tolist()
        answer = committed_answer(region, mask_id=c.mask_id, eos_id=c.eos_id,
                                  max_tokens=seq.request.max_tokens)
        if len(answer.token_ids) > seq.sent:
            new = answer.token_ids[seq.sent:]
            seq.sent = len(answer.token_ids)
            self.metrics.generated_tokens.inc(len(new))
            self._emit(seq, Progress(answer.token_ids, new))
        if answer.finish_reason is not None:
            stats = stack.stats(seq, region) if stack is not None else dec.result().stats
            text = self.tokenizer.decode(list(answer.token_ids)) if self.tokenizer is not None else None
            self._end(seq, Finished(answer.token_ids, answer.finish_reason,
                                    prompt_tokens=len(seq.request.prompt_ids),
                                    completion_tokens=len(answer.token_ids), stats=stats, text=text))
        elif decode_ended:
            self._end(seq, Failed(INTERNAL_ERROR, f"the decode ended with answer position "
                                                  f"{len(answer.token_ids)} still masked"))

    # ---- ending a request --------------------------------------------------------------------
    def _fault(self, seq: _Sequence, doing: str, e: Exception) -> None:
        log.error("request %s failed while %s", seq.request.request_id, doing, exc_info=e)
        self._end(seq, Failed(INTERNAL_ERROR, f"the decode failed while {doing}: "
                                              f"{type(e).__name__}: {e}"))

    def _fail_all(self, status: int, message: str) -> None:
        for seq in list(self._running):
            self._end(seq, Failed(status, message))

    def _end(self, seq: _Sequence, event: Finished | Failed) -> None:
        """The request's one final event; its slot, reservation and cache go at once."""
        if seq.outcome is not None:
            return
        if seq in self._running:
            self._running.remove(seq)
            if seq.stack is not None:
                seq.stack.remove(seq)
                self._drop_empty_cohorts()
            else:
                self._reserved -= seq.kv_bytes
        seq.decoder = seq.stack = None
        seq.outcome = event
        latency = time.monotonic() - seq.submitted
        self.metrics.request_seconds.observe(latency)
        self._latency_ema = latency if self._latency_ema is None else 0.9 * self._latency_ema + 0.1 * latency
        self._emit(seq, event)
        seq.done.set()

    def _emit(self, seq: _Sequence, event) -> None:
        try:
            seq.on_event(event)
        except Exception:   # noqa: BLE001 -- the listener is gone; stop decoding for it
            log.exception("request %s: the event callback raised; cancelling it", seq.request.request_id)
            seq.cancel_requested = True

    def _update_gauges(self) -> None:
        m = self.metrics
        m.queue_depth.set(len(self._queue))
        m.running.set(len(self._running))
        m.stacked.set(sum(len(st.rows) for st in self._stacks))
        m.cohorts.set(len(self._stacks))
        m.kv_bytes_reserved.set(self.kv_bytes_reserved)
        m.kv_bytes_in_use.set(self.kv_bytes_in_use())


__all__ = ["Engine", "SequenceHandle", "Request", "Progress", "Finished", "Failed", "QueueFull",
           "EngineStopped", "ServerMetrics"]
