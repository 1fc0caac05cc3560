"""Load / save checkpoints in the original Hugging Face layouts.

A folder holds config.json, safetensors weights (one file, or shards listed
in model.safetensors.index.json) under the original parameter names, and a
tokenizer that transformers.AutoTokenizer loads offline. No remote code, no
network: every problem is reported with the file and tensor it concerns.
"""
from __future__ import annotations

import json
import os

import torch

from ..errors import CheckpointError
from .config import ModelConfig, from_hf_config, param_names, to_hf_config
from .transformer import DiffusionLM


# The shipped tiny models (dllm_ops/checkpoints/<name>), loadable by name.
CHECKPOINTS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                               "checkpoints")
SHIPPED_MODELS = ("tiny-llada", "tiny-dream")
# The dtypes the kernels (and so the model) run in.
MODEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def resolve_checkpoint(name_or_path: str) -> str:
    """A checkpoint folder, or a shipped model's name (tiny-llada, tiny-dream) -> its folder."""
    path = os.fspath(name_or_path)
    if os.path.isdir(path):
        return path
    if path in SHIPPED_MODELS:
        return os.path.join(CHECKPOINTS_DIR, path)
    raise CheckpointError(f"{path!r} is neither a checkpoint folder nor a shipped "
                          f"model ({', '.join(SHIPPED_MODELS)})")


def _safe_open(file: str):
    """safetensors.safe_open with the file named in the error (a bare
    SafetensorError says neither which file nor that it is corrupt)."""
    from safetensors import SafetensorError, safe_open
    try:
        return safe_open(file, "pt", device="cpu")
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{file}: not a readable safetensors file ({e})") from e


def _read_tensor(handle, file: str, name: str) -> torch.Tensor:
    from safetensors import SafetensorError
    try:
        return handle.get_tensor(name)
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{file}: tensor {name} could not be read ({e})") from e


def _weight_files(path: str) -> dict[str, str]:
    """Original tensor name -> the safetensors file holding it."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        try:
            with open(index) as f:
                wm = json.load(f).get("weight_map")
        except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as e:
            raise CheckpointError(f"{index}: not a JSON index ({e})") from None
        if not isinstance(wm, dict):
            raise CheckpointError(f"{index}: no 'weight_map'")
        return {k: os.path.join(path, v) for k, v in wm.items()}
    single = os.path.join(path, "model.safetensors")
    if not os.path.exists(single):
        raise CheckpointError(f"{path}: neither model.safetensors nor "
                              "model.safetensors.index.json found")
    with _safe_open(single) as f:
        return {k: single for k in f.keys()}


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    if not (os.path.exists(os.path.join(path, "tokenizer.json"))
            or os.path.exists(os.path.join(path, "tokenizer_config.json"))):
        raise CheckpointError(f"{path}: no tokenizer (tokenizer.json / "
                              "tokenizer_config.json) in the folder")
    from transformers import PretrainedConfig
    try:
        # An empty config: AutoTokenizer would otherwise read config.json as a
        # transformers model config, which LLaDA's and Dream's are not (and warn
        # "You are using a model of type `llada` to instantiate a model of type ``").
        return AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=False,
                                             config=PretrainedConfig())
    except Exception as e:  # transformers raises many types; keep the cause
        raise CheckpointError(f"{path}: the tokenizer failed to load: {e}") from e


def load(path: str, dtype: torch.dtype = torch.bfloat16, device="cpu",
         tokenizer: bool = True) -> DiffusionLM:
    """Load a LLaDA or Dream checkpoint folder (or a shipped model by name:
    tiny-llada, tiny-dream); the tokenizer is ``model.tokenizer``.

    ``dtype`` is float32, float16 or bfloat16, the dtypes the kernels run in.
    """
    if not isinstance(dtype, torch.dtype) or dtype not in MODEL_DTYPES:
        raise CheckpointError(f"dtype {dtype} is not supported; the kernels run in "
                              f"{', '.join(str(d).replace('torch.', '') for d in MODEL_DTYPES)}")
    path = resolve_checkpoint(path)
    cfg_path = os.path.join(path, "config.json")
    if not os.path.exists(cfg_path):
        raise CheckpointError(f"{cfg_path} not found")
    try:
        with open(cfg_path) as f:
            raw = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{cfg_path}: not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{cfg_path}: not a JSON object")
    config = from_hf_config(raw, cfg_path)
    names = param_names(config)
    files = _weight_files(path)
    missing = [n for n in names.values() if n not in files]
    if missing:
        raise CheckpointError(f"{path}: missing tensors {missing[:5]}"
                              f"{' ...' if len(missing) > 5 else ''}")
    extra = sorted(set(files) - set(names.values()))
    if extra:
        raise CheckpointError(f"{files[extra[0]]}: unexpected tensors {extra[:5]}"
                              f"{' ...' if len(extra) > 5 else ''}")
    with torch.device("meta"):
        model = DiffusionLM(config)
    expected = {k: v.shape for k, v in model.state_dict().items()}
    state = {}
    by_file: dict[str, list[str]] = {}
    for ours, theirs in names.items():
        by_file.setdefault(files[theirs], []).append(ours)
    for file, ours_list in by_file.items():
        with _safe_open(file) as f:
            for ours in ours_list:
                t = _read_tensor(f, file, names[ours])
                if tuple(t.shape) != tuple(expected[ours]):
                    raise CheckpointError(
                        f"{file}: tensor {names[ours]} has shape {tuple(t.shape)}, "
                        f"expected {tuple(expected[ours])} from config.json")
                state[ours] = t.to(dtype=dtype, device=device)
    model.load_state_dict(state, assign=True)
    model.eval()
    model.tokenizer = load_tokenizer(path) if tokenizer else None
    return model


def save(model: DiffusionLM, path: str, max_shard_bytes: int | None = None, tokenizer=None) -> None:
    """Write ``model`` in its original layout (sharded when ``max_shard_bytes`` is set)."""
    from safetensors.torch import save_file
    os.makedirs(path, exist_ok=True)
    c: ModelConfig = model.config
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(to_hf_config(c), f, indent=2)
    names = param_names(c)
    tensors = {names[k]: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    if max_shard_bytes is None:
        save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    else:
        shards, cur, size = [], {}, 0
        for k, v in tensors.items():
            nb = v.numel() * v.element_size()
            if cur and size + nb > max_shard_bytes:
                shards.append(cur)
                cur, size = {}, 0
            cur[k] = v
            size += nb
        shards.append(cur)
        weight_map = {}
        for i, shard in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, os.path.join(path, fname), metadata={"format": "pt"})
            weight_map.update({k: fname for k in shard})
        with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": sum(v.numel() * v.element_size()
                                                      for v in tensors.values())},
                       "weight_map": weight_map}, f, indent=2)
    tok = tokenizer if tokenizer is not None else getattr(model, "tokenizer", None)
    if tok is not None:
        tok.save_pretrained(path)
