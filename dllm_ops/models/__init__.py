"""LLaDA and Dream models (own nn.Module implementations) and checkpoint I/O."""
from .config import ConfigError, ModelConfig, from_hf_config, param_names, to_hf_config
from .loader import (CHECKPOINTS_DIR, SHIPPED_MODELS, CheckpointError, load, load_tokenizer,
                     resolve_checkpoint, save)
from .transformer import DiffusionLM

__all__ = ["ModelConfig", "DiffusionLM", "load", "save", "load_tokenizer", "from_hf_config",
           "to_hf_config", "param_names", "ConfigError", "CheckpointError", "resolve_checkpoint",
           "SHIPPED_MODELS", "CHECKPOINTS_DIR"]
