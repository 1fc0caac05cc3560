"""Self-tests of the CUDA CPU simulation (csrc/cudasim/), no torch involved.

Compiles csrc/cudasim/tests/selftest.cpp with g++ for each engine (fibers,
the default; threads, what TSan runs; ucontext, the non-x86-64 fallback), runs
it, and checks that csrc/cudasim/tests/dual_compile.cu builds both as the
simulation and, when nvcc is present, as real CUDA for sm_90. The sanitizer
runs live in scripts/sanitize_sim.sh (too slow for every pytest run).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.join(ROOT, "csrc", "cudasim", "tests")
CXX = os.environ.get("CXX", "g++")

ENGINES = {
    "fibers": [],
    "threads": ["-DCUDASIM_THREADS"],
    "ucontext": ["-DCUDASIM_UCONTEXT"],
}


def _has_headers(root: str | None) -> bool:
    return bool(root) and os.path.isfile(os.path.join(root, "include", "cuda_fp16.h"))


def find_cuda_home() -> str | None:
    """CUDA_HOME, then tools/cuda_home.py, then /usr/local/cuda-13.0, then nvcc's location."""
    if _has_headers(os.environ.get("CUDA_HOME")):
        return os.environ["CUDA_HOME"]
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    try:
        from cuda_home import find_cuda_home as tools_find  # type: ignore

        root = tools_find()
        if _has_headers(root):
            return root
    except Exception:  # noqa: BLE001 - any failure just means "look elsewhere"
        pass
    finally:
        sys.path.pop(0)
    if _has_headers("/usr/local/cuda-13.0"):
        return "/usr/local/cuda-13.0"
    nvcc = shutil.which("nvcc")
    if nvcc:
        root = os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))
        if _has_headers(root):
            return root
    return None


def sim_flags(cuda_home: str) -> list[str]:
    return [
        "-std=c++20", "-O1", "-g", "-pthread", "-DCUDASIM", "-Wall", "-Wextra", "-Wno-unknown-pragmas",
        "-I" + os.path.join(ROOT, "csrc", "cudasim", "shim_include"),
        "-I" + os.path.join(ROOT, "csrc", "cudasim"),
        "-I" + os.path.join(cuda_home, "include"),
        "-I" + os.path.join(ROOT, "csrc"),
        # As nvcc force-includes cuda_runtime.h into every .cu.
        "-include", "cudasim/cuda_compat.cuh",
    ]


class Build:
    def __init__(self, exe: str, cmd: list[str]):
        self.exe, self.cmd = exe, cmd
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.log = ""
        self.rc: int | None = None

    def wait(self) -> "Build":
        self.log, _ = self.proc.communicate(timeout=600)
        self.rc = self.proc.returncode
        return self

    def check(self) -> str:
        assert self.rc == 0, f"build failed: {' '.join(self.cmd)}\n{self.log}"
        return self.exe


@pytest.fixture(scope="module")
def builds(tmp_path_factory) -> dict[str, Build]:
    cuda = find_cuda_home()
    if cuda is None:
        pytest.skip("no CUDA toolkit headers (cuda_fp16.h) found: set CUDA_HOME")
    if shutil.which(CXX) is None:
        pytest.skip(f"no C++ compiler {CXX!r}")
    out = str(tmp_path_factory.mktemp("cudasim"))
    flags = sim_flags(cuda)
    jobs: dict[str, Build] = {}
    # All compiles at once: the OS spreads them over the cores.
    for name, extra in ENGINES.items():
        exe = os.path.join(out, f"selftest_{name}")
        jobs[name] = Build(exe, [CXX, *flags, *extra, os.path.join(TESTS, "selftest.cpp"), "-o", exe])
    exe = os.path.join(out, "dual_sim")
    jobs["dual_sim"] = Build(exe, [CXX, *flags, "-x", "c++", os.path.join(TESTS, "dual_compile.cu"), "-o", exe])
    nvcc = os.path.join(cuda, "bin", "nvcc")
    if os.path.isfile(nvcc):
        obj = os.path.join(out, "dual_nvcc.o")
        jobs["dual_nvcc"] = Build(obj, [nvcc, "-std=c++17", "-arch=sm_90", "-I" + os.path.join(ROOT, "csrc"),
                                        "-c", "-x", "cu", os.path.join(TESTS, "dual_compile.cu"), "-o", obj])
    return {k: b.wait() for k, b in jobs.items()}


def run(exe: str, *args: str, env: dict[str, str] | None = None, timeout: int = 180) -> subprocess.CompletedProcess:
    full_env = dict(os.environ)
    full_env.pop("CUDASIM_WARN_ONLY", None)
    full_env.update(env or {})
    return subprocess.run([exe, *args], cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("engine", list(ENGINES))
def test_selftest(builds, engine):
    r = run(builds[engine].check())
    print(r.stdout)
    assert r.returncode == 0, f"{engine} selftest failed:\n{r.stdout}\n{r.stderr}"
    assert "tests passed" in r.stdout


def test_shim_compiles_without_warnings(builds):
    log = builds["fibers"].log + builds["threads"].log
    shim_warnings = [line for line in log.splitlines() if "warning:" in line and "cudasim/" in line]
    assert not shim_warnings, "\n".join(shim_warnings)


@pytest.mark.parametrize(
    "env,test,expect_stderr",
    [
        ({"CUDASIM_WARN_ONLY": "1"}, "env_warn_only", "cudasim warning: divergent barrier"),
        ({"CUDASIM_WARN_ONLY": "0"}, "env_warn_only", None),
        ({"CUDASIM_STACK_KB": "64"}, "row_reduce", None),
    ],
)
def test_environment(builds, env, test, expect_stderr):
    r = run(builds["fibers"].check(), test, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    if expect_stderr:
        assert expect_stderr in r.stderr, r.stderr


def test_selftest_rejects_unknown_name(builds):
    r = run(builds["fibers"].check(), "no_such_test")
    assert r.returncode == 2


def test_dual_compile_sim(builds):
    r = run(builds["dual_sim"].check())
    assert r.returncode == 0 and "ok" in r.stdout, r.stdout + r.stderr


def test_dual_compile_nvcc(builds):
    """cuda_compat.cuh under real nvcc: plain CUDA, none of the shim."""
    if "dual_nvcc" not in builds:
        pytest.skip("nvcc not found in the CUDA toolkit")
    builds["dual_nvcc"].check()


def test_sanitize_script_parses():
    """scripts/sanitize_sim.sh itself is run by hand / CI (minutes); here only `bash -n`."""
    bash = shutil.which("bash")
    if bash is None:
        pytest.skip("no bash")
    r = subprocess.run([bash, "-n", os.path.join(ROOT, "scripts", "sanitize_sim.sh")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
