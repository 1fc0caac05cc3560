"""Architecture configs of the supported dLLMs, read from a HF config.json.

LLaDA (LLaDA-8B-Instruct/Base, LLaDA-1.5) and Dream (Dream-v0, the Qwen2
layout) differ only in names, biases, GQA and Dream's one-position logit
shift, so one config type and one module serve both.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass

from ..errors import ModelConfigError


@dataclass(frozen=True)
class ModelConfig:
    arch: str                 # "llada" | "dream"
    vocab_size: int
    hidden_size: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_eps: float
    rope_theta: float
    max_seq_len: int
    qkv_bias: bool
    mask_id: int
    eos_id: int
    pad_id: int
    bos_id: int | None = None
    eot_id: int | None = None   # LLaDA's <|eot_id|>, if the vocabulary has it

    @property
    def logit_shift(self) -> bool:
        """Dream predicts token j from the hidden state at j-1."""
        return self.arch == "dream"

    def to_dict(self) -> dict:
        return asdict(self)


# A checkpoint's config.json error (a CheckpointError, prefixed "dllm_ops.load: "); not
# dllm_ops.errors.ConfigError, which is the decode configuration's.
ConfigError = ModelConfigError


def _need(cfg: dict, key: str, path: str):
    if key not in cfg:
        raise ConfigError(f"{path}: config.json lacks '{key}'")
    return cfg[key]


def _check_rope_scaling(cfg: dict, path: str) -> None:
    """Refuse a RoPE scaling the model would not apply. The module runs plain
    RoPE (``rope_theta`` only), as LLaDA's and Dream's configs ask: LLaDA's has
    no ``rope_scaling``, Dream's has ``"rope_scaling": null``. A scaled config
    (linear, dynamic, yarn, llama3, ...) loaded as if unscaled would compute
    other positions than it was trained with, silently. No scaling is null,
    ``{}`` or transformers' ``{"rope_type": "default"}``; transformers 5 writes
    the same under ``rope_parameters`` (with ``rope_theta`` in it)."""
    for key, plain in (("rope_scaling", {"rope_type", "type"}),
                       ("rope_parameters", {"rope_type", "type", "rope_theta"})):
        rs = cfg.get(key)
        if rs is None or rs == {}:
            continue
        if not isinstance(rs, dict):
            raise ConfigError(f"{path}: {key} {rs!r} is neither null nor an object")
        kind = rs.get("rope_type", rs.get("type", "default"))
        if kind == "default" and set(rs) <= plain:
            continue
        raise ConfigError(f"{path}: {key} {json.dumps(rs, sort_keys=True)} (type {kind!r}) is not "
                          "supported: dllm_ops runs unscaled RoPE (rope_theta only), as LLaDA and "
                          "Dream use it; loading this config would silently drop the scaling")


def _rope_theta(cfg: dict, default: float) -> float:
    """``rope_theta``, or transformers 5's ``rope_parameters.rope_theta``."""
    if cfg.get("rope_theta") is not None:
        return cfg["rope_theta"]
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and params.get("rope_theta") is not None:
        return params["rope_theta"]
    return default


def from_hf_config(cfg: dict, path: str = "config.json") -> ModelConfig:
    mt = str(cfg.get("model_type", "")).lower()
    if mt in ("llada", "dream"):
        _check_rope_scaling(cfg, path)
    if mt == "llada":
        d, nh = _need(cfg, "d_model", path), _need(cfg, "n_heads", path)
        return ModelConfig(
            arch="llada",
            vocab_size=cfg.get("embedding_size") or _need(cfg, "vocab_size", path),
            hidden_size=d, n_layers=_need(cfg, "n_layers", path), n_heads=nh,
            n_kv_heads=cfg.get("n_kv_heads") or nh, head_dim=d // nh,
            intermediate_size=_need(cfg, "mlp_hidden_size", path) // (
                2 if cfg.get("mlp_hidden_size_is_fused", False) else 1),
            rms_eps=cfg.get("rms_norm_eps", 1e-5), rope_theta=_rope_theta(cfg, 10000.0),
            max_seq_len=cfg.get("max_sequence_length", 4096),
            qkv_bias=bool(cfg.get("include_qkv_bias", cfg.get("include_bias", False))),
            mask_id=cfg.get("mask_token_id", 126336), eos_id=cfg.get("eos_token_id", 126081),
            pad_id=cfg.get("pad_token_id", 126081), bos_id=cfg.get("bos_token_id"),
            eot_id=cfg.get("eot_token_id"),
        )
    if mt == "dream":
        h, nh = _need(cfg, "hidden_size", path), _need(cfg, "num_attention_heads", path)
        return ModelConfig(
            arch="dream", vocab_size=_need(cfg, "vocab_size", path), hidden_size=h,
            n_layers=_need(cfg, "num_hidden_layers", path), n_heads=nh,
            n_kv_heads=cfg.get("num_key_value_heads") or nh, head_dim=cfg.get("head_dim") or h // nh,
            intermediate_size=_need(cfg, "intermediate_size", path),
            rms_eps=cfg.get("rms_norm_eps", 1e-6), rope_theta=_rope_theta(cfg, 1e6),
            max_seq_len=cfg.get("max_position_embeddings", 32768), qkv_bias=True,
            mask_id=cfg.get("mask_token_id", 151666), eos_id=cfg.get("eos_token_id", 151643),
            pad_id=cfg.get("pad_token_id", 151643), bos_id=cfg.get("bos_token_id"),
        )
    raise ConfigError(f"{path}: unknown model_type {cfg.get('model_type')!r} "
                      "(supported: 'llada', 'Dream')")


def to_hf_config(c: ModelConfig) -> dict:
    """The config.json a checkpoint of `c` is saved with (inverse of from_hf_config)."""
    if c.arch == "llada":
        return {
            "model_type": "llada", "architectures": ["LLaDAModelLM"], "d_model": c.hidden_size,
            "n_heads": c.n_heads, "n_kv_heads": c.n_kv_heads, "n_layers": c.n_layers,
            "mlp_hidden_size": c.intermediate_size, "vocab_size": c.vocab_size,
            "embedding_size": c.vocab_size, "max_sequence_length": c.max_seq_len,
            "rope": True, "rope_theta": c.rope_theta, "rms_norm_eps": c.rms_eps,
            "block_type": "llama", "layer_norm_type": "rms", "activation_type": "silu",
            "include_bias": False, "include_qkv_bias": c.qkv_bias, "weight_tying": False,
            "mask_token_id": c.mask_id, "eos_token_id": c.eos_id, "pad_token_id": c.pad_id,
            "bos_token_id": c.bos_id, "eot_token_id": c.eot_id,
        }
    return {
        "model_type": "Dream", "architectures": ["DreamModel"], "hidden_size": c.hidden_size,
        "num_hidden_layers": c.n_layers, "num_attention_heads": c.n_heads,
        "num_key_value_heads": c.n_kv_heads, "intermediate_size": c.intermediate_size,
        "vocab_size": c.vocab_size, "rms_norm_eps": c.rms_eps, "rope_theta": c.rope_theta,
        "max_position_embeddings": c.max_seq_len, "hidden_act": "silu", "tie_word_embeddings": False,
        "mask_token_id": c.mask_id, "eos_token_id": c.eos_id, "pad_token_id": c.pad_id,
        "bos_token_id": c.bos_id,
    }


def param_names(c: ModelConfig) -> dict[str, str]:
    """Our canonical parameter name -> the checkpoint's original name."""
    out = {}
    if c.arch == "llada":
        t = "model.transformer"
        out.update({"embed.weight": f"{t}.wte.weight", "norm.weight": f"{t}.ln_f.weight", "lm_head.weight": f"{t}.ff_out.weight"})
        for i in range(c.n_layers):
            b = f"{t}.blocks.{i}"
            out.update({
                f"layers.{i}.attn_norm.weight": f"{b}.attn_norm.weight", f"layers.{i}.q.weight": f"{b}.q_proj.weight",
                f"layers.{i}.k.weight": f"{b}.k_proj.weight", f"layers.{i}.v.weight": f"{b}.v_proj.weight",
                f"layers.{i}.o.weight": f"{b}.attn_out.weight", f"layers.{i}.ffn_norm.weight": f"{b}.ff_norm.weight",
                f"layers.{i}.gate.weight": f"{b}.ff_proj.weight", f"layers.{i}.up.weight": f"{b}.up_proj.weight",
                f"layers.{i}.down.weight": f"{b}.ff_out.weight"})
            if c.qkv_bias:
                out.update({f"layers.{i}.{p}.bias": f"{b}.{p}_proj.bias" for p in "qkv"})
        return out
    out.update({"embed.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight", "lm_head.weight": "lm_head.weight"})
    for i in range(c.n_layers):
        b = f"model.layers.{i}"
        out.update({
            f"layers.{i}.attn_norm.weight": f"{b}.input_layernorm.weight",
            f"layers.{i}.q.weight": f"{b}.self_attn.q_proj.weight", f"layers.{i}.k.weight": f"{b}.self_attn.k_proj.weight",
            f"layers.{i}.v.weight": f"{b}.self_attn.v_proj.weight", f"layers.{i}.o.weight": f"{b}.self_attn.o_proj.weight",
            f"layers.{i}.ffn_norm.weight": f"{b}.post_attention_layernorm.weight",
            f"layers.{i}.gate.weight": f"{b}.mlp.gate_proj.weight", f"layers.{i}.up.weight": f"{b}.mlp.up_proj.weight",
            f"layers.{i}.down.weight": f"{b}.mlp.down_proj.weight"})
        if c.qkv_bias:
            out.update({f"layers.{i}.{p}.bias": f"{b}.self_attn.{p}_proj.bias" for p in "qkv"})
    return out
