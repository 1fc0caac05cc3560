"""Tiny random-weight LLaDA / Dream checkpoints in the real file layouts."""
from __future__ import annotations

import torch

from dllm_ops.models import DiffusionLM, ModelConfig, save
from dllm_ops.tokenizer import word_level_tokenizer

WORDS = [f"w{i}" for i in range(59)]  # + 5 specials = 64 ids
CHAT = ("{% for m in messages %}<bos> {{ m['role'] }} {{ m['content'] }} <eos> {% endfor %}"
        "{% if add_generation_prompt %}<bos> assistant {% endif %}")


def tiny_config(arch: str, n_layers: int = 2, max_seq_len: int = 256) -> ModelConfig:
    tok = word_level_tokenizer(WORDS)
    common = dict(vocab_size=len(tok), hidden_size=64, n_layers=n_layers, head_dim=16,
                  intermediate_size=96, max_seq_len=max_seq_len, mask_id=tok.mask_token_id,
                  eos_id=tok.eos_token_id, pad_id=tok.pad_token_id, bos_id=tok.bos_token_id)
    if arch == "llada":
        return ModelConfig(arch="llada", n_heads=4, n_kv_heads=4, rms_eps=1e-5, rope_theta=10000.0,
                           qkv_bias=False, **common)
    return ModelConfig(arch="dream", n_heads=4, n_kv_heads=2, rms_eps=1e-6, rope_theta=10000.0,
                       qkv_bias=True, **common)


def random_model(config: ModelConfig, seed: int = 0) -> DiffusionLM:
    torch.manual_seed(seed)
    model = DiffusionLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))  # non-trivial, so loading is checked
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
            elif name == "embed.weight":
                p.normal_()
            else:
                p.normal_(std=1.5 / p.shape[1] ** 0.5)  # sharp enough for decisive argmaxes
    return model.eval()


def make_checkpoint(path: str, arch: str, seed: int = 0, shard_bytes: int | None = 40_000,
                    **kw) -> DiffusionLM:
    model = random_model(tiny_config(arch, **kw), seed)
    save(model, path, max_shard_bytes=shard_bytes, tokenizer=word_level_tokenizer(WORDS, CHAT))
    return model
