"""_C and the C++ runtime: one libstdc++ in the process (tools/libstdcxx.py).

On the lent GPU machine the compiler linked libstdc++ statically into _C, and
every error message that printed a number segfaulted there; the op tests'
`match=` patterns stop before the numbers, so they did not see it on a CPU,
where the same build cut the message at its first number instead.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from backends import MODEL_DEVICES, require

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import libstdcxx  # noqa: E402

# A bad call whose message formats two shapes: run in a child, so a crash is
# this test's failure and not the end of the pytest run.
_BAD_CALL = """
import sys, torch, dllm_ops
d = sys.argv[1]
try:
    dllm_ops.cosine_drift(torch.randn(3, 4, device=d), torch.randn(3, 5, device=d))
except RuntimeError as e:
    print(str(e).splitlines()[0])
"""


@pytest.mark.parametrize("device", MODEL_DEVICES)
def test_error_messages_carry_their_numbers(device):
    require(device)
    out = subprocess.run([sys.executable, "-c", _BAD_CALL, device], capture_output=True,
                         text=True, timeout=300, env={**os.environ, "PYTHONPATH": ROOT})
    assert out.returncode == 0, f"the child died ({out.returncode}): {out.stderr[-2000:]}"
    assert ("dllm::cosine_drift: x and x_prev must have the same shape, got [3, 4] and [3, 5]"
            in out.stdout), out.stdout


def test_the_extension_needs_the_shared_libstdcxx():
    import dllm_ops

    if os.environ.get("DLLM_OPS_LIBRARY"):
        pytest.skip("an alternative op library is loaded (DLLM_OPS_LIBRARY)")
    needed = libstdcxx.needed_libraries(dllm_ops._C.__file__)
    assert needed is not None and "libc.so.6" in needed, needed
    assert any(n.startswith("libstdc++.so") for n in needed), needed


def test_needed_libraries_reads_what_readelf_lists(tmp_path):
    import dllm_ops

    readelf = shutil.which("readelf")
    if readelf is None:
        pytest.skip("readelf is not installed")
    for path in (dllm_ops._C.__file__, libstdcxx.loaded_libstdcxx()):
        out = subprocess.run([readelf, "-d", path], capture_output=True, text=True, check=True).stdout
        want = [line.split("[", 1)[1].split("]", 1)[0] for line in out.splitlines() if "(NEEDED)" in line]
        assert libstdcxx.needed_libraries(path) == want
    not_elf = tmp_path / "x.so"
    not_elf.write_bytes(b"not an ELF file")
    assert libstdcxx.needed_libraries(str(not_elf)) is None
    assert libstdcxx.needed_libraries(str(tmp_path / "missing.so")) is None


@pytest.fixture
def static_compiler(tmp_path):
    """A stand-in for a compiler whose driver links libstdc++ statically."""
    cxx = libstdcxx.compiler()
    archive = subprocess.run([*cxx.split(), "-print-file-name=libstdc++.a"],
                             capture_output=True, text=True).stdout.strip()
    if shutil.which(cxx.split()[0]) is None or not os.path.isabs(archive):
        pytest.skip(f"{cxx} has no static libstdc++ to stand in with")
    wrapper = tmp_path / "cxx-static"
    wrapper.write_text(f'#!/bin/sh\nexec {cxx} "$@" -static-libstdc++\n')
    wrapper.chmod(0o755)
    return str(wrapper)


def test_a_compiler_that_links_libstdcxx_statically_is_caught(static_compiler):
    import torch  # noqa: F401  (loads the shared libstdc++ the answer names)

    assert libstdcxx.links_libstdcxx_statically(static_compiler)
    lib = libstdcxx.libstdcxx_to_link(static_compiler)
    assert lib is not None and os.path.basename(lib).startswith("libstdc++.so"), lib
    assert os.path.isfile(lib)


def test_a_compiler_that_links_it_shared_changes_nothing(static_compiler):
    # The plain compiler of the stand-in: this machine's build needs libstdc++.so.
    plain = libstdcxx.compiler()
    if libstdcxx.links_libstdcxx_statically(plain):
        pytest.skip(f"{plain} itself links libstdc++ statically here")
    assert libstdcxx.libstdcxx_to_link(plain) is None


def test_a_probe_that_does_not_build_changes_nothing(tmp_path):
    broken = tmp_path / "cxx-broken"
    broken.write_text("#!/bin/sh\nexit 1\n")
    broken.chmod(0o755)
    assert not libstdcxx.links_libstdcxx_statically(str(broken))
    assert libstdcxx.libstdcxx_to_link(str(broken)) is None
