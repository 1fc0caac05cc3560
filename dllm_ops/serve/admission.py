"""What the engine checks before it queues a request, and what a sequence costs.

:func:`check_request` runs, in the submitting thread and without a model
call, every check a decode of the request would run when it starts (the
prompt, the configuration against this model, a KVQ table against the cache
and the bits), plus the server's own: ``max_tokens`` fits the region, the
region is decoded in full, and the sequence's KV cache fits the budget. A
refusal is a :class:`dllm_ops.errors.DllmOpsError` (the HTTP layer's 400).

:func:`sequence_kv_bytes` is the most KV-cache memory a request's decode holds
at any moment, from its own cache's layout: a full cache
``2 · layers · T · H_kv · d · itemsize`` for the whole decode; a packed 2/4-bit
cache (KIVI / dLLM-KVQ) its packed region and full-precision columns, plus one
full-precision layer while a block-start call writes it (``QuantKVCache.peak_nbytes``;
attention reads the packed codes, so there is no dequantization buffer). Admission reserves this figure, so a
running sequence never outgrows what was admitted, and a quantized cache admits
more sequences under the same budget.
"""
from __future__ import annotations

import numbers

import torch

from ..config import DecodeConfig
from ..decode import decode_parts
from ..errors import ServeError
from ..models import DiffusionLM
from ..plan import KVCache
from ..quant.storage import PackedStorage
from .requests import Request


class QueueFull(ServeError):
    """The wait queue is full (HTTP 429); ``retry_after`` is a hint in seconds."""

    def __init__(self, message: str, *, retry_after: float = 1.0):   # a default: it pickles
        super().__init__(message, code="queue_full", status=429)
        self.retry_after = retry_after


class EngineStopped(ServeError):
    """The engine is shutting down and takes no new request (HTTP 503)."""

    def __init__(self, message: str = "the engine is shutting down and takes no new requests"):
        super().__init__(message, code="engine_stopped", status=503)


def sequence_kv_bytes(model: DiffusionLM, config: DecodeConfig, storage, prompt_len: int) -> int:
    """The peak KV bytes of one request's decode (see the module docstring)."""
    c, shape = model.config, config.shape
    T = prompt_len + shape.gen_length
    if isinstance(storage, PackedStorage):
        # The packed cache allocates nothing until its first call: this is only its geometry.
        cache = storage.new_cache(model, torch.ones((1, T), dtype=torch.bool, device=model.device))
        return cache.peak_nbytes(prompt_len, shape.block_length, shape.blocks_to_decode)
    return KVCache.full_nbytes(c.n_layers, 1, c.n_kv_heads, T, c.head_dim, model.dtype)


def check_request(model: DiffusionLM, request: Request, kv_budget: int | None) -> int:
    """Refuse what the engine cannot run (a DllmOpsError naming the field);
    returns the request's peak KV bytes (:func:`sequence_kv_bytes`)."""
    if not isinstance(request, Request):
        raise ServeError(f"expected a Request, got {type(request).__name__}")
    config = request.config
    if not isinstance(config, DecodeConfig):
        raise ServeError(f"config must be a DecodeConfig, got {type(config).__name__}", param="config")
    ids = request.prompt_ids
    if not isinstance(ids, (list, tuple)) or not all(
            isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in ids):
        raise ServeError("prompt_ids must be a list of integer token ids", param="prompt_ids")
    shape = config.shape
    mt = request.max_tokens
    if not isinstance(mt, numbers.Integral) or isinstance(mt, bool) or mt < 1:
        raise ServeError(f"max_tokens = {mt!r}: must be an integer >= 1", param="max_tokens")
    if mt > shape.gen_length:
        raise ServeError(f"max_tokens = {mt} exceeds shape.gen_length = {shape.gen_length}: the "
                         f"answer is cut from the generated region", param="max_tokens")
    if shape.max_blocks is not None and shape.max_blocks * shape.block_length < mt:
        raise ServeError(f"shape.max_blocks = {shape.max_blocks} decodes only "
                         f"{shape.max_blocks * shape.block_length} tokens, fewer than max_tokens = "
                         f"{mt}: the answer would be cut short", param="shape.max_blocks")
    t = request.timeout_s
    if t is not None and (not isinstance(t, numbers.Real) or isinstance(t, bool) or not t > 0):
        raise ServeError(f"timeout_s = {t!r}: must be a number > 0 or None", param="timeout_s")
    # The checks a Decoder runs when it is built, without allocating its cache.
    _, storage, _, _ = decode_parts(model, [list(ids)], config, [torch.Generator()])
    kv = sequence_kv_bytes(model, config, storage, len(ids))
    if kv_budget is not None and kv > kv_budget:
        raise ServeError(f"this request's KV cache needs {kv} bytes at its peak (prompt {len(ids)} + "
                         f"region {shape.gen_length} tokens, storage {config.storage.method!r}), more "
                         f"than the server's whole KV budget of {kv_budget} bytes (--kv-budget)",
                         param="max_tokens", code="kv_budget")
    return kv

