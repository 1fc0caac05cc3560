"""Locate the real CUDA toolkit root without importing torch.

The `nvcc` on PATH may be a wrapper script (as on our build machine, where
/usr/local/bin/nvcc execs /usr/local/cuda-13.0/bin/nvcc). torch's cpp_extension
then guesses CUDA_HOME=/usr/local and fails to link cudart, so setup.py, the
simulation build and the Makefile all ask this module instead.

Run as a script it prints the root (or nothing) so shells can use it.
find_cuda_headers() finds the headers alone, which is all the CUDA simulation
needs (the pip wheels of a CUDA build of torch ship them, with no nvcc).
"""
from __future__ import annotations

import glob
import os
import re
import shutil
import sys


def _is_root(path: str | None) -> bool:
    return bool(path) and os.path.isfile(os.path.join(path, "bin", "nvcc")) and os.path.isfile(
        os.path.join(path, "include", "cuda_runtime.h"))


def _from_nvcc(nvcc: str) -> str | None:
    real = os.path.realpath(nvcc)
    root = os.path.dirname(os.path.dirname(real))
    if _is_root(root):
        return root
    # A wrapper script: look for the path of the nvcc it forwards to.
    try:
        with open(real, "rb") as f:
            head = f.read(4096)
    except OSError:
        return None
    if b"\0" in head:  # a binary that is not inside a toolkit tree
        return None
    for m in re.finditer(r"(/[^\s\"']+)/bin/nvcc", head.decode("utf-8", "replace")):
        if _is_root(m.group(1)):
            return m.group(1)
    return None


def find_cuda_home() -> str | None:
    env = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if _is_root(env):
        return env
    nvcc = shutil.which("nvcc")
    if nvcc:
        root = _from_nvcc(nvcc)
        if root:
            return root
    for cand in _toolkit_roots():
        if _is_root(cand):
            return cand
    return None


# Where toolkits are installed (newest version first), and the system headers.
TOOLKIT_GLOBS = ("/usr/local/cuda", "/usr/local/cuda-*")
SYSTEM_INCLUDE = "/usr/include"


def _toolkit_roots() -> list[str]:
    return [r for g in TOOLKIT_GLOBS for r in sorted(glob.glob(g), reverse=True)]


# What the CUDA simulation (python_tests/sim/build.py) includes from a toolkit:
# the runtime headers, and CCCL's <nv/target> (which the fp16/bf16 headers use).
SIM_HEADERS = ("cuda_runtime.h", "cuda_fp16.h", "cuda_bf16.h", "cooperative_groups.h",
               "crt/host_defines.h")
CCCL_HEADER = "nv/target"


def _has(include: str, headers) -> bool:
    return all(os.path.isfile(os.path.join(include, h)) for h in headers)


def _site_dirs() -> list[str]:
    import site
    import sysconfig
    dirs = [sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]
    try:
        dirs += site.getsitepackages()
    except AttributeError:  # some virtualenvs
        pass
    return [d for d in dict.fromkeys(dirs + sys.path) if d and os.path.isdir(d)]


def find_cuda_headers() -> list[str] | None:
    """Include folders with the CUDA headers the simulation needs (no nvcc
    needed): $CUDA_HOME/include, a toolkit, the system headers, or pip wheels
    (a CUDA build of torch brings triton's copy of the runtime headers; CCCL
    comes from the toolkit or the nvidia-cuda-cccl wheel). None if incomplete."""
    cands = []
    env = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if env:
        cands.append(os.path.join(env, "include"))
    root = find_cuda_home()
    if root:
        cands.append(os.path.join(root, "include"))
    cands += [os.path.join(c, "include") for c in _toolkit_roots()]
    cands.append(SYSTEM_INCLUDE)
    wheel_cccl = []
    for d in _site_dirs():
        cands += sorted(glob.glob(os.path.join(d, "nvidia", "cu*", "include")), reverse=True)
        cands.append(os.path.join(d, "nvidia", "cuda_runtime", "include"))
        cands.append(os.path.join(d, "triton", "backends", "nvidia", "include"))
        wheel_cccl += [os.path.join(d, "nvidia", "cuda_cccl", "include")]
        wheel_cccl += sorted(glob.glob(os.path.join(d, "nvidia", "cu*", "include", "cccl")), reverse=True)
    for inc in dict.fromkeys(cands):
        if not _has(inc, SIM_HEADERS):
            continue
        for cccl in [inc, os.path.join(inc, "cccl")] + wheel_cccl:
            if _has(cccl, [CCCL_HEADER]):
                return [inc] if cccl == inc else [inc, cccl]
    return None


if __name__ == "__main__":
    root = find_cuda_home()
    if root:
        print(root)
    sys.exit(0)
