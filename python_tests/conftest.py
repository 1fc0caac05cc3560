import os
import sys

import pytest

# Tests import helpers as top-level modules (backends, sim.build).
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from backends import MODEL_DEVICES, require  # noqa: E402

# `make gpu-check` (DLLM_REQUIRE_CUDA=1): a skipped test or module is a failure,
# so a GPU run cannot pass by skipping what it came to check.
_STRICT = os.environ.get("DLLM_REQUIRE_CUDA") == "1"


# Optional extras whose tests may skip even there (pip install .[eval], .[ray]).
# "ray": test_serve_ray.py skips at import where Ray is absent (the lent GPU
# image has none), and a module skipped at collection made strict would be a
# collection error that stops the whole gpu-check pytest run; it is marked
# slow, so gpu-check's -m "not slow" would not run it anyway. "pydantic" and
# "fastapi": the server's stack, absent from that image too; test_server.py
# skips at import there (it has no CUDA tests).
OPTIONAL_MODULES = ("lm_eval", "ray", "pydantic", "fastapi")


def _fail_skip(report, what):
    if _STRICT and report.skipped and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        if any(f"could not import '{m}'" in reason for m in OPTIONAL_MODULES):
            return
        report.outcome = "failed"
        report.longrepr = f"{what} skipped under DLLM_REQUIRE_CUDA=1 (make gpu-check): {reason}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    _fail_skip(outcome.get_result(), item.nodeid)


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield
    _fail_skip(outcome.get_result(), collector.nodeid)


@pytest.fixture(scope="module", params=MODEL_DEVICES)
def model_device(request) -> str:
    """The device a method test's models and decode loop run on: every method
    test that takes it runs once per device (`make gpu-check` runs the cuda
    half against the same float64 oracles; here it skips)."""
    require(request.param)
    return request.param


@pytest.fixture(autouse=True)
def _restore_torch_threads():
    """A test that sets torch's thread count (the bench CLIs run in-process with
    --threads) leaves it as it found it: float32 results, and so the tests that
    compare decodes with float64 loops, depend on the GEMMs' thread count."""
    import torch
    threads = torch.get_num_threads()
    yield
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
