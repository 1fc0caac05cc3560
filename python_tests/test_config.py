"""The decode configuration (dllm_ops/config.py): round trips, validation that
names the field and value, and one object whatever spelling built it."""
from __future__ import annotations

import json

import pytest

from dllm_ops.config import (CacheConfig, D2CacheConfig, DecodeConfig, ReuseConfig, RevealConfig,
                             ShapeConfig, StorageConfig, config_from_generate_kwargs,
                             config_from_mode, config_from_settings, merge, mode_of)
from dllm_ops.errors import ConfigError, DllmOpsError

SECTIONS = [ShapeConfig, RevealConfig, D2CacheConfig, CacheConfig, ReuseConfig, StorageConfig,
            DecodeConfig]

# One non-default instance of every class, so a round trip carries real values.
EXAMPLES = [
    ShapeConfig(gen_length=96, block_length=32, steps=48, seed=7, stop_at_eos=False, max_blocks=2),
    RevealConfig(unmask="threshold", alg="maskgit_plus", threshold=0.75, factor=2.0, temperature=0.5,
                 remasking="random", top_p=0.9, top_k=5, alg_temp=0.1, suppress_eos=True,
                 prior_sigma=3.0),
    D2CacheConfig(rollout_p=0.2, current_k=4, density_sigma=3.0),
    CacheConfig(method="d2cache", d2cache=D2CacheConfig(current_k=9)),
    ReuseConfig(method="o", tau=0.05),
    ReuseConfig(method="kv", rho=0.5, phi_max=0.8),
    ReuseConfig(method="o", rho=0.5, rule="drift"),
    StorageConfig(method="kvq", bits=2, group=16, table={"layers": [{"score": "attn", "p": 0.02}]}),
    StorageConfig(method="kivi", bits=4),
    DecodeConfig(shape=ShapeConfig(gen_length=64, block_length=16), cache=CacheConfig(method="dual"),
                 reuse=ReuseConfig(method="kv", rho=0.75), storage=StorageConfig(method="kivi", bits=4),
                 time_layers=True),
]


@pytest.mark.parametrize("config", EXAMPLES + [cls() for cls in SECTIONS if cls is not StorageConfig]
                         + [StorageConfig()], ids=lambda c: type(c).__name__)
def test_round_trip_is_lossless(config):
    d = config.to_dict()
    assert json.loads(json.dumps(d)) == d                 # plain JSON
    assert type(config).from_dict(d) == config
    assert type(config).from_dict(json.loads(config.to_json())) == config


@pytest.mark.parametrize("cls", SECTIONS, ids=lambda c: c.__name__)
def test_unknown_key_is_refused_by_name(cls):
    with pytest.raises(ConfigError, match="unknown key.*'bogus_key'"):
        cls.from_dict({"bogus_key": 1})


def test_unknown_nested_key_names_its_path():
    with pytest.raises(ConfigError, match=r"cache\.d2cache: unknown key.*'k'"):
        DecodeConfig.from_dict({"cache": {"method": "d2cache", "d2cache": {"k": 4}}})


# (class, field, bad value): each must raise an error naming "section.field" and the value.
INVALID = [
    (ShapeConfig, "gen_length", 0), (ShapeConfig, "gen_length", 33), (ShapeConfig, "gen_length", 1.5),
    (ShapeConfig, "block_length", -32), (ShapeConfig, "steps", 0), (ShapeConfig, "seed", "x"),
    (ShapeConfig, "stop_at_eos", 1), (ShapeConfig, "max_blocks", 0),
    (RevealConfig, "unmask", "greedy"), (RevealConfig, "alg", "beam"),
    (RevealConfig, "threshold", float("nan")), (RevealConfig, "factor", "1"),
    (RevealConfig, "temperature", -0.1), (RevealConfig, "remasking", "lowest"),
    (RevealConfig, "top_p", 0.0), (RevealConfig, "top_p", 1.5), (RevealConfig, "top_k", 0),
    (RevealConfig, "alg_temp", -1.0), (RevealConfig, "suppress_eos", "yes"),
    (RevealConfig, "prior_sigma", -2.0), (RevealConfig, "prior_sigma", float("inf")),
    (D2CacheConfig, "rollout_p", 0.0), (D2CacheConfig, "rollout_p", 1.01),
    (D2CacheConfig, "current_k", 0), (D2CacheConfig, "current_k", True),
    (D2CacheConfig, "density_sigma", 0.0),
    (CacheConfig, "method", "paged"),
    (ReuseConfig, "method", "q"),
    (ReuseConfig, "rule", "query"),
    (StorageConfig, "method", "int8"), (StorageConfig, "group", 24),
]


@pytest.mark.parametrize("cls,name,value", INVALID, ids=lambda v: repr(v))
def test_invalid_value_names_field_and_value(cls, name, value):
    kw = {name: value}
    if cls is ShapeConfig and name == "gen_length" and value == 33:
        kw["block_length"] = 32
    with pytest.raises(ConfigError) as e:
        cls(**kw)
    msg = str(e.value)
    assert f"{cls.key}.{name}" in msg and repr(value) in msg, msg
    assert msg.startswith("dllm_ops config: ")
    assert isinstance(e.value, DllmOpsError) and isinstance(e.value, ValueError)


@pytest.mark.parametrize("kw,where", [
    (dict(method="kv"), "reuse: give exactly one of rho"),
    (dict(method="kv", rho=0.5, tau=0.1), "reuse: give exactly one of rho"),
    (dict(method="kv", rho=1.0), "reuse.rho = 1.0"),
    (dict(method="kv", rho=0.5, phi_max=0.4), "reuse.phi_max = 0.4"),
    (dict(method="o", tau=0.1, phi_max=0.5), "reuse.phi_max = 0.5"),
    (dict(method="none", rho=0.5), "reuse.rho = 0.5"),
    (dict(method="kv", rho=0.5, rule="context"), "reuse.rule = 'context'"),
    (dict(method="none", rule="drift"), "reuse.rule = 'drift'"),
])
def test_reuse_modes(kw, where):
    with pytest.raises(ConfigError, match=where.replace(".", r"\.")):
        ReuseConfig(**kw)


def test_reuse_rule_default_and_spellings():
    """reuse.rule: null is stored as the method's default (DARE-O: context,
    DARE-KV: drift); the mode string, generate's dare_opts and a settings path
    name the same object; a new method drops the old rule."""
    assert ReuseConfig(method="o", tau=0.1).rule == "context"
    assert ReuseConfig(method="kv", tau=0.1).rule == "drift"
    assert ReuseConfig().rule is None
    drift = ReuseConfig(method="o", rho=0.5, rule="drift")
    assert config_from_mode("dual+o:drift@0.5").reuse == drift
    assert mode_of(config_from_mode("dual+o:drift@0.5")) == "dual+o:drift@0.5"
    assert mode_of(config_from_mode("dual+o:context@0.5")) == "dual+o@0.5"
    assert config_from_generate_kwargs(dare="o", dare_opts=dict(rho=0.5, rule="drift")).reuse == drift
    assert config_from_settings(["reuse.method=o", "reuse.rho=0.5", "reuse.rule=drift"]).reuse == drift
    kv = DecodeConfig(reuse=ReuseConfig(method="kv", rho=0.5))   # stores rule "drift"
    assert merge(kv, {"reuse": {"method": "o", "rho": 0.5}}).reuse.rule == "context"
    assert merge(DecodeConfig(reuse=drift), {"reuse": {"rho": 0.7}}).reuse.rule == "drift"
    with pytest.raises(ConfigError, match="dual\\+o:drift@0.5"):
        config_from_mode("dual+o:@0.5")


@pytest.mark.parametrize("kw,where", [
    (dict(method="kivi"), "storage.bits = None"),
    (dict(method="kvq", bits=4), "storage.table = None"),
    (dict(method="kivi", bits=4, table="t.json"), "storage.table = 't.json'"),
    (dict(method="full", bits=4), "storage.bits = 4"),
    (dict(method="kivi", bits=3), "storage.bits = 3"),
])
def test_storage_fields(kw, where):
    with pytest.raises(ConfigError, match=where.replace(".", r"\.")):
        StorageConfig(**kw)


def test_cross_section_rules():
    with pytest.raises(ConfigError, match=r"cache\.d2cache = .*'d2cache'"):
        CacheConfig(method="dual", d2cache=D2CacheConfig())
    assert CacheConfig(method="d2cache").d2cache == D2CacheConfig()
    with pytest.raises(ConfigError, match=r"storage\.method = 'kivi'.*'none'"):
        DecodeConfig(cache=CacheConfig(method="none"), storage=StorageConfig(method="kivi", bits=4))
    DecodeConfig(cache=CacheConfig(method="d2cache"), storage=StorageConfig(method="kivi", bits=4))
    with pytest.raises(ConfigError, match=r"reuse\.method = 'o': must be 'none' with packed d2cache"):
        DecodeConfig(cache=CacheConfig(method="d2cache"), storage=StorageConfig(method="kivi", bits=4),
                     reuse=ReuseConfig(method="o", rho=0.5))


def test_frozen():
    c = DecodeConfig()
    with pytest.raises(Exception):
        c.shape = ShapeConfig()  # type: ignore[misc]
    assert c.replace(time_layers=True).time_layers and not c.time_layers


# ---- one object whatever the spelling ----------------------------------------------

D2 = DecodeConfig(shape=ShapeConfig(gen_length=64, block_length=64, steps=64),
                  reveal=RevealConfig(prior_sigma=3.0),
                  cache=CacheConfig(method="d2cache",
                                    d2cache=D2CacheConfig(rollout_p=0.2, current_k=4, density_sigma=3.0)))
DARE = DecodeConfig(cache=CacheConfig(method="dual"), reuse=ReuseConfig(method="kv", rho=0.75),
                    reveal=RevealConfig(unmask="threshold", threshold=0.8))
KVQ = DecodeConfig(cache=CacheConfig(method="prefix"),
                   storage=StorageConfig(method="kvq", bits=4, table="policy.json"))


@pytest.mark.parametrize("expected,kwargs,pairs,mode", [
    (D2, dict(cache="d2cache", d2cache=dict(rollout_p=0.2, current_k=4, sigma=3), sigma=3,
              gen_length=64, block_length=64, steps=64),
     ["cache.method=d2cache", "cache.d2cache.rollout_p=0.2", "cache.d2cache.current_k=4",
      "cache.d2cache.density_sigma=3", "reveal.prior_sigma=3", "shape.gen_length=64",
      "shape.block_length=64", "shape.steps=64"],
     "d2cache:k=4,p=0.2,sigma=3"),
    (DARE, dict(cache="dual", dare="kv", dare_opts=dict(rho=0.75), unmask="threshold", threshold=0.8),
     ["cache=dual", "dare=kv", "dare_opts.rho=0.75", "unmask=threshold", "threshold=0.8"],
     "dual+kv@0.75"),
    (KVQ, dict(cache="prefix", kv_quant=dict(bits=4, method="kvq", policy="policy.json")),
     ["cache=prefix", "kv_quant.bits=4", "kv_quant.method=kvq", "kv_quant.policy=policy.json"],
     None),
], ids=["d2cache", "dare", "kvq"])
def test_every_spelling_gives_one_object(expected, kwargs, pairs, mode):
    assert config_from_generate_kwargs(**kwargs) == expected
    assert config_from_settings(pairs) == expected
    # lm-eval's model_args arrive as a dict of strings
    assert config_from_settings(dict(p.split("=", 1) for p in pairs)) == expected
    if mode is not None:
        rest = {k: v for k, v in expected.to_dict().items() if k not in ("cache", "reuse")}
        base = DecodeConfig.from_dict(rest)
        assert config_from_mode(mode, base) == expected
        assert mode_of(expected) == mode


def test_settings_errors_name_the_key():
    with pytest.raises(ConfigError, match="'shape.gen_lenght'|unknown key.*'gen_lenght'"):
        config_from_settings(["shape.gen_lenght=64"])
    with pytest.raises(ConfigError, match="unknown setting 'bogus'"):
        config_from_settings(["bogus=1"])
    with pytest.raises(ConfigError, match="is not KEY=VALUE"):
        config_from_settings(["cache"])
    with pytest.raises(ConfigError, match="dare_opts given without dare"):
        config_from_settings(["dare_opts.rho=0.5"])
    with pytest.raises(ConfigError, match="set twice"):
        config_from_settings(["cache=dual", "cache.method=prefix"])
    with pytest.raises(ConfigError, match=r"mode 'dual\+kv@x'"):
        config_from_mode("dual+kv@x")


def test_merge_replaces_what_a_new_method_makes_stale():
    base = config_from_mode("d2cache:k=4,p=0.1,sigma=3+o@0.5")
    # a new cache method drops d2cache's options; a new reuse mode drops the old number
    assert merge(base, {"cache": {"method": "dual"}}).cache == CacheConfig(method="dual")
    assert merge(base, {"reuse": {"tau": 0.1}}).reuse == ReuseConfig(method="o", tau=0.1)
    # a partial d2cache object keeps the other options
    assert merge(base, {"cache": {"d2cache": {"current_k": 8}}}).cache.d2cache == \
        D2CacheConfig(rollout_p=0.1, current_k=8, density_sigma=3.0)
