"""Benchmark cases, one module per op family. Importing registers them."""
from .registry import CASES, Case, register  # noqa: F401
from . import select  # noqa: F401
from . import rollout  # noqa: F401
from . import sparse_kv  # noqa: F401
from . import quant  # noqa: F401
from . import layer  # noqa: F401
