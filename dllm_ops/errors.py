"""The errors dllm_ops raises on bad input, one family under one base.

Every error is a ``ValueError`` (callers that caught ``ValueError`` keep
working) and names the API it came from once, at the front of its message:
``DllmOpsError("cache.method", ...)`` prints as ``dllm_ops config: ...`` and
``DecodeOptionError`` as ``dllm_ops.generate: ...``. Sites pass the bare
sentence; the prefix lives here.
"""
from __future__ import annotations


class DllmOpsError(ValueError):
    """Base of every bad-input error of dllm_ops's Python layer."""

    #: the API the message is prefixed with
    api = "dllm_ops"

    def __init__(self, message: str):
        prefix = f"{self.api}: "
        super().__init__(message if message.startswith(prefix) else prefix + message)


class ConfigError(DllmOpsError):
    """A decode configuration (dllm_ops.config) with a bad field, value or key."""
    api = "dllm_ops config"


class DecodeError(DllmOpsError):
    """Options or inputs ``generate`` cannot decode with."""
    api = "dllm_ops.generate"
