"""Server replicas under Ray Serve: ``python -m dllm_ops serve --ray --replicas N``.

Each replica is one Ray actor holding the whole single-process server: it
loads the model on its own device (with ``--gpus-per-replica``, Ray sets the
actor's ``CUDA_VISIBLE_DEVICES``, so ``cuda`` is the GPU it was given), runs
its own :class:`~dllm_ops.serve.engine.Engine` with continuous batching, and
answers through the same FastAPI app (:func:`~dllm_ops.serve.app.create_app`).
Ray's HTTP proxy listens on ``--host``/``--port`` and its router spreads the
requests over the replicas; nothing is shared between replicas, so an answer
is the one the single-process server would give.

Which replica answered: every response carries ``x-dllm-replica`` (Ray's
replica id); ``GET /health`` names the replica and its process id; ``GET
/metrics`` is the answering replica's own registry with a
``dllm_replica_info{replica=...}`` series (Ray routes a scrape to any one
replica; scrape Ray's own metrics endpoint for all of them).

Faults: a replica whose process dies is replaced by Ray's controller; the
requests that were running on it end with a 5xx from Ray's proxy (never a
shortened 200), and the others and later requests are served by the live
replicas. ``max_ongoing_requests`` is the engine's ``max_running +
max_queue``, so a replica's own admission (and its 429) stays in charge.

Ray is the optional extra ``pip install .[ray]`` (requirements-ray.txt); it
is imported only here, and only when ``--ray`` is given.
"""
from __future__ import annotations

import argparse
import os
import signal
import threading

from ..errors import ServeError

#: the deployment's and the application's name in Ray Serve
DEPLOYMENT_NAME = "dllm_ops"


def replica_spec(args, defaults) -> dict:
    """What every replica needs to build its server, as plain JSON-able data
    (it crosses into Ray's actors by value)."""
    from .command import served_model_name
    return dict(model=args.model, dtype=args.dtype, device=args.device, threads=args.threads,
                served_model_name=args.served_model_name or served_model_name(args.model),
                max_running=args.max_running, kv_budget=args.kv_budget, max_queue=args.max_queue,
                request_timeout=args.request_timeout, drain_timeout=args.drain_timeout,
                stacking=args.stacking, defaults=defaults.to_dict())


class ServerReplica:
    """One replica: the model, its engine and the app (built when Ray asks)."""

    def __init__(self, spec: dict):
        from ..model_flags import load_model
        from ..config import DecodeConfig
        from .engine import Engine
        from .metrics import ServerMetrics

        self.spec = spec
        load_args = argparse.Namespace(model=spec["model"], dtype=spec["dtype"],
                                       device=spec["device"], threads=spec["threads"])
        self.model, _, _ = load_model(load_args)
        self.defaults = DecodeConfig.from_dict(spec["defaults"])
        self.metrics = ServerMetrics()
        self.engine = Engine(self.model, self.model.tokenizer, max_running=spec["max_running"],
                             kv_budget=spec["kv_budget"], max_queue=spec["max_queue"],
                             metrics=self.metrics, stacking=spec.get("stacking", True))
        self.replica_id = _replica_id()

    def __serve_build_asgi_app__(self):
        from .app import create_app
        spec = self.spec
        return create_app(self.engine, self.model.tokenizer, spec["served_model_name"], self.defaults,
                          context_length=self.model.config.max_seq_len, metrics=self.metrics,
                          request_timeout=spec["request_timeout"],
                          drain_timeout=spec["drain_timeout"],
                          replica={"replica": self.replica_id, "pid": os.getpid()})


def _replica_id() -> str:
    from ray import serve
    try:
        return serve.get_replica_context().replica_id.unique_id
    except Exception:   # outside a replica (a direct construction in a test)
        return f"pid-{os.getpid()}"


def build_application(spec: dict, *, replicas: int, gpus_per_replica: float, cpus_per_replica: float):
    """The Ray Serve application: ``replicas`` copies of :class:`ServerReplica`."""
    from ray import serve
    deployment = serve.deployment(serve.ingress()(ServerReplica), name=DEPLOYMENT_NAME)
    return deployment.options(
        num_replicas=replicas,
        ray_actor_options={"num_gpus": gpus_per_replica, "num_cpus": cpus_per_replica},
        max_ongoing_requests=spec["max_running"] + spec["max_queue"],
        health_check_period_s=2.0,
        graceful_shutdown_timeout_s=spec["drain_timeout"],
    ).bind(spec)


def check_replica_arguments(args) -> None:
    """Bad --replicas / --gpus-per-replica / --cpus-per-replica before Ray starts."""
    if args.replicas < 1:
        raise ServeError(f"--replicas must be at least 1, got {args.replicas}")
    if args.gpus_per_replica < 0 or args.cpus_per_replica < 0:
        raise ServeError("--gpus-per-replica and --cpus-per-replica must not be negative")
    if args.gpus_per_replica > 0 and args.device == "cpu":
        raise ServeError("--gpus-per-replica > 0 with --device cpu: the replicas would hold GPUs "
                         "they never use")


def serve_replicas(args, defaults) -> int:
    """Start (or join, with --ray-address) a Ray cluster, deploy the replicas
    behind Ray's proxy on --host:--port, and run until SIGTERM / SIGINT; then
    delete the application (each replica drains its engine) and stop Ray."""
    check_replica_arguments(args)
    try:
        import ray
        from ray import serve
    except ImportError:
        raise ServeError("--ray needs Ray Serve: pip install '.[ray]' "
                         "(or pip install -r requirements-ray.txt)") from None

    if args.ray_address:
        ray.init(address=args.ray_address, include_dashboard=False, log_to_driver=True)
    else:   # a local instance on this machine only
        ray.init(include_dashboard=False, _node_ip_address=args.host if args.host in
                 ("127.0.0.1", "localhost") else None, log_to_driver=True)
    stop = threading.Event()
    interrupted = []

    def on_signal(signum, frame):
        interrupted.append(signum)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        app = build_application(replica_spec(args, defaults), replicas=args.replicas,
                                gpus_per_replica=args.gpus_per_replica,
                                cpus_per_replica=args.cpus_per_replica)
        serve.run(app, name=DEPLOYMENT_NAME, route_prefix="/", blocking=False)
        print(f"dllm_ops: {args.replicas} replica(s) of {args.model} serving on "
              f"http://{args.host}:{args.port} (Ray Serve)", flush=True)
        stop.wait()
    finally:
        try:
            serve.delete(DEPLOYMENT_NAME)
            serve.shutdown()
        finally:
            ray.shutdown()
    return 130 if interrupted and interrupted[0] == signal.SIGINT else 0
