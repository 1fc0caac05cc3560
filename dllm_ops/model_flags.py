"""The entry points' model flags: ``--model``, ``--dtype``, ``--device``,
``--threads`` to a loaded model (the CLI, the server's engine and each of
its Ray replicas load through :func:`load_model`; the server's HTTP process,
which holds no weights, through :func:`load_front`)."""
from __future__ import annotations

#: --dtype's names (auto: bf16 on CUDA, fp32 on the CPU)
DTYPES = {"auto": None, "fp32": "float32", "float32": "float32", "bf16": "bfloat16",
          "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16"}


def load_model(args):
    """``(model, device, dtype name)`` for ``args.model``, ``.dtype``, ``.device``, ``.threads``."""
    import torch

    import dllm_ops

    if args.threads:
        torch.set_num_threads(args.threads)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype_name = DTYPES[args.dtype] or ("bfloat16" if device.startswith("cuda") else "float32")
    return dllm_ops.load(args.model, dtype=getattr(torch, dtype_name), device=device), device, dtype_name


def load_front(args):
    """``(tokenizer, ModelConfig)`` of ``args.model`` without its weights (the
    server's HTTP process: it tokenizes and detokenizes, the engine decodes)."""
    from .models.loader import load_tokenizer, read_model_config, resolve_checkpoint
    path = resolve_checkpoint(args.model)
    return load_tokenizer(path), read_model_config(path)
