"""Load / save checkpoints in the original Hugging Face layouts.

A folder holds config.json, safetensors weights (one file, or shards listed
in model.safetensors.index.json) under the original parameter names, and a
tokenizer that transformers.AutoTokenizer loads offline. No remote code, no
network: every problem is reported with the file and tensor it concerns.
"""
from __future__ import annotations

import json
import os
import re

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


def hub_cache_dir() -> tuple[str, str]:
    """``(folder, where it came from)``: the cache huggingface_hub keeps
    repositories in, read from the environment at the call (huggingface_hub
    reads it once, at import): ``HF_HUB_CACHE``, else the legacy
    ``HUGGINGFACE_HUB_CACHE``, else ``$HF_HOME/hub``, else
    ``$XDG_CACHE_HOME/huggingface/hub``, else ``~/.cache/huggingface/hub``."""
    def expand(p):
        return os.path.expandvars(os.path.expanduser(p))
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(var):
            return expand(os.environ[var]), f"from {var}"
    if os.environ.get("HF_HOME"):
        return os.path.join(expand(os.environ["HF_HOME"]), "hub"), "from HF_HOME"
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return (os.path.join(expand(base), "huggingface", "hub"),
            "the default; HF_HUB_CACHE or HF_HOME name another")


def split_revision(name: str) -> tuple[str, str | None]:
    """``"org/name@rev"`` -> ``("org/name", "rev")``; a name without ``@`` has no
    revision. (A Hub id cannot contain ``@``, so the split is unambiguous.)"""
    repo, at, rev = name.partition("@")
    return (repo, rev) if at else (name, None)


def _fetch_hint(repo_id: str, revision: str | None) -> str:
    rev = f" --revision {revision}" if revision else ""
    return (f"nothing is downloaded at load: fetch it with `hf download {repo_id}{rev}` "
            f"(or `huggingface-cli download {repo_id}{rev}`) and load it again")


def _cached_revisions(repo_dir: str) -> str:
    """What the cache holds of one repository, for an error: its refs and snapshots."""
    def listing(sub):
        d = os.path.join(repo_dir, sub)
        out = []
        for root, _, files in os.walk(d):
            out += [os.path.relpath(os.path.join(root, f), d) for f in files]
        return sorted(out)
    refs = listing("refs")
    snaps = sorted(os.listdir(os.path.join(repo_dir, "snapshots"))) \
        if os.path.isdir(os.path.join(repo_dir, "snapshots")) else []
    return (f"refs: {', '.join(refs) or 'none'}; snapshots: "
            f"{', '.join(h[:12] for h in snaps) or 'none'}")


def _hub_snapshot(repo_id: str, revision: str | None, not_local: str) -> str:
    """The cached snapshot folder of Hub repository ``repo_id`` at ``revision``
    (a branch or tag recorded under ``refs/``, a commit hash or a unique prefix
    of one; default ``main``), from the local cache only."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError
    from huggingface_hub.file_download import repo_folder_name
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError:
        raise CheckpointError(f"{not_local}, nor a Hugging Face Hub id (org/name)") from None
    cache, source = hub_cache_dir()
    repo_dir = os.path.join(cache, repo_folder_name(repo_id=repo_id, repo_type="model"))
    shown = f"{repo_id}@{revision}" if revision else repo_id
    if not os.path.isdir(repo_dir):
        raise CheckpointError(
            f"{not_local}; as a Hugging Face Hub id it is not in the local cache (searched "
            f"{repo_dir} in the cache folder {cache}, {source}); {_fetch_hint(repo_id, revision)}")
    rev = revision or "main"
    snapshots = os.path.join(repo_dir, "snapshots")
    if (re.fullmatch(r"[0-9a-f]{7,39}", rev) and not os.path.exists(os.path.join(repo_dir, "refs", rev))
            and os.path.isdir(snapshots)):
        full = [h for h in os.listdir(snapshots) if h.startswith(rev)]
        if len(full) == 1:          # a short commit hash (git's abbreviation)
            rev = full[0]
        elif len(full) > 1:
            raise CheckpointError(f"{shown}: the commit prefix {rev!r} names {len(full)} cached "
                                  f"snapshots ({', '.join(sorted(full))}); give more of the hash")
    try:
        folder = snapshot_download(repo_id, revision=rev, cache_dir=cache, local_files_only=True)
    except LocalEntryNotFoundError:
        raise CheckpointError(
            f"{shown}: the local Hugging Face cache ({repo_dir}) holds this repository but not "
            f"revision {rev!r} ({_cached_revisions(repo_dir)}); "
            f"{_fetch_hint(repo_id, revision)}") from None
    except (OSError, ValueError) as e:   # an incomplete snapshot, a malformed revision
        raise CheckpointError(f"{shown}: the local Hugging Face cache ({repo_dir}) cannot give "
                              f"this revision: {' '.join(str(e).split())}; "
                              f"{_fetch_hint(repo_id, revision)}") from None
    if not os.path.exists(os.path.join(folder, "config.json")):
        raise CheckpointError(
            f"{shown}: the cached snapshot {folder} has no config.json (only part of the "
            f"repository was downloaded); {_fetch_hint(repo_id, revision)}")
    return folder


def resolve_checkpoint(name_or_path: str, revision: str | None = None) -> str:
    """The checkpoint folder ``dllm_ops.load`` reads, resolved in this order:

    1. an existing folder;
    2. a shipped model's name (tiny-llada, tiny-dream);
    3. a Hugging Face Hub id (``GSAI-ML/LLaDA-8B-Instruct``), looked up in the
       local Hugging Face cache only (``HF_HUB_CACHE`` / ``HF_HOME``; never a
       download), at ``revision`` or at the id's ``@rev`` suffix
       (``org/name@v1.0``, ``org/name@<commit>``): a branch or tag the cache
       recorded, or a commit hash (full, or a unique prefix); default ``main``.

    Anything else is a :class:`CheckpointError` that says what was searched.
    """
    path = os.fspath(name_or_path)
    if not isinstance(path, str):
        raise CheckpointError(f"{path!r}: a checkpoint is a folder, a shipped model's name or "
                              "a Hugging Face Hub id, not bytes")
    if revision is not None and not (isinstance(revision, str) and revision):
        raise CheckpointError(f"revision {revision!r}: must be a non-empty string (a branch, "
                              "tag or commit hash)")
    if os.path.isdir(path):
        if revision is not None:
            raise CheckpointError(f"{path}: a revision ({revision!r}) selects a cached Hub "
                                  "snapshot; this is a local folder, which has none")
        return path
    if os.path.exists(path):
        raise CheckpointError(f"{path} is a file; a checkpoint is the folder that holds "
                              "config.json, the safetensors and the tokenizer")
    if path in SHIPPED_MODELS:
        if revision is not None:
            raise CheckpointError(f"{path} is a shipped model; it has no revisions "
                                  f"(revision={revision!r})")
        return os.path.join(CHECKPOINTS_DIR, path)
    repo_id, suffix = split_revision(path)
    if suffix is not None:
        if not suffix:
            raise CheckpointError(f"{path!r}: nothing after '@' (org/name@revision)")
        if revision is not None and revision != suffix:
            raise CheckpointError(f"{path!r} names revision {suffix!r} but revision={revision!r} "
                                  "was given too")
        revision = suffix
    not_local = (f"{repo_id!r} is neither a checkpoint folder nor a shipped model "
                 f"({', '.join(SHIPPED_MODELS)})")
    return _hub_snapshot(repo_id, revision, not_local)


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
    single = os.path.join(path, "model.safetensors")
    if os.path.exists(index) and os.path.exists(single):
        # Two sets of weights (what an older save left when it wrote one over
        # the other): reading either could silently give the stale one.
        raise CheckpointError(f"{path}: holds both model.safetensors and model.safetensors.index.json "
                              "(with its shards); which weights are current is ambiguous: delete the "
                              "stale set, or save the model again (save removes the old files)")
    if os.path.exists(index):
        try:
            with open(index) as f:
                wm = json.load(f).get("weight_map")
        except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as e:
            raise CheckpointError(f"{index}: not a JSON index ({e})") from None
        if not isinstance(wm, dict):
            raise CheckpointError(f"{index}: no 'weight_map'")
        return {k: os.path.join(path, v) for k, v in wm.items()}
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


def read_model_config(path: str) -> ModelConfig:
    """The ModelConfig of a resolved checkpoint folder's config.json (no weights)."""
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
    return from_hf_config(raw, cfg_path)


def load(path: str, dtype: torch.dtype = torch.bfloat16, device="cpu",
         tokenizer: bool = True, revision: str | None = None) -> DiffusionLM:
    """Load a LLaDA or Dream checkpoint folder, a shipped model by name
    (tiny-llada, tiny-dream) or a Hugging Face Hub id from the local cache
    (``GSAI-ML/LLaDA-8B-Instruct``, at ``revision`` or ``org/name@rev``; see
    :func:`resolve_checkpoint`); the tokenizer is ``model.tokenizer``.

    ``dtype`` is float32, float16 or bfloat16, the dtypes the kernels run in.
    """
    if not isinstance(dtype, torch.dtype) or dtype not in MODEL_DTYPES:
        raise CheckpointError(f"dtype {dtype} is not supported; the kernels run in "
                              f"{', '.join(str(d).replace('torch.', '') for d in MODEL_DTYPES)}")
    path = resolve_checkpoint(path, revision)
    config = read_model_config(path)
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
    """Write ``model`` in its original layout: ``model.safetensors``, or shards
    ``model-0000i-of-0000n.safetensors`` of at most ``max_shard_bytes`` each (a
    tensor larger than that gets a shard of its own) listed in
    ``model.safetensors.index.json``. The weight files of an earlier save into
    the folder (single file, index, shards of any count) are removed first, so
    the folder never holds two sets of weights
    (``huggingface_hub.save_torch_state_dict`` does the split and the cleaning)."""
    from huggingface_hub import save_torch_state_dict
    if max_shard_bytes is not None and not (isinstance(max_shard_bytes, int)
                                            and not isinstance(max_shard_bytes, bool)
                                            and max_shard_bytes > 0):
        raise CheckpointError(f"max_shard_bytes {max_shard_bytes!r}: must be a positive integer "
                              "(or None for one file)")
    os.makedirs(path, exist_ok=True)
    c: ModelConfig = model.config
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(to_hf_config(c), f, indent=2)
    names = param_names(c)
    tensors = {names[k]: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    total = sum(v.numel() * v.element_size() for v in tensors.values())
    save_torch_state_dict(tensors, path, max_shard_size=max_shard_bytes or max(total, 1),
                          filename_pattern="model{suffix}.safetensors")
    tok = tokenizer if tokenizer is not None else getattr(model, "tokenizer", None)
    if tok is not None:
        tok.save_pretrained(path)
