"""The server's Prometheus metrics, in a registry of their own.

``ServerMetrics`` holds every series ``GET /metrics`` shows; ``render()`` is
the Prometheus text format. The engine updates all of them but the requests
counter, which the HTTP layer increments once per answered request with the
status it returned (``metrics.requests.labels(status="200").inc()``).
Each instance has its own ``CollectorRegistry``, so several engines (tests)
never share a series. With the engine in a process of its own
(dllm_ops/serve/engine_process.py), the HTTP process holds
``ServerMetrics(engine_series=False)`` (the requests counter) and the
engine's series are read from the child at each scrape.
"""
from __future__ import annotations

from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram,
                               generate_latest)

#: seconds; a tiny model's call is ~ms, a real one's ~100 ms
CALL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
REQUEST_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)


class ServerMetrics:
    """Counters, gauges and histograms of one server (see the module docstring)."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, engine_series: bool = True):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("dllm_requests", "HTTP requests answered, by status",
                                ["status"], registry=r)
        if engine_series:
            self._add_engine_series(r)

    def _add_engine_series(self, r: CollectorRegistry) -> None:
        self.queue_depth = Gauge("dllm_queue_depth", "Requests waiting for admission", registry=r)
        self.running = Gauge("dllm_running_sequences", "Sequences decoding", registry=r)
        self.stacked = Gauge("dllm_stacked_sequences",
                             "Running sequences that are rows of a stacked cohort", registry=r)
        self.cohorts = Gauge("dllm_cohorts", "Stacked cohorts running (one decode state each)",
                             registry=r)
        self.generated_tokens = Counter("dllm_generated_tokens",
                                        "Answer tokens committed (streamed prefix growth)", registry=r)
        self.model_calls = Counter("dllm_model_calls", "Batched model calls", registry=r)
        self.call_seconds = Histogram("dllm_model_call_seconds",
                                      "Wall seconds of one engine call (plan, fused forward, commit)",
                                      buckets=CALL_BUCKETS, registry=r)
        self.call_rows = Histogram("dllm_model_call_rows", "Sequences sharing one model call",
                                   buckets=ROW_BUCKETS, registry=r)
        self.request_seconds = Histogram("dllm_request_seconds",
                                         "Wall seconds from submission to a request's last event",
                                         buckets=REQUEST_BUCKETS, registry=r)
        self.kv_bytes_in_use = Gauge("dllm_kv_bytes_in_use",
                                     "KV-cache bytes the running sequences hold now", registry=r)
        self.kv_bytes_reserved = Gauge("dllm_kv_bytes_reserved",
                                       "KV-cache bytes reserved by the running sequences: each "
                                       "single decoder's peak and each cohort's whole slab (what "
                                       "admission counts against --kv-budget)", registry=r)

    def value(self, name: str, **labels) -> float:
        """A sample's current value (0 when the series has none yet), e.g.
        ``value("dllm_running_sequences")`` or ``value("dllm_requests_total", status="200")``."""
        v = self.registry.get_sample_value(name, labels or None)
        return 0.0 if v is None else v

    def render(self) -> bytes:
        """Every series in the Prometheus text exposition format."""
        return generate_latest(self.registry)
