"""``python -m dllm_ops generate ...`` (dllm_ops/cli.py)."""
import sys

from .cli import main

if __name__ == "__main__":   # not when multiprocessing's spawn imports it in the server's engine process
    sys.exit(main())
