"""Build dllm_ops._C.

CUDA kernels are compiled whenever torch is a CUDA build and a CUDA toolkit
(nvcc) is found -- no GPU is needed to compile them. Otherwise, or with
DLLM_FORCE_CPU=1, a CPU-only extension is built.

Environment:
  DLLM_FORCE_CPU=1        CPU-only build even when CUDA is available
  FORCE_CUDA=1            fail instead of falling back to CPU-only
  TORCH_CUDA_ARCH_LIST    CUDA architectures (default "9.0", H100/H200)
  MAX_JOBS                parallel compile jobs (honoured by torch's ninja build)
  DEBUG=1                 -O0 -g
  CUDA_HOME               toolkit root (found from nvcc when unset)
"""
import glob
import os
import re
import sys

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

ROOT = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(ROOT, "tools"))
from cuda_home import find_cuda_home  # noqa: E402
from libstdcxx import lacks_shared_libstdcxx, libstdcxx_to_link, loaded_libstdcxx  # noqa: E402

# torch.utils.cpp_extension reads CUDA_HOME once, at import: set it first.
_cuda_home = find_cuda_home()
if _cuda_home:
    os.environ["CUDA_HOME"] = _cuda_home
os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0")

import torch  # noqa: E402
from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension  # noqa: E402


def _flag(name: str) -> bool:
    return os.environ.get(name, "0") not in ("", "0", "false", "False")


def want_cuda() -> bool:
    if _flag("DLLM_FORCE_CPU"):
        return False
    ok = torch.version.cuda is not None and _cuda_home is not None
    if _flag("FORCE_CUDA") and not ok:
        raise RuntimeError(
            f"FORCE_CUDA=1 but torch.version.cuda={torch.version.cuda!r}, CUDA_HOME={_cuda_home!r}")
    return ok


def extensions():
    debug = _flag("DEBUG")
    opt = ["-O0", "-g"] if debug else ["-O3"]
    csrc = os.path.join(ROOT, "csrc")
    sources = [os.path.join("csrc", "ops.cpp")] + sorted(
        os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(csrc, "cpu", "*.cpp")))
    cxx = opt + ["-fopenmp", "-Wall", "-Wno-unknown-pragmas"]
    if _flag("DLLM_NATIVE"):
        cxx.append("-march=native")
    link = ["-fopenmp"]
    # A compiler that links libstdc++ statically would give _C a second copy
    # beside torch's, and number formatting in its error messages breaks
    # (tools/libstdcxx.py): link torch's shared one instead.
    libstdcxx = libstdcxx_to_link()
    if libstdcxx:
        print(f"dllm_ops: {os.environ.get('CXX', 'c++')} links libstdc++ statically; "
              f"linking _C against {libstdcxx} (the one torch loaded) instead")
        link.append(libstdcxx)
    common = dict(include_dirs=[csrc], extra_link_args=link)
    if want_cuda():
        sources += sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(csrc, "cuda", "*.cu")))
        nvcc = opt + ["-lineinfo", "--expt-relaxed-constexpr",
                      "--threads", os.environ.get("NVCC_THREADS", "2")]
        print(f"dllm_ops: building CUDA kernels for TORCH_CUDA_ARCH_LIST="
              f"{os.environ['TORCH_CUDA_ARCH_LIST']} with CUDA_HOME={_cuda_home}")
        return [CUDAExtension("dllm_ops._C", sources,
                              extra_compile_args={"cxx": cxx, "nvcc": nvcc}, **common)]
    print("dllm_ops: CPU-only build")
    return [CppExtension("dllm_ops._C", sources, extra_compile_args={"cxx": cxx}, **common)]


class BuildExtensionOneLibstdcxx(BuildExtension):
    """torch's build, then a look at what it linked: a _C that carries its own
    libstdc++ (a link driver other than the compiler setup.py probed) is
    relinked once against the shared one torch loaded (tools/libstdcxx.py)."""

    def build_extension(self, ext):
        super().build_extension(ext)
        path = self.get_ext_fullpath(ext.name)
        lib = loaded_libstdcxx()
        if lib and lib not in ext.extra_link_args and lacks_shared_libstdcxx(path):
            print(f"dllm_ops: {path} carries libstdc++ inside it; relinking against {lib}")
            ext.extra_link_args.append(lib)
            os.remove(path)
            super().build_extension(ext)


def package_version() -> str:
    """dllm_ops/_version.py's __version__ (read, not imported: the package needs
    torch and the extension this file builds)."""
    with open(os.path.join(ROOT, "dllm_ops", "_version.py")) as f:
        return re.search(r'^__version__ = "([^"]+)"$', f.read(), re.M).group(1)


# `lm_eval --model dllm_ops` (the optional [eval] extra): lm-eval knows only its
# own models, so a one-line .pth imports _dllm_ops_lm_eval.py at start-up, which
# registers the model once lm_eval loads its model list (`make build` writes the
# same .pth for the in-place build).
LM_EVAL_PTH = "dllm_ops_lm_eval.pth"


class BuildPyWithLmEvalHook(build_py):
    def run(self):
        super().run()
        with open(os.path.join(self.build_lib, LM_EVAL_PTH), "w") as f:
            f.write("import _dllm_ops_lm_eval\n")


setup(
    name="dllm_ops",
    version=package_version(),
    description="Fast diffusion-LLM inference kernels for PyTorch (d2Cache, DARE, dLLM-KVQ)",
    # SPDX id in `license`, the text in LICENSE. No "License ::" classifier:
    # setuptools >= 77 deprecates those in favour of an SPDX expression (PEP 639).
    license="Apache-2.0",
    license_files=["LICENSE"],
    classifiers=[
        "Programming Language :: Python :: 3",
        "Programming Language :: C++",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
    packages=find_packages(include=["dllm_ops", "dllm_ops.*", "bench", "bench.*"]),
    # The shipped tiny models (weights, tokenizer, training log).
    package_data={"dllm_ops": ["checkpoints/*/*"]},
    py_modules=["_dllm_ops_lm_eval"],
    # `dllm-ops generate ...` = `python -m dllm_ops generate ...` (`make build` writes
    # the same command into the venv for the in-place build).
    entry_points={"console_scripts": ["dllm-ops = dllm_ops.cli:main"]},
    extras_require={"eval": ["lm_eval>=0.4,<0.5"], "ray": ["ray[serve]==2.60.0"],
                    "plot": ["matplotlib==3.11.2"]},
    ext_modules=extensions(),
    cmdclass={"build_ext": BuildExtensionOneLibstdcxx, "build_py": BuildPyWithLmEvalHook},
    python_requires=">=3.10",
)
