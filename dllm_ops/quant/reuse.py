"""`generate(..., kv_quant=...)`: Fast-dLLM's prefix/dual reuse with the reused
region stored packed (KIVI, or dLLM-KVQ with a per-layer policy table).

``kv_quant`` is a dict::

    dict(bits=4,                 # 2 or 4, K and V alike
         method="kvq",           # "kivi": p = 0 in every layer; "kvq": per-layer table
         policy="policy.json",   # kvq only: a PolicyTable, its JSON object, or a path
         group=32)               # optional: K token group / V channel group (capped at head_dim)

The wrapped policy decides which tokens run (unchanged); this wrapper only
tells the cache when a block starts, so the block-start forward's reused
region gets packed (dllm_ops/quant/cache.py).
"""
from __future__ import annotations

from ..policies.base import Policy
from .cache import QuantKVCache
from .policy_table import LayerPolicy, PolicyTable

KEYS = {"bits", "method", "policy", "group"}
GROUPS = (8, 16, 32, 64, 128)


def _err(msg: str) -> ValueError:
    return ValueError(f"dllm_ops.generate: kv_quant: {msg}")


class QuantizedReuse(Policy):
    """Runs the wrapped prefix/dual policy; the reused region lives packed."""

    def __init__(self, inner: Policy, *, bits: int, method: str, group: int,
                 layers: list[LayerPolicy], table: PolicyTable | None = None):
        self.inner = inner
        self.name = inner.name
        self.wants_probs = inner.wants_probs
        self.bits, self.method, self.group = bits, method, group
        self.layers = layers
        self.table = table
        self._cache: QuantKVCache | None = None

    def new_cache(self, model, key_valid) -> QuantKVCache:
        c = model.config
        self._cache = QuantKVCache(n_layers=c.n_layers, n_kv_heads=c.n_kv_heads, head_dim=c.head_dim,
                                   key_valid=key_valid.bool(), dtype=model.dtype, device=model.device,
                                   mode=self.inner.name, bits=self.bits, group=self.group,
                                   layers=self.layers)
        return self._cache

    def on_block_start(self, state):
        if not isinstance(state.cache, QuantKVCache):
            # generate() built a plain cache (called with policy=...): swap it
            # before anything was written.
            state.cache = self.new_cache(state.model, state.cache.key_valid)
        state.cache.begin_block(state.block_start, state.block_end)
        return self.inner.on_block_start(state)

    def plan(self, state):
        return self.inner.plan(state)

    def on_step_end(self, state, commit) -> None:
        self.inner.on_step_end(state, commit)

    def kv_quant_stats(self) -> dict:
        s = dict(kv_quant=f"{self.method}{self.bits}", kv_quant_policy=[
            f"{l.score}:{l.p}" for l in self.layers])
        if self._cache is not None:
            s.update(self._cache.stats())
        return s


def quantized_policy(model, inner: Policy, kv_quant) -> QuantizedReuse:
    """Validate ``kv_quant`` (see the module docstring) and wrap ``inner``."""
    if not isinstance(kv_quant, dict):
        raise _err(f"expected a dict(bits=..., method=..., policy=...), got {type(kv_quant).__name__}")
    unknown = sorted(set(kv_quant) - KEYS)
    if unknown:
        raise _err(f"unknown keys {unknown}; allowed: {sorted(KEYS)}")
    if inner.name not in ("prefix", "dual"):
        raise _err(f"quantizes the region a cache reuses: needs cache='prefix' or 'dual', "
                   f"got cache={inner.name!r}")
    bits = kv_quant.get("bits")
    if bits not in (2, 4) or isinstance(bits, bool):
        raise _err(f"bits must be 2 or 4, got {bits!r}")
    group = kv_quant.get("group", 32)
    if group not in GROUPS or isinstance(group, bool):
        raise _err(f"group must be one of {GROUPS}, got {group!r}")
    method = kv_quant.get("method", "kvq")
    policy = kv_quant.get("policy")
    n = model.config.n_layers
    if method == "kivi":
        if policy is not None:
            raise _err("method='kivi' protects no tokens and takes no policy table")
        return QuantizedReuse(inner, bits=bits, method=method, group=group,
                              layers=[LayerPolicy("qerror", 0)] * n)
    if method != "kvq":
        raise _err(f"method must be 'kivi' or 'kvq', got {method!r}")
    if policy is None:
        raise _err("method='kvq' needs policy= (a table from python -m dllm_ops.calibrate, or its path)")
    if isinstance(policy, PolicyTable):
        table = PolicyTable.from_json(policy.to_json())
    elif isinstance(policy, dict):
        table = PolicyTable.from_json(policy)
    elif isinstance(policy, str) or hasattr(policy, "__fspath__"):
        table = PolicyTable.load(str(policy))
    else:
        raise _err(f"policy must be a PolicyTable, a dict or a path, got {type(policy).__name__}")
    table.check(model, inner.name, bits, group)
    return QuantizedReuse(inner, bits=bits, method=method, group=group, layers=list(table.layers),
                          table=table)
