"""Locate the real CUDA toolkit root without importing torch.

The `nvcc` on PATH may be a wrapper script (as on our build machine, where
/usr/local/bin/nvcc execs /usr/local/cuda-13.0/bin/nvcc). torch's cpp_extension
then guesses CUDA_HOME=/usr/local and fails to link cudart, so setup.py, the
simulation build and the Makefile all ask this module instead.

Run as a script it prints the root (or nothing) so shells can use it.
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
    for cand in ["/usr/local/cuda"] + sorted(glob.glob("/usr/local/cuda-*"), reverse=True):
        if _is_root(cand):
            return cand
    return None


if __name__ == "__main__":
    root = find_cuda_home()
    if root:
        print(root)
    sys.exit(0)
