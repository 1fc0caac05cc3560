"""What a decode measured: :class:`DecodeStats` (``GenerateOutput.stats``).

Typed fields, with one sub-object per method that ran (DARE's reuse, the
packed storage, per-layer timings). It is also a read-only mapping with the
flat keys it has always printed and serialized as (``stats["nfe"]``,
``stats["dare_reuse_share"]``, ``json.dumps(dict(stats))``): each field names
its flat key once, in its metadata, and :meth:`_Flat.to_dict` builds the view.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields


def _key(name: str, prefix: str = ""):
    """Field metadata: the flat key a field is printed and serialized under."""
    return {"key": prefix + name}


class _Flat(Mapping):
    """A dataclass read as a flat dict: each field under its ``key`` metadata (or
    its name); a field holding another _Flat (or None) contributes its keys."""

    def to_dict(self) -> dict:
        out = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, _Flat):
                out.update(v.to_dict())
            elif f.metadata.get("nested"):
                continue   # a method that did not run adds no keys
            else:
                out[f.metadata.get("key", f.name)] = list(v) if isinstance(v, tuple) else v
        return out

    def __getitem__(self, key):
        return self.to_dict()[key]

    def __iter__(self):
        return iter(self.to_dict())

    def __len__(self):
        return len(self.to_dict())

    __hash__ = None  # mutable lists inside; compare with ==


def _nested():
    return field(default=None, metadata={"nested": True})


@dataclass(eq=True)
class DareStats(_Flat):
    """DARE's per-layer reuse (dllm_ops/dare.py): shares of (layer, token)
    activations reused. ``reuse_share`` counts the reuse-eligible calls (every
    call but the block starts); ``reuse_share_all_calls`` counts every call."""
    mode: str = field(metadata={"key": "dare"})
    rho: float | None = field(metadata=_key("rho", "dare_"))
    tau: float | None = field(metadata=_key("tau", "dare_"))
    phi_max: float | None = field(metadata=_key("phi_max", "dare_"))
    rule: str = field(metadata=_key("rule", "dare_"))
    reuse_share: float = field(metadata=_key("reuse_share", "dare_"))
    reuse_share_all_calls: float = field(metadata=_key("reuse_share_all_calls", "dare_"))
    reuse_share_per_layer: list = field(metadata=_key("reuse_share_per_layer", "dare_"))
    activations_run: int = field(metadata=_key("activations_run", "dare_"))
    activations_reused: int = field(metadata=_key("activations_reused", "dare_"))
    reused_with_zero_drift_per_layer: list = field(
        metadata=_key("reused_with_zero_drift_per_layer", "dare_"))
    flops_saved: float = field(metadata=_key("flops_saved", "dare_"))


@dataclass(eq=True)
class StorageStats(_Flat):
    """The packed storage of the reused region (dllm_ops/quant/storage.py):
    method and bits (``"kvq4"``), each layer's protection ``score:p``, the peak
    packed bytes against a bf16 cache of the canvas, the bytes each call after
    a pack reads for attention (packed tensors + full-precision columns, mean
    over those calls, summed over layers) against what attention over a bf16
    cache of the canvas reads, and the mean stored bits per K / V element."""
    method: str = field(metadata={"key": "kv_quant"})
    layer_policy: list = field(metadata={"key": "kv_quant_policy"})
    cache_bytes: int | None = field(default=None, metadata={"key": "kv_cache_bytes"})
    cache_bytes_bf16: int | None = field(default=None, metadata={"key": "kv_cache_bytes_bf16"})
    read_bytes_per_call: float | None = field(default=None, metadata={"key": "kv_read_bytes_per_call"})
    read_bytes_per_call_bf16: float | None = field(default=None,
                                                   metadata={"key": "kv_read_bytes_per_call_bf16"})
    k_bits: float | None = None
    v_bits: float | None = None


@dataclass(eq=True)
class LayerTimes(_Flat):
    """Each call's per-layer wall seconds, and which calls were block starts."""
    seconds: list = field(metadata={"key": "layer_seconds"})
    block_start: list = field(metadata={"key": "layer_seconds_block_start"})


@dataclass(eq=True)
class DecodeStats(_Flat):
    """One decode's counts (see ``dllm_ops.generate``)."""
    nfe: int
    wall_s: float
    generated_tokens: int
    tokens_per_s: float
    tokens_recomputed: int          # tokens run, summed over calls and layers
    recomputed_per_step: list       # tokens run per call (one layer)
    n_layers: int
    model_flops: float              # what ran (DARE's reused rows excluded)
    eos_filled: list                # per row, masks filled with EOS after its text ended
    cache: str
    reveal: str
    blocks_decoded: int
    blocks: int
    dare: DareStats | None = _nested()
    kv_quant: StorageStats | None = _nested()
    layer_times: LayerTimes | None = _nested()

    def __repr__(self) -> str:
        return f"DecodeStats({self.to_dict()!r})"
