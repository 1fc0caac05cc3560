"""LLaDA and Dream models (own nn.Module implementations) and checkpoint I/O."""
from .config import ConfigError, ModelConfig, from_hf_config, param_names, to_hf_config
from .loader import CheckpointError, load, load_tokenizer, save
from .transformer import DiffusionLM

__all__ = ["ModelConfig", "DiffusionLM", "load", "save", "load_tokenizer", "from_hf_config",
           "to_hf_config", "param_names", "ConfigError", "CheckpointError"]
