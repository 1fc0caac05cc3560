"""``python -m dllm_ops serve``: the server's flags and its process.

    python -m dllm_ops serve --model PATH|tiny-llada|tiny-dream [--host 127.0.0.1] [--port 8000]
        [--max-running N] [--kv-budget BYTES] [--max-queue N] [--request-timeout S]
        [--drain-timeout S] [--served-model-name NAME] [--no-stacking] [--engine-thread]
        [--config FILE.json] [--cache ...] [--threshold ...] [--set KEY=VALUE ...]
        [--dtype ...] [--device ...] [--threads N]
        [--ray --replicas N [--gpus-per-replica G] [--cpus-per-replica C] [--ray-address ADDR]]

The decode defaults are built as ``generate``'s are (dllm_ops/cli.py:
``--config``, the dedicated flags, ``--set`` through
:func:`dllm_ops.config.config_from_settings`); a request's ``dllm`` field
merges over them and its ``max_tokens`` sets the region.

SIGTERM drains: new requests get 503, uvicorn waits up to ``--drain-timeout``
for the answers in flight, the engine is shut down with the same bound, and
the process exits 0. SIGINT (Ctrl+C) does the same and then exits as
interrupted.

The engine (the model and the decode loop) runs in a process of its own
(dllm_ops/serve/engine_process.py; this process reads only the checkpoint's
config.json and tokenizer); ``--engine-thread`` keeps it in a thread of the
HTTP process.

With ``--ray``, Ray Serve runs ``--replicas`` copies of this server
(dllm_ops/serve/replicas.py); the flags mean the same for each replica.
"""
from __future__ import annotations

import os


def add_server_arguments(p) -> None:
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument("--served-model-name", default=None,
                   help="the model's name in the API (default: --model's last path component)")
    p.add_argument("--max-running", type=int, default=16,
                   help="sequences decoded together at most (default 16)")
    p.add_argument("--kv-budget", type=int, default=None, metavar="BYTES",
                   help="KV bytes the running sequences may hold (default: no limit)")
    p.add_argument("--max-queue", type=int, default=64,
                   help="requests waiting for a slot at most; beyond it 429 (default 64)")
    p.add_argument("--request-timeout", type=float, default=None, metavar="S",
                   help="a request's limit in seconds, queueing included (default: none)")
    p.add_argument("--drain-timeout", type=float, default=30.0, metavar="S",
                   help="on SIGTERM, how long running requests may take to finish (default 30)")
    p.add_argument("--no-stacking", dest="stacking", action="store_false",
                   help="run every request on its own decoder instead of stacking the requests "
                        "of a cohort into one decode state (dllm_ops/serve/stacked.py; for comparisons)")
    p.add_argument("--engine-thread", action="store_true",
                   help="run the engine in a thread of the HTTP process (the default is a process "
                        "of its own, so HTTP and decoding each have a core: "
                        "dllm_ops/serve/engine_process.py)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    r = p.add_argument_group("replicas under Ray Serve (pip install '.[ray]'; dllm_ops/serve/replicas.py)")
    r.add_argument("--ray", action="store_true",
                   help="serve --replicas copies of the server behind Ray Serve's proxy on --host:--port")
    r.add_argument("--replicas", type=int, default=1, help="replicas, each with its own engine (default 1)")
    r.add_argument("--gpus-per-replica", type=float, default=0.0,
                   help="GPUs Ray gives each replica (default 0: CPU replicas)")
    r.add_argument("--cpus-per-replica", type=float, default=1.0,
                   help="CPUs Ray reserves for each replica (default 1)")
    r.add_argument("--ray-address", default=None,
                   help="join this Ray cluster (default: start a local one on this machine)")


def served_model_name(model_arg: str) -> str:
    return os.path.basename(os.path.normpath(model_arg))


def _engine_kwargs(args) -> dict:
    return dict(max_running=args.max_running, kv_budget=args.kv_budget, max_queue=args.max_queue,
                stacking=args.stacking)


def _engine_in_thread(args):
    """``(engine, tokenizer, context length, metrics)`` with the model in this process."""
    from ..model_flags import load_model
    from .engine import Engine
    from .metrics import ServerMetrics

    model, _, _ = load_model(args)
    metrics = ServerMetrics()
    engine = Engine(model, model.tokenizer, metrics=metrics, **_engine_kwargs(args))
    return engine, model.tokenizer, model.config.max_seq_len, metrics


def _engine_in_process(args):
    """The same with the model in a child process; this one reads only the
    checkpoint's config.json and tokenizer."""
    from ..model_flags import load_front
    from .engine_process import EngineProcess, EngineSpec

    tokenizer, model_config = load_front(args)
    spec = EngineSpec(model=args.model, dtype=args.dtype, device=args.device, threads=args.threads,
                      engine=_engine_kwargs(args), log_level=args.log_level)
    engine = EngineProcess(spec)
    engine.start()   # the model loads (or fails to) before the server listens
    return engine, tokenizer, model_config.max_seq_len, engine.metrics


def serve(args, defaults) -> int:
    """Run the server until SIGTERM / SIGINT; 0 after a drain."""
    import uvicorn

    from .app import create_app
    from .draining import DrainingServer

    engine, tokenizer, context_length, metrics = (_engine_in_thread if args.engine_thread
                                                  else _engine_in_process)(args)
    try:
        app = create_app(engine, tokenizer, args.served_model_name or served_model_name(args.model),
                         defaults, context_length=context_length, metrics=metrics,
                         request_timeout=args.request_timeout, drain_timeout=args.drain_timeout)
        config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                access_log=False, lifespan="on",
                                timeout_graceful_shutdown=args.drain_timeout)
        server = DrainingServer(config, app.state.serving)
        server.run()
    finally:
        engine.shutdown(0.0)   # a no-op after the app's drain; a server that never started
    if not server.started:
        raise RuntimeError(f"the server did not start on {args.host}:{args.port} (see the log above)")
    return 0
