"""Every `dllm` op is complete: a CPU kernel, a CUDA kernel (when the build has
CUDA), a simulated CUDA kernel, a fake kernel, a typed wrapper, a reference
oracle and a bench case; and the schemas' defaults equal the wrappers'."""
import inspect
import os
import sys

import pytest
import torch

import dllm_ops
from dllm_ops import ops, reference

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def dllm_schemas() -> dict:
    return {s.name.split("::", 1)[1]: s for s in torch._C._jit_get_all_schemas()
            if s.name.startswith("dllm::")}


def test_the_library_defines_the_documented_ops():
    # The wrapper module's __all__ lists every op (plus has_cuda_kernels).
    assert set(dllm_schemas()) == set(ops.__all__) - {"has_cuda_kernels"}


def _built_with_cuda() -> bool:
    """Whether this _C was compiled with its CUDA kernels: setup.py compiles
    them all or none, so any op's CUDA kernel says so."""
    return any(dllm_ops.has_cuda_kernels(name) for name in dllm_schemas())


def test_every_op_is_complete():
    from torch._library.simple_registry import singleton

    sys.path.insert(0, ROOT)
    from bench.cases import CASES
    from backends import require
    require("sim")
    bench_ops = {c.op for c in CASES}
    with_cuda = _built_with_cuda()
    if os.environ.get("DLLM_REQUIRE_CUDA") == "1":
        assert with_cuda, "make gpu-check: this _C has no CUDA kernels"
    missing = []
    for name in sorted(dllm_schemas()):
        qual = f"dllm::{name}"
        checks = {
            "CPU kernel": torch._C._dispatch_has_kernel_for_dispatch_key(qual, "CPU"),
            "simulated CUDA kernel (torch.ops.dllm_sim)": hasattr(torch.ops.dllm_sim, name),
            "fake kernel (dllm_ops/_fake.py)": singleton.find(qual).fake_impl.kernel is not None,
            "wrapper (dllm_ops.ops)": callable(getattr(ops, name, None)),
            "exported (dllm_ops.<op>)": getattr(dllm_ops, name, None) is getattr(ops, name, None),
            "oracle (dllm_ops.reference)": callable(getattr(reference, name, None)),
            "bench case (bench/cases)": name in bench_ops,
        }
        if with_cuda:
            checks["CUDA kernel in _C"] = torch._C._dispatch_has_kernel_for_dispatch_key(qual, "CUDA")
        missing += [f"{name}: no {what}" for what, ok in checks.items() if not ok]
    assert not missing, "\n".join(missing)


def _schema_default(arg):
    return arg.default_value if arg.has_default_value() else inspect.Parameter.empty


@pytest.mark.parametrize("name", sorted(dllm_schemas()))
def test_schema_defaults_equal_the_wrapper(name):
    """An argument the wrapper shares with the schema (by name) has the same
    default in both, or none in both. (Wrappers of the packed-cache ops take a
    PackedK / PackedV in place of several schema tensors; those are not shared.)"""
    schema = dllm_schemas()[name]
    params = inspect.signature(getattr(ops, name)).parameters
    shared = [a for a in schema.arguments if a.name in params]
    for arg in schema.arguments:
        if arg.has_default_value():
            assert arg.name in params, f"dllm::{name}: {arg.name} has a default but no wrapper parameter"
    diffs = [(a.name, _schema_default(a), params[a.name].default) for a in shared
             if _schema_default(a) != params[a.name].default
             or type(_schema_default(a)) is not type(params[a.name].default)]
    assert not diffs, f"dllm::{name}: (argument, schema default, wrapper default): {diffs}"


@pytest.mark.parametrize("name", sorted(dllm_schemas()))
def test_fake_kernel_defaults_equal_the_schema(name):
    """torch calls a fake kernel with the arguments as given (defaults left
    out), so its signature must carry the schema's defaults."""
    from dllm_ops import _fake
    schema = dllm_schemas()[name]
    fake = getattr(_fake, f"_{name}_fake")          # registered as dllm::<name>'s fake kernel
    params = list(inspect.signature(fake).parameters.values())
    assert [p.name for p in params] == [a.name for a in schema.arguments]
    diffs = [(a.name, _schema_default(a), p.default) for a, p in zip(schema.arguments, params)
             if _schema_default(a) != p.default]
    assert not diffs, f"dllm::{name}: (argument, schema default, fake default): {diffs}"


def test_schema_defaults_work_through_torch_ops():
    """torch.ops.dllm.<op> takes the optional arguments as the wrapper does."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 37, generator=g)
    for a, b in zip(torch.ops.dllm.token_confidence(logits), dllm_ops.token_confidence(logits)):
        assert torch.equal(a, b)
    for a, b in zip(torch.ops.dllm.token_confidence(logits, "prob"),
                    dllm_ops.token_confidence(logits, "prob")):
        assert torch.equal(a, b)
    score = torch.rand(2, 9, generator=g)
    cand = torch.rand(2, 9, generator=g) > 0.3
    assert torch.equal(torch.ops.dllm.select_transfer(score, cand, "threshold"),
                       dllm_ops.select_transfer(score, cand, "threshold"))
    decoded = torch.rand(2, 40, generator=g) > 0.5
    assert torch.equal(torch.ops.dllm.certainty_density(decoded), dllm_ops.certainty_density(decoded))
    k = torch.randn(1, 2, 40, 32, generator=g)
    assert torch.equal(torch.ops.dllm.k_quant_error(k), dllm_ops.k_quant_error(k))
    for a, b in zip(torch.ops.dllm.quantize_v(k), dllm_ops.quantize_v(k).tensors()):
        assert torch.equal(a, b)
