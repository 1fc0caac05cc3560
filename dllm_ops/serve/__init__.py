"""Serving: an engine with continuous batching (``engine``, ``fused``,
``admission``, ``requests``, ``metrics``) and the OpenAI-compatible HTTP
server over it (``app`` and its modules; ``python -m dllm_ops serve``).

Importing this package loads the engine only; the HTTP layer (FastAPI) is
imported where it is used.
"""
from .admission import EngineStopped, QueueFull
from .engine import Engine, SequenceHandle
from .metrics import ServerMetrics
from .requests import Failed, Finished, Progress, Request

__all__ = ["Engine", "SequenceHandle", "Request", "Progress", "Finished", "Failed", "QueueFull",
           "EngineStopped", "ServerMetrics"]
