"""docs/adding-a-method.md, enforced where a test can see it: every cache
method, reuse rule and storage the configuration names is built by its factory
and names itself back, every entry point's grammar reaches it, its module sits
in a layer of the import rule (test_imports.py), and a mutation of
tools/mutations.py plants a bug in its module that a test must catch."""
import inspect
import os
import sys

import pytest

pytest.importorskip("safetensors")
import torch

from dllm_ops.config import (CACHE_METHODS, REUSE_METHODS, STORAGE_METHODS, CacheConfig,
                             ReuseConfig, StorageConfig, config_from_generate_kwargs,
                             config_from_mode, config_from_settings)
from dllm_ops.dare import DARE_RULES, DareReuse, make_dare
from dllm_ops.models import load
from dllm_ops.policies import POLICIES, Policy, make_policy
from dllm_ops.quant import storage as storage_module
from dllm_ops.quant.policy_table import make_table
from dllm_ops.stats import _Flat
from tiny_ckpt import make_checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))
from mutations import MUTATIONS  # noqa: E402

MUTATED_FILES = {m.file for m in MUTATIONS}


def _repo_path(obj) -> str:
    return os.path.relpath(inspect.getsourcefile(obj), ROOT)


@pytest.fixture(scope="module")
def llada(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("llada"))
    make_checkpoint(path, "llada", seed=3)
    return load(path, dtype=torch.float32, device="cpu")


# ---- cache methods ------------------------------------------------------------

def test_cache_methods_and_policies_are_one_list():
    """Step 1 + 2: the configuration's names and the policy registry agree."""
    assert set(POLICIES) == set(CACHE_METHODS)


@pytest.mark.parametrize("method", CACHE_METHODS)
def test_every_cache_method_is_built_and_named_back(method):
    cfg = CacheConfig(method=method)
    policy = make_policy(cfg)
    assert isinstance(policy, Policy) and policy.name == method
    assert policy.cache_config() == cfg
    # every entry point's grammar reaches it (the CLI's --set, lm-eval's
    # model_args and the server's defaults share config_from_settings)
    assert config_from_settings([f"cache.method={method}"]).cache == cfg
    assert config_from_settings([f"cache={method}"]).cache == cfg
    assert config_from_generate_kwargs(cache=method).cache == cfg
    assert config_from_mode(method).cache == cfg


@pytest.mark.parametrize("method", CACHE_METHODS)
def test_every_cache_method_has_a_mutation(method):
    assert _repo_path(POLICIES[method]) in MUTATED_FILES


# ---- per-layer reuse rules ----------------------------------------------------

def test_reuse_methods_and_rules_are_one_list():
    assert set(DARE_RULES) | {"none"} == set(REUSE_METHODS)


@pytest.mark.parametrize("method", sorted(DARE_RULES))
def test_every_reuse_rule_is_built_and_reports_typed_stats(method, llada):
    rule = make_dare(ReuseConfig(method=method, rho=0.5), llada.config)
    assert isinstance(rule, DARE_RULES[method]) and isinstance(rule, DareReuse)
    assert rule.mode == method
    assert isinstance(rule.stats(), _Flat)
    assert callable(rule.attention_branch) and callable(rule.begin_call)
    assert config_from_mode(f"dual+{method}@0.5").reuse == ReuseConfig(method=method, rho=0.5)
    assert config_from_settings([f"reuse.method={method}", "reuse.rho=0.5"]).reuse.method == method
    assert _repo_path(DARE_RULES[method]) in MUTATED_FILES


# ---- storage ------------------------------------------------------------------

@pytest.mark.parametrize("method", STORAGE_METHODS)
def test_every_storage_is_built(method, llada, tmp_path):
    kw = {}
    if method != "full":
        kw["bits"] = 4
    if method == "kvq":
        path = tmp_path / "table.json"
        make_table(llada, "tiny", "dual", 4, [("attention", 1)] * llada.config.n_layers).save(str(path))
        kw["table"] = str(path)
    store = storage_module.make_storage(llada, StorageConfig(method=method, **kw), "dual")
    cache = store.new_cache(llada, torch.ones(1, 12, dtype=torch.bool))
    store.begin_block(cache, 4, 12)
    stats = store.stats(cache)
    assert stats is None if method == "full" else isinstance(stats, _Flat)
    assert _repo_path(type(store)) in MUTATED_FILES
    assert config_from_settings([f"storage.method={method}", *[f"storage.{k}={v}" for k, v in kw.items()],
                                 "cache.method=dual"]).storage.method == method
