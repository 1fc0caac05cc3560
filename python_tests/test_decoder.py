"""The decode API around the loop: one DecodeConfig (an object, a dict or
generate's keywords) resolves to the same decode; the Decoder steps one call at
a time to generate's result; policy / reuse objects stand for their config
section and conflict loudly; storage is its own axis; DecodeStats is typed and
reads as the flat keys it always had."""
import json

import pytest

pytest.importorskip("safetensors")
import torch

import dllm_ops
from dllm_ops.config import (CacheConfig, DecodeConfig, ReuseConfig, ShapeConfig, StorageConfig,
                             config_from_generate_kwargs)
from dllm_ops.dare import make_dare
from dllm_ops.decode import Decoder, resolve_config
from dllm_ops.errors import DecodeError
from dllm_ops.models import load
from dllm_ops.policies import D2Cache, DualCache, PrefixCache, make_policy
from dllm_ops.quant.storage import FullStorage, PackedStorage, make_storage
from dllm_ops.stats import DareStats, DecodeStats, LayerTimes, StorageStats
from tiny_ckpt import make_checkpoint

pytestmark = pytest.mark.models

PROMPTS = [[5, 9, 11, 30, 7, 8], [12, 40, 41, 6, 9, 10, 22, 50, 51, 17, 5]]
SHAPE = dict(gen_length=16, block_length=8)


@pytest.fixture(scope="module")
def llada(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("llada"))
    make_checkpoint(path, "llada", seed=3)
    return load(path, dtype=torch.float32, device="cpu")


# The flat keys GenerateOutput.stats had as a dict before DecodeStats (a reader
# that indexed them keeps working): base, DARE's, the packed storage's, timing's.
BASE_KEYS = {"nfe", "wall_s", "generated_tokens", "tokens_per_s", "tokens_recomputed",
             "recomputed_per_step", "n_layers", "model_flops", "eos_filled", "cache", "reveal",
             "blocks_decoded", "blocks"}
DARE_KEYS = {"dare", "dare_rho", "dare_tau", "dare_phi_max", "dare_rule", "dare_reuse_share",
             "dare_reuse_share_all_calls", "dare_reuse_share_per_layer", "dare_activations_run",
             "dare_activations_reused", "dare_reused_with_zero_drift_per_layer", "dare_flops_saved"}
KVQ_KEYS = {"kv_quant", "kv_quant_policy", "kv_cache_bytes", "kv_cache_bytes_bf16",
            "kv_read_bytes_per_call", "kv_read_bytes_per_call_bf16", "k_bits", "v_bits"}
TIME_KEYS = {"layer_seconds", "layer_seconds_block_start"}


def test_one_configuration_three_spellings(llada):
    """An object, its JSON dict and generate's keywords decode identically."""
    kw = dict(cache="dual", unmask="threshold", threshold=0.7, dare="kv", dare_opts=dict(rho=0.5),
              **SHAPE)
    cfg = config_from_generate_kwargs(**kw)
    by_object = dllm_ops.generate(llada, PROMPTS, cfg)
    by_dict = dllm_ops.generate(llada, PROMPTS, json.loads(cfg.to_json()))
    by_keywords = dllm_ops.generate(llada, PROMPTS, **kw)
    assert by_object.tokens.tolist() == by_dict.tokens.tolist() == by_keywords.tokens.tolist()
    assert by_object.stats.nfe == by_keywords.stats.nfe
    # keywords on top of an object change only what they name
    wider = dllm_ops.generate(llada, PROMPTS, cfg, threshold=0.95)
    assert wider.stats.nfe >= by_object.stats.nfe
    assert resolve_config(cfg, dict(threshold=0.95), None) == cfg.replace(
        reveal=cfg.reveal.replace(threshold=0.95))


@pytest.mark.parametrize("cfg", [
    dict(cache=dict(method="none"), reveal=dict(unmask="topk"), shape=dict(SHAPE, steps=16)),
    dict(cache=dict(method="d2cache", d2cache=dict(current_k=4)), reveal=dict(unmask="threshold")),
    dict(cache=dict(method="dual"), storage=dict(method="kivi", bits=4), reveal=dict(unmask="threshold")),
    dict(cache=dict(method="prefix"), reuse=dict(method="o", tau=0.05), reveal=dict(unmask="threshold")),
], ids=["none", "d2cache", "dual-kivi4", "prefix-dare-o"])
def test_decoder_steps_to_generates_result(llada, cfg):
    """generate is the Decoder stepped to the end: one step is one model call."""
    config = DecodeConfig.from_dict({"shape": SHAPE, **cfg}) if "shape" not in cfg else \
        DecodeConfig.from_dict(cfg)
    want = dllm_ops.generate(llada, PROMPTS, config)
    dec = Decoder(llada, PROMPTS, config)
    calls = 0
    while dec.step():
        calls += 1
    assert not dec.step()                     # finished: no further call
    got = dec.result()
    assert calls == got.stats.nfe == want.stats.nfe
    assert got.tokens.tolist() == want.tokens.tolist()


def test_stats_are_typed_and_read_as_the_old_keys(llada):
    plain = dllm_ops.generate(llada, PROMPTS, cache="dual", unmask="threshold", **SHAPE).stats
    assert isinstance(plain, DecodeStats)
    assert set(plain) == BASE_KEYS and plain.dare is None and plain.kv_quant is None
    assert plain["nfe"] == plain.nfe and plain.get("dare") is None
    full = dllm_ops.generate(llada, PROMPTS, cache="dual", unmask="threshold", dare="kv",
                             dare_opts=dict(rho=0.5), kv_quant=dict(bits=4, method="kivi"),
                             time_layers=True, **SHAPE).stats
    assert isinstance(full.dare, DareStats) and isinstance(full.kv_quant, StorageStats)
    assert isinstance(full.layer_times, LayerTimes)
    assert set(full) == BASE_KEYS | DARE_KEYS | KVQ_KEYS | TIME_KEYS
    assert full["dare_reuse_share"] == full.dare.reuse_share
    assert full["kv_quant"] == "kivi4" == full.kv_quant.method
    assert len(full.layer_times.seconds) == full.nfe
    assert json.loads(json.dumps(dict(full))) == json.loads(json.dumps(full.to_dict()))
    assert repr(full).startswith("DecodeStats({'nfe'")


def test_policy_object_stands_for_the_cache_section(llada):
    d2 = D2Cache(rollout_p=0.2, current_k=3, sigma=4.0)
    cfg = resolve_config(None, dict(SHAPE), d2)
    assert cfg.cache == CacheConfig.from_dict(dict(method="d2cache", d2cache=dict(
        rollout_p=0.2, current_k=3, density_sigma=4.0)))
    # naming another method as well is refused, whichever spelling names it
    with pytest.raises(DecodeError, match="not both"):
        dllm_ops.generate(llada, PROMPTS, policy=DualCache(), cache="prefix", **SHAPE)
    with pytest.raises(DecodeError, match="replaces the configuration's cache section"):
        dllm_ops.generate(llada, PROMPTS, DecodeConfig(cache=CacheConfig(method="prefix")),
                          policy=DualCache())
    with pytest.raises(DecodeError, match="not both"):
        dllm_ops.generate(llada, PROMPTS, policy=d2, d2cache=dict(current_k=5), cache="d2cache", **SHAPE)
    # the same method is no conflict; a packed storage then sees the policy's cache
    out = dllm_ops.generate(llada, PROMPTS, policy=PrefixCache(), cache="prefix", unmask="threshold",
                            kv_quant=dict(bits=2, method="kivi"), **SHAPE)
    assert out.stats.cache == "prefix" and out.stats.kv_quant.method == "kivi2"


def test_reuse_object_stands_for_the_reuse_section(llada):
    rule = make_dare(ReuseConfig(method="kv", rho=0.5), llada.config)
    out = dllm_ops.generate(llada, PROMPTS, cache="dual", unmask="threshold", reuse=rule, **SHAPE)
    assert out.stats.dare.mode == "kv" and rule.calls == out.stats.nfe
    again = make_dare(ReuseConfig(method="kv", rho=0.5), llada.config)
    old = dllm_ops.generate(llada, PROMPTS, cache="dual", unmask="threshold", dare=again, **SHAPE)
    assert old.tokens.tolist() == out.tokens.tolist()     # generate's older spelling
    with pytest.raises(DecodeError, match="not both"):
        dllm_ops.generate(llada, PROMPTS, cache="dual", reuse=rule, dare="o",
                          dare_opts=dict(rho=0.5), **SHAPE)


def test_config_argument_type_is_checked(llada):
    with pytest.raises(DecodeError, match="config must be a DecodeConfig or a dict"):
        dllm_ops.generate(llada, PROMPTS, "dual")


def test_storage_axis(llada):
    """make_storage picks the store; the loop never asks which (generate has no
    branch on quantization)."""
    assert isinstance(make_storage(llada, StorageConfig(), "d2cache"), FullStorage)
    packed = make_storage(llada, StorageConfig(method="kivi", bits=2), "dual")
    assert isinstance(packed, PackedStorage) and packed.layers[0].p == 0
    valid = torch.ones(1, 12, dtype=torch.bool)
    cache = packed.new_cache(llada, valid)
    assert packed.stats(cache).method == "kivi2"
    assert FullStorage().stats(FullStorage().new_cache(llada, valid)) is None
    # a policy object's cache method is what the storage checks
    with pytest.raises(DecodeError, match="needs cache 'prefix', 'dual' or 'd2cache', got 'none'"):
        make_storage(llada, StorageConfig(method="kivi", bits=4), "none")
    import inspect
    src = inspect.getsource(dllm_ops.decode)
    assert "kv_quant" not in src.split("def generate(")[1].split('"""')[2]   # the body, not the docs


def test_make_policy_from_config_or_name():
    assert isinstance(make_policy("dual"), DualCache)
    p = make_policy(CacheConfig.from_dict(dict(method="d2cache", d2cache=dict(current_k=7))))
    assert isinstance(p, D2Cache) and p.current_k == 7
    assert p.cache_config().d2cache.current_k == 7
    assert ShapeConfig(gen_length=16, block_length=8).num_blocks == 2
