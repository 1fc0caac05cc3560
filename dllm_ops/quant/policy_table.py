"""dLLM-KVQ per-layer policy tables: which K tokens each layer keeps in high precision.

A table is chosen offline (``python -m dllm_ops.calibrate``) for one model,
one cache mode and one bit width; online decoding only reads it. Each layer
gets a token-importance score and a budget ``p`` of protected K tokens per
group (the dLLM-KVQ paper, "K-Cache Policy Selection"; docs/design.md, "dLLM-KVQ"):

- ``"attention"``: the attention the active block's queries give each cache
  token in the block-initial forward, averaged over query heads and queries;
- ``"qerror"``: the token's squared L2 error under plain (p = 0) K
  quantization, per KV head;
- ``"product"``: the two, each divided by its maximum over the quantized
  segment, multiplied.

JSON layout (``format`` ``dllm-kvq-policy/1``)::

    {"format": "dllm-kvq-policy/1", "model": "tiny-llada",
     "fingerprint": {"arch": ..., "n_layers": ..., ..., "weights_sha256": ...},
     "cache": "dual", "bits": 4, "group": 32,
     "layers": [{"score": "attention", "p": 2}, ...],
     "meta": {...}}            # free-form: how it was selected

The fingerprint names the model's shape and a hash of a sample of its
weights, so a table made for another model (or an earlier training run of the
same one) is refused with an error rather than applied silently.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field

import torch

from ..errors import PolicyTableError

FORMAT = "dllm-kvq-policy/1"
SCORES = ("attention", "qerror", "product")
BUDGETS = (0, 1, 2, 4)
CACHE_MODES = ("prefix", "dual")


def model_fingerprint(model) -> dict:
    """Shape fields of the model's config plus the sha256 of a weight sample
    (the first 8 rows of the embedding and of the LM head, rounded to bf16 and
    hashed as float32 bytes, so a model loaded in fp32 or bf16 has one
    fingerprint): cheap even at 8B, and it changes whenever the model is
    retrained."""
    c = model.config
    h = hashlib.sha256()
    for w in (model.embed.weight, model.lm_head.weight):
        h.update(w[:8].detach().to(torch.bfloat16).float().cpu().contiguous().numpy().tobytes())
    return dict(arch=c.arch, n_layers=c.n_layers, n_heads=c.n_heads, n_kv_heads=c.n_kv_heads,
                head_dim=c.head_dim, hidden_size=c.hidden_size, vocab_size=c.vocab_size,
                weights_sha256=h.hexdigest())


@dataclass(frozen=True)
class LayerPolicy:
    score: str
    p: int


@dataclass
class PolicyTable:
    model: str
    fingerprint: dict
    cache: str
    bits: int
    group: int
    layers: list[LayerPolicy]
    meta: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return dict(format=FORMAT, model=self.model, fingerprint=self.fingerprint, cache=self.cache,
                    bits=self.bits, group=self.group,
                    layers=[dict(score=l.score, p=l.p) for l in self.layers], meta=self.meta)

    def save(self, path: str) -> None:
        """Write atomically (a temporary file renamed over ``path``), so a
        reader never sees half a table."""
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(self.to_json(), f, indent=1)
            f.write("\n")
        os.replace(tmp, path)

    @staticmethod
    def from_json(obj, source: str = "table") -> "PolicyTable":
        if not isinstance(obj, dict):
            raise PolicyTableError(f"{source}: expected a JSON object, got {type(obj).__name__}")
        if obj.get("format") != FORMAT:
            raise PolicyTableError(f"{source}: format is {obj.get('format')!r}, expected {FORMAT!r}")
        for key in ("model", "fingerprint", "cache", "bits", "group", "layers"):
            if key not in obj:
                raise PolicyTableError(f"{source}: missing field {key!r} (a partial table)")
        if obj["cache"] not in CACHE_MODES:
            raise PolicyTableError(f"{source}: cache {obj['cache']!r} is not one of {CACHE_MODES}")
        if obj["bits"] not in (2, 4):
            raise PolicyTableError(f"{source}: bits {obj['bits']!r} is not 2 or 4")
        if not isinstance(obj["fingerprint"], dict):
            raise PolicyTableError(f"{source}: fingerprint must be an object")
        layers = obj["layers"]
        if not isinstance(layers, list) or not layers:
            raise PolicyTableError(f"{source}: layers must be a non-empty list")
        out = []
        for i, l in enumerate(layers):
            if not isinstance(l, dict) or l.get("score") not in SCORES or l.get("p") not in BUDGETS:
                raise PolicyTableError(f"{source}: layer {i} is {l!r}; expected "
                                       f"{{'score': one of {SCORES}, 'p': one of {BUDGETS}}}")
            out.append(LayerPolicy(l["score"], int(l["p"])))
        n = obj["fingerprint"].get("n_layers")
        if n != len(out):
            raise PolicyTableError(f"{source}: {len(out)} layers listed but the fingerprint says {n} "
                                   "(a partial table)")
        return PolicyTable(model=str(obj["model"]), fingerprint=dict(obj["fingerprint"]),
                           cache=obj["cache"], bits=int(obj["bits"]), group=int(obj["group"]),
                           layers=out, meta=dict(obj.get("meta") or {}))

    @staticmethod
    def load(path: str) -> "PolicyTable":
        try:
            with open(path) as f:
                obj = json.load(f)
        except FileNotFoundError:
            raise PolicyTableError(f"{path}: no such file") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise PolicyTableError(f"{path}: not valid JSON (corrupt or partial file): {e}") from None
        return PolicyTable.from_json(obj, source=path)

    def check(self, model, cache: str, bits: int, group: int) -> None:
        """Refuse a table made for another model, layer count, cache mode, bit width or group."""
        fp = model_fingerprint(model)
        if self.fingerprint.get("n_layers") != fp["n_layers"]:
            raise PolicyTableError(f"table for {self.model!r} has {self.fingerprint.get('n_layers')} "
                                   f"layers, the model has {fp['n_layers']}")
        diff = sorted(k for k in fp if self.fingerprint.get(k) != fp[k])
        if diff:
            raise PolicyTableError(f"table was made for another model ({self.model!r}): "
                                   f"{', '.join(diff)} differ")
        if self.cache != cache:
            raise PolicyTableError(f"table is for cache={self.cache!r}, decoding uses cache={cache!r}")
        if self.bits != bits:
            raise PolicyTableError(f"table is for bits={self.bits}, decoding uses bits={bits}")
        if self.group != group:
            raise PolicyTableError(f"table is for group={self.group}, decoding uses group={group}")


def make_table(model, name: str, cache: str, bits: int, layers, group: int = 32,
               meta: dict | None = None) -> PolicyTable:
    """A table for ``model`` from per-layer ``(score, p)`` pairs (validated)."""
    table = PolicyTable(model=name, fingerprint=model_fingerprint(model), cache=cache, bits=bits,
                        group=group, layers=[LayerPolicy(s, int(p)) for s, p in layers],
                        meta=dict(meta or {}))
    return PolicyTable.from_json(table.to_json(), source="table")
