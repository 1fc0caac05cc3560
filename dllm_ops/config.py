"""One decode configuration, as typed, frozen, validated objects.

A decode is five independent choices plus one benchmark switch::

    DecodeConfig(
        shape=ShapeConfig(gen_length=128, block_length=32, steps=None, seed=0,
                          stop_at_eos=True, max_blocks=None),
        reveal=RevealConfig(unmask="topk", alg=None, threshold=0.9, factor=1.0,
                            temperature=0.0, remasking="low_confidence", top_p=None,
                            top_k=None, alg_temp=None, suppress_eos=False, prior_sigma=None),
        cache=CacheConfig(method="dual"),            # or "d2cache" with D2CacheConfig(...)
        reuse=ReuseConfig(method="kv", rho=0.5),     # DARE-KV / DARE-O, or "none"
        storage=StorageConfig(method="kivi", bits=4),  # packed reuse, or "full"
        time_layers=False)

Each object checks its own fields when built and names the bad field and
value (:class:`dllm_ops.errors.ConfigError`); :class:`DecodeConfig` also checks
what spans sections (packed storage needs a prefix, dual or d2cache cache). Every object
converts to a plain JSON-able dict and back losslessly
(``type(c).from_dict(c.to_dict()) == c``); ``from_dict`` takes partial dicts
(missing keys keep their defaults) and refuses unknown keys by name.

What depends on the model (Dream-only sampling options on LLaDA, the steps a
block geometry admits for the chosen reveal rule, a KVQ table's layer count)
is checked by ``generate`` once the model is known.

Text settings (``KEY=VALUE`` from the command line's ``--set``, lm-eval's
``model_args``, the server's defaults) go through :func:`config_from_settings`:
dotted paths of this tree (``cache.method=d2cache``,
``cache.d2cache.rollout_p=0.2``, ``reveal.prior_sigma=3``) or
``generate``'s keyword names (``cache=dual``, ``d2cache.rollout_p=0.2``,
``dare=kv``, ``dare_opts.rho=0.5``, ``kv_quant.bits=4``, ``sigma=3``), which
:func:`config_from_generate_kwargs` maps onto the same objects. The bench's
short mode strings (``dual+kv@0.75``, ``d2cache:k=4,p=0.1,sigma=3``) parse into
the same objects through :func:`config_from_mode`.
"""
from __future__ import annotations

import json
import math
import numbers
from dataclasses import MISSING, dataclass, field, fields, replace

from . import options
from .errors import ConfigError
from .options import parse_value

LLADA_UNMASK = ("topk", "threshold", "factor")
DREAM_ALGS = ("origin", "maskgit_plus", "topk_margin", "entropy", "confidence_threshold")
REMASKING = ("low_confidence", "random")
CACHE_METHODS = ("none", "prefix", "dual", "d2cache", "stale")
REUSE_METHODS = ("none", "kv", "o")
#: per reuse method, its selection rules; the first is the default
REUSE_RULES = {"kv": ("drift",), "o": ("context", "drift")}
STORAGE_METHODS = ("full", "kivi", "kvq")
STORAGE_BITS = (2, 4)
STORAGE_GROUPS = (8, 16, 32, 64, 128)


# ---- field checks -----------------------------------------------------------------

def _bad(where: str, value, expect: str) -> ConfigError:
    return ConfigError(f"{where} = {value!r}: must be {expect}")


def _is_int(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _is_real(v) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v)


def _int(where, v, *, low=None, optional=False):
    if v is None and optional:
        return None
    if not _is_int(v) or (low is not None and v < low):
        raise _bad(where, v, "an integer" + (f" >= {low}" if low is not None else "")
                   + (" or null" if optional else ""))
    return int(v)


def _real(where, v, *, test=lambda x: True, expect="a finite number", optional=False):
    if v is None and optional:
        return None
    if not _is_real(v) or not test(v):
        raise _bad(where, v, expect + (" or null" if optional else ""))
    return float(v)


def _choice(where, v, choices, *, optional=False):
    if v is None and optional:
        return None
    if v not in choices or not isinstance(v, str):
        raise _bad(where, v, f"one of {list(choices)}" + (" or null" if optional else ""))
    return v


def _bool(where, v):
    if not isinstance(v, bool):
        raise _bad(where, v, "true or false")
    return v


def _set(obj, name, value):
    """Store a normalised value on a frozen dataclass (inside __post_init__ only)."""
    object.__setattr__(obj, name, value)


# ---- dict round trip --------------------------------------------------------------

class _Section:
    """to_dict / from_dict for a frozen dataclass whose fields are JSON values or sections."""

    key: str = ""   # where the section sits in a DecodeConfig (error messages)

    def to_dict(self) -> dict:
        out = {}
        for f in fields(self):
            v = getattr(self, f.name)
            out[f.name] = v.to_dict() if isinstance(v, _Section) else _plain(v)
        return out

    @classmethod
    def from_dict(cls, d, where: str | None = None):
        where = where or cls.key
        if isinstance(d, cls):
            return d
        if not isinstance(d, dict):
            raise ConfigError(f"{where}: expected an object of {cls.__name__} fields, "
                              f"got {type(d).__name__}")
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(d) - set(known))
        if unknown:
            raise ConfigError(f"{where}: unknown key(s) {unknown}; known: {sorted(known)}")
        kw = {}
        for name, v in d.items():
            sub = _section_type(known[name])
            kw[name] = sub.from_dict(v, f"{where}.{name}" if where else name) \
                if sub is not None and v is not None else v
        return cls(**kw)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    def replace(self, **changes):
        """A copy with some fields changed (validated again)."""
        return replace(self, **changes)


def _plain(v):
    """A JSON-able copy of a field value (a policy table may be a nested dict)."""
    if isinstance(v, dict):
        return {k: _plain(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    return v


def _section_type(f):
    """The _Section class a field holds, if any (from its default factory or annotation)."""
    if f.default_factory is not MISSING:
        t = type(f.default_factory())
        if issubclass(t, _Section):
            return t
    return _SECTION_FIELDS.get(f.name)


# ---- sections ---------------------------------------------------------------------

@dataclass(frozen=True)
class ShapeConfig(_Section):
    """The generated region and the call budget.

    gen_length / block_length: the region and its block size (a multiple);
    steps: model calls for the whole region (None: gen_length), split over the
    blocks; seed: every row's sampling generator; stop_at_eos: a row whose text
    reached EOS stops and its masks become EOS; max_blocks: decode only the
    first blocks (benchmarks).
    """
    key = "shape"
    gen_length: int = 128
    block_length: int = 32
    steps: int | None = None
    seed: int = 0
    stop_at_eos: bool = True
    max_blocks: int | None = None

    def __post_init__(self):
        w = self.key
        _set(self, "gen_length", _int(f"{w}.gen_length", self.gen_length, low=1))
        _set(self, "block_length", _int(f"{w}.block_length", self.block_length, low=1))
        if self.gen_length % self.block_length:
            raise _bad(f"{w}.gen_length", self.gen_length,
                       f"a multiple of shape.block_length ({self.block_length})")
        _set(self, "steps", _int(f"{w}.steps", self.steps, low=1, optional=True))
        _set(self, "seed", _int(f"{w}.seed", self.seed))
        _bool(f"{w}.stop_at_eos", self.stop_at_eos)
        _set(self, "max_blocks", _int(f"{w}.max_blocks", self.max_blocks, low=1, optional=True))

    @property
    def num_blocks(self) -> int:
        return self.gen_length // self.block_length

    @property
    def blocks_to_decode(self) -> int:
        """The blocks a decode runs: all of them, or the first ``max_blocks``."""
        return self.num_blocks if self.max_blocks is None else min(self.num_blocks, self.max_blocks)

    @property
    def total_steps(self) -> int:
        return self.gen_length if self.steps is None else self.steps


@dataclass(frozen=True)
class RevealConfig(_Section):
    """Which masked candidates a call commits, and how tokens are drawn.

    unmask: LLaDA's rule (topk | threshold | factor); alg: Dream's algorithm
    (None: entropy); threshold / factor: the rules' parameters; temperature,
    remasking (LLaDA), top_p / top_k / alg_temp (Dream): sampling;
    suppress_eos: EOS is never committed; prior_sigma: d²Cache's certainty
    prior around any rule (None or 0: off; unrelated to d²Cache's own
    ``density_sigma``).
    """
    key = "reveal"
    unmask: str = "topk"
    alg: str | None = None
    threshold: float = 0.9
    factor: float = 1.0
    temperature: float = 0.0
    remasking: str = "low_confidence"
    top_p: float | None = None
    top_k: int | None = None
    alg_temp: float | None = None
    suppress_eos: bool = False
    prior_sigma: float | None = None

    def __post_init__(self):
        w = self.key
        _choice(f"{w}.unmask", self.unmask, LLADA_UNMASK)
        _choice(f"{w}.alg", self.alg, DREAM_ALGS, optional=True)
        _set(self, "threshold", _real(f"{w}.threshold", self.threshold))
        _set(self, "factor", _real(f"{w}.factor", self.factor))
        _set(self, "temperature", _real(f"{w}.temperature", self.temperature, test=lambda x: x >= 0,
                                        expect="a finite number >= 0"))
        _choice(f"{w}.remasking", self.remasking, REMASKING)
        _set(self, "top_p", _real(f"{w}.top_p", self.top_p, test=lambda x: 0 < x <= 1,
                                  expect="a number in (0, 1]", optional=True))
        _set(self, "top_k", _int(f"{w}.top_k", self.top_k, low=1, optional=True))
        _set(self, "alg_temp", _real(f"{w}.alg_temp", self.alg_temp, test=lambda x: x >= 0,
                                     expect="a finite number >= 0", optional=True))
        _bool(f"{w}.suppress_eos", self.suppress_eos)
        _set(self, "prior_sigma", _real(f"{w}.prior_sigma", self.prior_sigma, test=lambda x: x >= 0,
                                        expect="a finite number >= 0 (0 or null: off)", optional=True))


@dataclass(frozen=True)
class D2CacheConfig(_Section):
    """d²Cache's options: rollout_p (stage-2 nucleus), current_k (stage-1 masked
    tokens per call), density_sigma (stage-1 certainty density's width)."""
    key = "cache.d2cache"
    rollout_p: float = 0.1
    current_k: int = 32
    density_sigma: float = 10.0

    def __post_init__(self):
        w = self.key
        _set(self, "rollout_p", _real(f"{w}.rollout_p", self.rollout_p, test=lambda x: 0 < x <= 1,
                                      expect="a number in (0, 1]"))
        _set(self, "current_k", _int(f"{w}.current_k", self.current_k, low=1))
        _set(self, "density_sigma", _real(f"{w}.density_sigma", self.density_sigma,
                                          test=lambda x: x > 0, expect="a finite number > 0"))


@dataclass(frozen=True)
class CacheConfig(_Section):
    """Which tokens each call recomputes: none | prefix | dual (Fast-dLLM) |
    d2cache (with ``d2cache`` options; defaults when omitted) | stale (a
    diagnostic that never refreshes)."""
    key = "cache"
    method: str = "none"
    d2cache: D2CacheConfig | None = None

    def __post_init__(self):
        _choice(f"{self.key}.method", self.method, CACHE_METHODS)
        if isinstance(self.d2cache, dict):
            _set(self, "d2cache", D2CacheConfig.from_dict(self.d2cache))
        if self.method == "d2cache" and self.d2cache is None:
            _set(self, "d2cache", D2CacheConfig())
        if self.method != "d2cache" and self.d2cache is not None:
            raise _bad(f"{self.key}.d2cache", self.d2cache.to_dict()
                       if isinstance(self.d2cache, _Section) else self.d2cache,
                       f"null with cache.method {self.method!r} (d2cache options apply to 'd2cache')")
        if self.d2cache is not None and not isinstance(self.d2cache, D2CacheConfig):
            raise _bad(f"{self.key}.d2cache", self.d2cache, "a D2CacheConfig or an object of its fields")


@dataclass(frozen=True)
class ReuseConfig(_Section):
    """Per-layer reuse inside each call (DARE): method none | kv (only drifting
    tokens recompute K/V) | o (only drifting tokens attend). Exactly one of
    rho (target reuse fraction in [0, 1), with phi_max in [rho, 1), default
    (1 + rho) / 2) or tau (reuse iff drift < tau). ``rule`` is what a token's
    drift measures: ``drift`` (DARE's query drift, the only rule of kv) or
    ``context`` (DARE-O's default: query drift plus the attention-weighted
    drift of the keys the token attended to at its last recompute; see
    dllm_ops/dare.py). Null means the method's default and is stored as it."""
    key = "reuse"
    method: str = "none"
    rho: float | None = None
    tau: float | None = None
    phi_max: float | None = None
    rule: str | None = None

    def __post_init__(self):
        w = self.key
        _choice(f"{w}.method", self.method, REUSE_METHODS)
        if self.method == "none":
            for name in ("rho", "tau", "phi_max", "rule"):
                if getattr(self, name) is not None:
                    raise _bad(f"{w}.{name}", getattr(self, name), "null with reuse.method 'none'")
            return
        rules = REUSE_RULES[self.method]
        _set(self, "rule", _choice(f"{w}.rule", self.rule, rules, optional=True) or rules[0])
        if (self.rho is None) == (self.tau is None):
            raise ConfigError(f"{w}: give exactly one of rho (target reuse fraction) or tau "
                              f"(drift threshold), got rho={self.rho!r}, tau={self.tau!r}")
        if self.rho is not None:
            _set(self, "rho", _real(f"{w}.rho", self.rho, test=lambda x: 0 <= x < 1,
                                    expect="a number in [0, 1)"))
            rho = self.rho
            _set(self, "phi_max", _real(f"{w}.phi_max", self.phi_max, test=lambda x: rho <= x < 1,
                                        expect=f"a number in [rho ({rho}), 1)", optional=True))
        else:
            _set(self, "tau", _real(f"{w}.tau", self.tau, test=lambda x: x >= 0,
                                    expect="a finite number >= 0"))
            if self.phi_max is not None:
                raise _bad(f"{w}.phi_max", self.phi_max, "null in tau mode (it caps rho's split)")


@dataclass(frozen=True)
class StorageConfig(_Section):
    """How the reused region is stored: full (the model's dtype), kivi (packed
    2/4-bit, no protected tokens) or kvq (dLLM-KVQ: a per-layer policy
    ``table``, a path or its JSON object, from ``python -m dllm_ops.calibrate``);
    ``group`` is the K token group / V channel group."""
    key = "storage"
    method: str = "full"
    bits: int | None = None
    group: int = 32
    table: str | dict | None = None

    def __post_init__(self):
        w = self.key
        _choice(f"{w}.method", self.method, STORAGE_METHODS)
        if self.method == "full":
            if self.bits is not None:
                raise _bad(f"{w}.bits", self.bits, "null with storage.method 'full'")
            if self.table is not None:
                raise _bad(f"{w}.table", self.table, "null with storage.method 'full'")
        else:
            if self.bits not in STORAGE_BITS or not _is_int(self.bits):
                raise _bad(f"{w}.bits", self.bits, f"one of {list(STORAGE_BITS)}")
            _set(self, "bits", int(self.bits))
        if self.group not in STORAGE_GROUPS or not _is_int(self.group):
            raise _bad(f"{w}.group", self.group, f"one of {list(STORAGE_GROUPS)}")
        _set(self, "group", int(self.group))
        if self.method == "kivi" and self.table is not None:
            raise _bad(f"{w}.table", self.table, "null with 'kivi' (it protects no tokens)")
        if self.method == "kvq":
            if self.table is None:
                raise _bad(f"{w}.table", None, "a policy table (a path or its JSON object) for 'kvq'")
            if hasattr(self.table, "__fspath__"):
                _set(self, "table", str(self.table.__fspath__()))
            elif hasattr(self.table, "to_json"):   # a PolicyTable: stored as its JSON object
                _set(self, "table", self.table.to_json())
            if not isinstance(self.table, (str, dict)):
                raise _bad(f"{w}.table", self.table, "a path or a JSON object")

    @property
    def packed(self) -> bool:
        return self.method != "full"


_SECTION_FIELDS = {"d2cache": D2CacheConfig}


@dataclass(frozen=True)
class DecodeConfig(_Section):
    """A whole decode: shape, reveal rule, cache method, per-layer reuse, storage.

    ``time_layers`` records each call's per-layer wall seconds in the stats
    (benchmarks)."""
    key = ""
    shape: ShapeConfig = field(default_factory=ShapeConfig)
    reveal: RevealConfig = field(default_factory=RevealConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    reuse: ReuseConfig = field(default_factory=ReuseConfig)
    storage: StorageConfig = field(default_factory=StorageConfig)
    time_layers: bool = False

    def __post_init__(self):
        for f in fields(self):
            sub = _section_type(f)
            v = getattr(self, f.name)
            if sub is not None and not isinstance(v, sub):
                if isinstance(v, dict):
                    _set(self, f.name, sub.from_dict(v))
                else:
                    raise _bad(f.name, v, f"a {sub.__name__} or an object of its fields")
        _bool("time_layers", self.time_layers)
        if self.storage.packed and self.cache.method not in ("prefix", "dual", "d2cache"):
            raise _bad("storage.method", self.storage.method,
                       f"'full' with cache.method {self.cache.method!r}: packed storage holds the "
                       f"region a prefix, dual or d2cache cache reuses")
        if self.storage.packed and self.cache.method == "d2cache" and self.reuse.method != "none":
            raise _bad("reuse.method", self.reuse.method,
                       "'none' with packed d2cache storage: a d2cache call re-packs the tokens it "
                       "writes and reads them back with the same queries, which per-layer reuse "
                       "would narrow")


# ---- generate()'s keywords and text settings ----------------------------------------

#: generate() keyword -> (section, field) of the configuration
_KEYWORD_FIELDS = {
    "gen_length": ("shape", "gen_length"), "block_length": ("shape", "block_length"),
    "steps": ("shape", "steps"), "seed": ("shape", "seed"),
    "stop_at_eos": ("shape", "stop_at_eos"), "max_blocks": ("shape", "max_blocks"),
    "unmask": ("reveal", "unmask"), "alg": ("reveal", "alg"), "threshold": ("reveal", "threshold"),
    "factor": ("reveal", "factor"), "temperature": ("reveal", "temperature"),
    "remasking": ("reveal", "remasking"), "top_p": ("reveal", "top_p"), "top_k": ("reveal", "top_k"),
    "alg_temp": ("reveal", "alg_temp"), "suppress_eos": ("reveal", "suppress_eos"),
    "sigma": ("reveal", "prior_sigma"), "cache": ("cache", "method"),
    "time_layers": (None, "time_layers"),
}
#: generate()'s dict-valued keywords and what their keys become
_D2CACHE_KEYS = {"rollout_p": "rollout_p", "current_k": "current_k", "sigma": "density_sigma"}
_DARE_KEYS = ("rho", "tau", "phi_max", "rule")
_KV_QUANT_KEYS = {"bits": "bits", "method": "method", "policy": "table", "group": "group"}
KEYWORDS = tuple(_KEYWORD_FIELDS) + ("d2cache", "dare", "dare_opts", "kv_quant")


def _dict_option(name, value, keys) -> dict:
    if not isinstance(value, dict):
        raise _bad(name, value, "an object")
    unknown = sorted(set(value) - set(keys))
    if unknown:
        raise ConfigError(f"{name}: unknown key(s) {unknown}; known: {sorted(keys)}")
    return value


def config_tree_from_generate_kwargs(kw: dict) -> dict:
    """generate()'s keyword arguments as a (partial) DecodeConfig dict."""
    tree: dict = {}
    for name, value in kw.items():
        if name in _KEYWORD_FIELDS:
            section, key = _KEYWORD_FIELDS[name]
            (tree.setdefault(section, {}) if section else tree)[key] = value
        elif name == "d2cache":
            if value is not None:
                opts = _dict_option("d2cache", value, _D2CACHE_KEYS)
                tree.setdefault("cache", {})["d2cache"] = {_D2CACHE_KEYS[k]: v for k, v in opts.items()}
        elif name == "dare":
            if value is not None:
                tree.setdefault("reuse", {})["method"] = value
        elif name == "dare_opts":
            if value is not None:
                tree.setdefault("reuse", {}).update(_dict_option("dare_opts", value, _DARE_KEYS))
        elif name == "kv_quant":
            if value is not None:
                opts = _dict_option("kv_quant", value, _KV_QUANT_KEYS)
                storage = {_KV_QUANT_KEYS[k]: v for k, v in opts.items()}
                storage.setdefault("method", "kvq")
                tree["storage"] = storage
        else:
            raise ConfigError(f"unknown generate option {name!r}; known: {sorted(KEYWORDS)}")
    if "method" not in tree.get("reuse", {"method": None}):
        raise ConfigError("dare_opts given without dare='kv' or 'o'")
    return tree


def config_from_generate_kwargs(base: DecodeConfig | None = None, **kw) -> DecodeConfig:
    """``generate``'s keyword spelling on top of ``base`` (default: all defaults)."""
    return merge(base or DecodeConfig(), config_tree_from_generate_kwargs(kw))


def merge(base: DecodeConfig, tree: dict) -> DecodeConfig:
    """``base`` with the fields a partial dict names replaced (validated as a whole)."""
    if not isinstance(tree, dict):
        raise ConfigError(f"expected an object of DecodeConfig fields, got {type(tree).__name__}")
    out = base.to_dict()
    unknown = sorted(set(tree) - set(out))
    if unknown:
        raise ConfigError(f"unknown key(s) {unknown}; known: {sorted(out)}")
    for key, value in tree.items():
        if isinstance(out[key], dict) and isinstance(value, dict):
            section = dict(out[key])
            if key == "cache" and value.get("method", section["method"]) != "d2cache":
                section["d2cache"] = None   # options of a method no longer chosen
            if key == "reuse" and "method" in value and value["method"] != section["method"]:
                section.update(rho=None, tau=None, phi_max=None, rule=None)
            if key == "reuse" and ("rho" in value or "tau" in value):
                section.update(rho=None, tau=None)   # one mode replaces the other
            if key == "storage" and value.get("method", section["method"]) != section["method"]:
                section.update(bits=None, table=None)
            if key == "cache" and isinstance(value.get("d2cache"), dict) and section["d2cache"]:
                value = dict(value, d2cache={**section["d2cache"], **value["d2cache"]})
            section.update(value)
            out[key] = section
        else:
            out[key] = value
    return DecodeConfig.from_dict(out)


def settings_tree(settings: dict) -> dict:
    """``{"cache.method": "dual", "d2cache.rollout_p": "0.2", ...}`` -> a partial DecodeConfig
    dict. Keys are dotted paths of the configuration or generate()'s keyword names
    (a dotted generate keyword fills its dict: ``dare_opts.rho``); values are JSON
    when they parse as JSON."""
    tree: dict = {}
    legacy: dict = {}
    sections = {f.name for f in fields(DecodeConfig)}
    for key, raw in settings.items():
        value = parse_value(raw)
        head, _, rest = key.partition(".")
        if rest and head in sections:
            node = tree.setdefault(head, {})
            *path, leaf = rest.split(".")
            for p in path:
                node = node.setdefault(p, {})
                if not isinstance(node, dict):
                    raise ConfigError(f"{key}: {p!r} is given both as a value and as an object")
            if leaf in node:
                raise ConfigError(f"{key} is given twice")
            node[leaf] = value
        elif rest:
            if head not in ("d2cache", "dare_opts", "kv_quant"):
                raise ConfigError(f"unknown setting {key!r}: a dotted key starts with one of "
                                  f"{sorted(sections)} or d2cache / dare_opts / kv_quant")
            sub = legacy.setdefault(head, {})
            if not isinstance(sub, dict):
                raise ConfigError(f"{head!r} is given both as a value and as {key!r}")
            sub[rest] = value
        elif head in KEYWORDS:
            if head in legacy:
                raise ConfigError(f"{head!r} is given twice")
            legacy[head] = value
        elif head == "time_layers":
            tree["time_layers"] = value
        else:
            raise ConfigError(f"unknown setting {key!r}; use a path of the configuration "
                              f"(e.g. cache.method) or a generate option: {sorted(KEYWORDS)}")
    return _join(config_tree_from_generate_kwargs(legacy), tree)


def _join(a: dict, b: dict) -> dict:
    """Two partial trees as one; a field both set is an error."""
    out = dict(a)
    for k, v in b.items():
        if k in out and isinstance(out[k], dict) and isinstance(v, dict):
            out[k] = _join(out[k], v)
        elif k in out:
            raise ConfigError(f"{k!r} is set twice (a generate option and a configuration path)")
        else:
            out[k] = v
    return out


def config_from_settings(settings: dict | list, base: DecodeConfig | None = None) -> DecodeConfig:
    """A DecodeConfig from text settings: a dict, or ``["KEY=VALUE", ...]`` pairs."""
    if isinstance(settings, list):
        settings = parse_pairs(settings)
    return merge(base or DecodeConfig(), settings_tree(settings))


def parse_pairs(pairs: list[str]) -> dict:
    """``["cache=dual", "threshold=0.9"]`` -> ``{"cache": "dual", "threshold": 0.9}``
    (dllm_ops.options' parser; a key given twice is refused)."""
    keys = [p.partition("=")[0].strip() for p in pairs]
    twice = sorted({k for k in keys if keys.count(k) > 1})
    if twice:
        raise ConfigError(f"{twice[0]!r} is given twice")
    try:
        return options.parse_pairs(pairs)
    except options.OptionError as e:
        raise ConfigError(str(e).removeprefix("dllm_ops: ")) from None


# ---- lm-eval's model_args -------------------------------------------------------------

def leaf_paths(tree: dict, prefix: str = "") -> set[str]:
    """The dotted fields a partial configuration dict sets (``{"reveal": {"threshold":
    0.9}}`` -> ``{"reveal.threshold"}``; a kvq table object is one field)."""
    out = set()
    for key, value in tree.items():
        path = f"{prefix}{key}"
        out |= leaf_paths(value, path + ".") if isinstance(value, dict) and key != "table" else {path}
    return out


def config_from_model_args(settings: dict, max_gen_toks: int) -> tuple[DecodeConfig, set[str]]:
    """lm-eval's decode ``model_args`` (every key but the model-loading ones) ->
    ``(DecodeConfig, paths)`` through :func:`config_from_settings`;
    ``paths`` are the dotted fields the settings set (``threshold`` ->
    ``reveal.threshold``). Without a gen length in the settings the region is
    ``max_gen_toks`` rounded up to a multiple of the block length."""
    tree = settings_tree(settings)
    paths = leaf_paths(tree)
    if "shape.gen_length" not in paths:
        block = tree.get("shape", {}).get("block_length", ShapeConfig.block_length)
        if isinstance(block, int) and not isinstance(block, bool) and block > 0:   # else: named below
            settings = {**settings, "shape.gen_length": region_length(max_gen_toks, block)}
    return config_from_settings(settings), paths


def region_length(max_gen_toks: int, block_length: int) -> int:
    """The generated region for ``max_gen_toks`` tokens: rounded up to whole blocks."""
    return -(-max_gen_toks // block_length) * block_length


# ---- the bench's short mode strings ---------------------------------------------------

_MODE_D2CACHE_KEYS = {"k": "current_k", "p": "rollout_p", "sigma": "density_sigma"}


def mode_tree(spec: str) -> dict:
    """A bench mode string as a partial DecodeConfig dict.

    ``"dual"``: a cache method; ``"dual+kv@0.75"`` / ``"dual+o@t0.05"``: with
    DARE-KV / DARE-O at target reuse ρ or drift threshold τ (``"dual+o:drift@0.5"``:
    with a selection rule other than the method's default, reuse.rule);
    ``"d2cache:k=4,p=0.1,sigma=3"``: d²Cache with current_k / rollout_p /
    density_sigma."""
    if not isinstance(spec, str) or not spec:
        raise ConfigError(f"mode {spec!r}: write e.g. dual, dual+kv@0.75, d2cache:k=4,p=0.1,sigma=3")
    cache, plus, dare = spec.partition("+")
    method, colon, opts = cache.partition(":")
    tree: dict = {"cache": {"method": method}}
    if colon:
        if method != "d2cache":
            raise ConfigError(f"mode {spec!r}: only d2cache takes options after ':'")
        d2 = {}
        for item in opts.split(","):
            key, _, value = item.partition("=")
            if key not in _MODE_D2CACHE_KEYS or not value:
                raise ConfigError(f"mode {spec!r}: write d2cache options as k=4,p=0.1,sigma=3")
            d2[_MODE_D2CACHE_KEYS[key]] = parse_value(value)
        tree["cache"]["d2cache"] = d2
    if plus:
        mech, _, value = dare.partition("@")
        mech, colon, rule = mech.partition(":")
        number = parse_value(value[1:] if value.startswith("t") else value)
        if not _is_real(number) or (colon and not rule):
            raise ConfigError(f"mode {spec!r}: write DARE as dual+kv@0.75 (rho), dual+o@t0.05 (tau) "
                              f"or dual+o:drift@0.5 (a selection rule)")
        tree["reuse"] = {"method": mech, "tau" if value.startswith("t") else "rho": number}
        if colon:
            tree["reuse"]["rule"] = rule
    return tree


def config_from_mode(spec: str, base: DecodeConfig | None = None) -> DecodeConfig:
    """A bench mode string on top of ``base``."""
    return merge(base or DecodeConfig(), mode_tree(spec))


def mode_of(config: DecodeConfig) -> str:
    """The bench mode string of a configuration's cache and reuse (inverse of mode_tree)."""
    c, r = config.cache, config.reuse
    out = c.method
    if c.d2cache is not None and c.d2cache != D2CacheConfig():
        d = c.d2cache
        out += f":k={d.current_k},p={d.rollout_p:g},sigma={d.density_sigma:g}"
    if r.method != "none":
        rule = f":{r.rule}" if r.rule != REUSE_RULES[r.method][0] else ""
        out += f"+{r.method}{rule}@" + (f"{r.rho:g}" if r.rho is not None else f"t{r.tau:g}")
    return out


__all__ = ["DecodeConfig", "ShapeConfig", "RevealConfig", "CacheConfig", "D2CacheConfig",
           "ReuseConfig", "StorageConfig", "ConfigError", "config_from_generate_kwargs",
           "config_from_settings", "config_from_mode", "config_from_model_args", "region_length",
           "mode_of", "merge", "parse_pairs", "parse_value", "KEYWORDS"]
