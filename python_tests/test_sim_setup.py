"""The CUDA simulation's set-up: it needs the CUDA headers (no nvcc), and where
it is expected (CI) its absence fails the sim tests instead of skipping them."""
import os
import sys

import pytest

import backends
from sim import build

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import cuda_home  # noqa: E402


def test_headers_are_found_without_nvcc(tmp_path, monkeypatch):
    real = cuda_home.find_cuda_headers()
    if real is None:
        pytest.skip("no CUDA headers on this machine")
    # A headers-only "toolkit": include/ (linked to real headers), no bin/nvcc.
    root = tmp_path / "cuda-headers-only"
    root.mkdir()
    os.symlink(real[0], root / "include")
    monkeypatch.setenv("CUDA_HOME", str(root))
    monkeypatch.delenv("CUDA_PATH", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))          # no nvcc anywhere
    monkeypatch.setattr(cuda_home, "TOOLKIT_GLOBS", ())
    assert cuda_home.find_cuda_home() is None
    assert cuda_home.find_cuda_headers()[0] == str(root / "include")


def test_incomplete_headers_are_not_taken(tmp_path, monkeypatch):
    inc = tmp_path / "include"
    inc.mkdir()
    for h in cuda_home.SIM_HEADERS[:-1]:      # no crt/host_defines.h (as in nvidia/cu13/include)
        (inc / h).write_text("")
    assert not cuda_home._has(str(inc), cuda_home.SIM_HEADERS)
    monkeypatch.setenv("CUDA_HOME", str(tmp_path))
    found = cuda_home.find_cuda_headers()
    assert found is None or str(inc) not in found


def _unavailable():
    raise build.SimUnavailable("no CUDA headers (planted)")


@pytest.mark.parametrize("env,outcome", [({"CI": "true"}, "fail"), ({"DLLM_REQUIRE_SIM": "1"}, "fail"),
                                         ({}, "skip")])
def test_missing_simulator_fails_where_it_is_expected(monkeypatch, env, outcome):
    monkeypatch.delenv("CI", raising=False)
    monkeypatch.delenv("DLLM_REQUIRE_SIM", raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(build, "load_sim", _unavailable)
    expected = pytest.fail.Exception if outcome == "fail" else pytest.skip.Exception
    with pytest.raises(expected, match="CUDA simulation unavailable: no CUDA headers"):
        backends.require("sim")
