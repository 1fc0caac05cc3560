"""How a decode stores its KV cache: the storage axis of a DecodeConfig.

A storage object builds the per-layer KV store of one decode (``new_cache``),
is told where each block starts (``begin_block``), and reports its own stats
(``stats``); the decode loop calls these three and never asks which storage
it holds.

- :class:`FullStorage` (``storage.method = "full"``): the model's dtype,
  ``model.new_cache``.
- :class:`PackedStorage` (``"kivi"`` / ``"kvq"``): Fast-dLLM's prefix/dual
  reuse, or d²Cache's, with the reused region packed in 2/4 bits
  (:class:`QuantKVCache`, dllm_ops/quant/cache.py): KIVI protects no tokens;
  dLLM-KVQ protects, per layer, the tokens its policy table (``python -m
  dllm_ops.calibrate``; d²Cache reads the model's dual table) names. The
  block-start call packs the region the cache reuses during the block
  (d²Cache: the decode's first call packs the whole canvas, and every later
  call re-packs the groups its recomputed tokens fall in).
"""
from __future__ import annotations

from ..config import StorageConfig
from ..errors import DecodeError
from ..plan import KVCache
from ..stats import StorageStats
from .cache import QuantKVCache
from .policy_table import LayerPolicy, PolicyTable


class FullStorage:
    """Every K/V in the model's dtype."""

    def new_cache(self, model, key_valid) -> KVCache:
        return model.new_cache(key_valid)

    def begin_block(self, cache, block_start: int, block_end: int) -> None:
        pass

    def stats(self, cache) -> StorageStats | None:
        return None


class PackedStorage:
    """The reused region packed (KIVI / dLLM-KVQ); see the module docstring."""

    def __init__(self, *, method: str, bits: int, group: int, cache_method: str,
                 layers: list[LayerPolicy]):
        self.method, self.bits, self.group = method, bits, group
        self.cache_method = cache_method
        self.layers = layers

    def new_cache(self, model, key_valid) -> QuantKVCache:
        c = model.config
        return QuantKVCache(n_layers=c.n_layers, n_kv_heads=c.n_kv_heads, head_dim=c.head_dim,
                            key_valid=key_valid.bool(), dtype=model.dtype, device=model.device,
                            mode=self.cache_method, bits=self.bits, group=self.group,
                            layers=self.layers)

    def begin_block(self, cache: QuantKVCache, block_start: int, block_end: int) -> None:
        cache.begin_block(block_start, block_end)

    def stats(self, cache: QuantKVCache) -> StorageStats:
        return StorageStats(method=f"{self.method}{self.bits}",
                            layer_policy=[f"{l.score}:{l.p}" for l in self.layers], **cache.stats())


def make_storage(model, storage: StorageConfig, cache_method: str) -> FullStorage | PackedStorage:
    """The storage of ``storage`` for a decode whose cache method is ``cache_method``
    (a kvq table is loaded and checked against the model, the cache and the bits)."""
    if not storage.packed:
        return FullStorage()
    if cache_method not in ("prefix", "dual", "d2cache"):
        raise DecodeError(f"storage.method {storage.method!r} packs the region a cache reuses: it "
                          f"needs cache 'prefix', 'dual' or 'd2cache', got {cache_method!r}")
    n = model.config.n_layers
    if storage.method == "kivi":
        layers = [LayerPolicy("qerror", 0)] * n
    else:
        table = (PolicyTable.from_json(storage.table) if isinstance(storage.table, dict)
                 else PolicyTable.load(storage.table))
        # A d2cache decode reads a table calibrated for dual: the calibration decodes
        # Fast-dLLM blocks over a packed reused region, the closest setting it has
        # to d2cache's whole-canvas packed cache (README "Quantized d2cache").
        table.check(model, "dual" if cache_method == "d2cache" else cache_method,
                    storage.bits, storage.group)
        layers = list(table.layers)
    return PackedStorage(method=storage.method, bits=storage.bits, group=storage.group,
                         cache_method=cache_method, layers=layers)
