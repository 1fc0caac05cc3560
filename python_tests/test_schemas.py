"""Every `dllm` op is complete -- each place docs/adding-an-op.md lists for a
new op is there -- and the schemas' defaults equal the wrappers' and the fake
kernels'."""
import glob
import inspect
import os
import re
import sys

import pytest
import torch

import dllm_ops
from dllm_ops import ops, reference

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def dllm_schemas() -> dict:
    return {s.name.split("::", 1)[1]: s for s in torch._C._jit_get_all_schemas()
            if s.name.startswith("dllm::")}


def _read(*parts) -> str:
    path = os.path.join(ROOT, *parts)
    if not os.path.exists(path):
        return ""
    with open(path, encoding="utf-8") as f:
        return f.read()


def op_families() -> dict:
    """{op: family} from the `// ---- family: <name>` blocks of csrc/ops.cpp."""
    families, family = {}, None
    for line in _read("csrc", "ops.cpp").splitlines():
        m = re.search(r"// -+ family: (\w+)", line)
        if m:
            family = m.group(1)
        m = re.search(r'm\.def\("(\w+)\(', line)
        if m:
            families[m.group(1)] = family
    return families


def readme_op_families() -> dict:
    """{op: family} from README.md's op table: every `dllm.<op>(` in a row,
    with that row's family column."""
    families = {}
    for line in _read("README.md").splitlines():
        cells = line.split("|")
        if not line.startswith("|") or len(cells) < 4:
            continue
        for name in re.findall(r"dllm\.(\w+)\(", line):
            families.setdefault(name, cells[2].strip())
    return families


def test_the_library_defines_the_documented_ops():
    # The wrapper module's __all__ lists every op (plus has_cuda_kernels).
    assert set(dllm_schemas()) == set(ops.__all__) - {"has_cuda_kernels"}


def _built_with_cuda() -> bool:
    """Whether this _C was compiled with its CUDA kernels: setup.py compiles
    them all or none, so any op's CUDA kernel says so."""
    return any(dllm_ops.has_cuda_kernels(name) for name in dllm_schemas())


def test_every_op_is_complete():
    """One check per place of docs/adding-an-op.md's checklist (the schema's
    defaults, the fake kernel's signature and the cross-device cases are
    checked by the tests below and by test_edges.py)."""
    from torch._library.simple_registry import singleton

    sys.path.insert(0, ROOT)
    from bench.cases import CASES
    from backends import require
    require("sim")
    bench_modules = {}  # op -> the bench/cases modules that register its cases
    for case in CASES:
        bench_modules.setdefault(case.op, set()).add(case.make.__module__)
    with_cuda = _built_with_cuda()
    if os.environ.get("DLLM_REQUIRE_CUDA") == "1":
        assert with_cuda, "make gpu-check: this _C has no CUDA kernels"
    families = op_families()
    documented = readme_op_families()
    tests = {os.path.basename(p): _read(p) for p in glob.glob(os.path.join(ROOT, "python_tests", "test_*.py"))
             if not p.endswith("test_schemas.py")}
    missing = []
    for name in sorted(dllm_schemas()):
        qual = f"dllm::{name}"
        fam = families.get(name)
        checks = {
            "family block in csrc/ops.cpp": fam is not None,
            f"math header csrc/math/{fam}_math.h": os.path.exists(
                os.path.join(ROOT, "csrc", "math", f"{fam}_math.h")),
            f"checks header csrc/aten/{fam}_checks.h": os.path.exists(
                os.path.join(ROOT, "csrc", "aten", f"{fam}_checks.h")),
            f"CPU kernel registered in csrc/cpu/{fam}.cpp": f'm.impl("{name}"' in _read(
                "csrc", "cpu", f"{fam}.cpp"),
            "CPU kernel (dispatcher)": torch._C._dispatch_has_kernel_for_dispatch_key(qual, "CPU"),
            f"CUDA kernel header csrc/cuda/{fam}.cuh": os.path.exists(
                os.path.join(ROOT, "csrc", "cuda", f"{fam}.cuh")),
            f"CUDA kernel registered in csrc/cuda/{fam}.cu": f'DLLM_CUDA_REGISTER(m, "{name}"' in _read(
                "csrc", "cuda", f"{fam}.cu"),
            "simulated CUDA kernel (torch.ops.dllm_sim)": hasattr(torch.ops.dllm_sim, name),
            "fake kernel (dllm_ops/_fake.py)": singleton.find(qual).fake_impl.kernel is not None,
            "wrapper (dllm_ops.ops)": callable(getattr(ops, name, None)),
            "exported (dllm_ops.<op>)": getattr(dllm_ops, name, None) is getattr(ops, name, None),
            "oracle (dllm_ops.reference)": callable(getattr(reference, name, None)),
            f"bench case (bench/cases/{fam}.py)": bench_modules.get(name) == {f"bench.cases.{fam}"},
            "tests on every backend (a python_tests/test_*.py naming it, with BACKENDS)": any(
                f'"{name}"' in text and "BACKENDS" in text for text in tests.values()),
            "opcheck (python_tests: fake kernel vs the real one)": any(
                f"opcheck(torch.ops.dllm.{name}.default" in text for text in tests.values()),
            "README.md op table row with its family": documented.get(name) == fam,
        }
        if with_cuda:
            checks["CUDA kernel in _C"] = torch._C._dispatch_has_kernel_for_dispatch_key(qual, "CUDA")
        missing += [f"{name}: no {what}" for what, ok in checks.items() if not ok]
    assert not missing, "\n".join(missing)


def test_every_kernel_launch_runs_in_the_simulator_driver():
    """Each launch_* of csrc/cuda/*.cuh is called by the torch-free driver
    (csrc/tests/sim_kernels_main.cpp), which the sanitizers run."""
    driver = _read("csrc", "tests", "sim_kernels_main.cpp")
    launches = set()
    for path in glob.glob(os.path.join(ROOT, "csrc", "cuda", "*.cuh")):
        # The public entry points take one <Op>Params struct (per-instantiation
        # helpers such as launch_sparse_attention_d take it too but end in _d / _t).
        launches |= set(re.findall(r"\bvoid (launch_\w+)\(const \w+Params", _read(path)))
    launches = {n for n in launches if not re.search(r"_(d|t)$", n)}
    assert launches, "no launch_* found in csrc/cuda/*.cuh"
    missing = sorted(n for n in launches if not re.search(rf"\b{n}\b", driver))
    assert not missing, f"not run by csrc/tests/sim_kernels_main.cpp: {missing}"


def test_the_op_checklist_names_every_place():
    """docs/adding-an-op.md names each place test_every_op_is_complete checks."""
    doc = _read("docs", "adding-an-op.md")
    for place in ["csrc/ops.cpp", "csrc/math/", "csrc/aten/", "csrc/cpu/", "csrc/cuda/",
                  "csrc/tests/sim_kernels_main.cpp", "dllm_ops/_fake.py", "dllm_ops/ops.py",
                  "dllm_ops/__init__.py", "dllm_ops/reference.py", "bench/cases/", "python_tests/",
                  "opcheck", "README.md", "test_schemas.py", "test_edges.py"]:
        assert place in doc, f"docs/adding-an-op.md does not mention {place}"


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
