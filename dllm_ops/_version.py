"""The package's version: ``dllm_ops.__version__`` and ``python -m dllm_ops --version``.
setup.py reads it from this file (without importing the package, which needs
torch and the built extension), so the two never disagree."""
__version__ = "0.1.0"
