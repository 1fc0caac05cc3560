"""``python -m dllm_ops generate ...`` (dllm_ops/cli.py)."""
import sys

from .cli import main

sys.exit(main())
