"""The errors dllm_ops raises on bad input, one family under one base.

Every error is a ``ValueError`` (callers that caught ``ValueError`` keep
working) and names the API it came from once, at the front of its message:
the class's ``api``. ``ConfigError("cache.method = ...")`` prints as
``dllm_ops config: cache.method = ...``, ``DecodeError`` as
``dllm_ops.generate: ...``, ``CheckpointError`` as ``dllm_ops.load: ...``.
Sites pass the bare sentence; the prefix lives here, and a message that
already carries it is not prefixed twice.

One class per area (what a caller may want to catch apart):

- :class:`OptionError`: text options (``KEY=VALUE`` pairs); :class:`LmEvalArgError`
  narrows it to lm-eval's model-loading arguments;
- :class:`ConfigError`: a decode configuration (``dllm_ops.config``);
- :class:`DecodeError`: options or inputs ``generate`` cannot decode with;
- :class:`CheckpointError`: a checkpoint folder, its files, its dtype
  (``dllm_ops.load``); :class:`ModelConfigError` narrows it to config.json
  (a missing key, an unknown architecture);
- :class:`PolicyTableError`: a dLLM-KVQ policy table (its file, its fields,
  or a model / cache / bits / group it was not made for);
- :class:`LikelihoodError`: a request the lm-eval likelihood estimate cannot score;
- :class:`CalibrationError`: the calibration tracer's inputs and artifacts;
- :class:`ServeError`: an HTTP request the server refuses or fails (its status,
  the OpenAI ``param`` and ``code``).

This module imports nothing from dllm_ops: every layer may raise these.
"""
from __future__ import annotations


class DllmOpsError(ValueError):
    """Base of every bad-input error of dllm_ops's Python layer."""

    #: the API the message is prefixed with
    api = "dllm_ops"

    def __init__(self, message: str):
        message = str(message)
        if not message.startswith(f"{self.api}: "):
            message = f"{self.api}: {message}"
        super().__init__(message)


class OptionError(DllmOpsError):
    """Options given as text (``--set`` pairs, lm-eval ``model_args``)."""
    api = "dllm_ops"


class LmEvalArgError(OptionError):
    """lm-eval's model-loading ``model_args`` (batch size, dtype, ...)."""
    api = "dllm_ops lm_eval model"


class ConfigError(DllmOpsError):
    """A decode configuration (dllm_ops.config) with a bad field, value or key."""
    api = "dllm_ops config"


class DecodeError(DllmOpsError):
    """Options or inputs ``generate`` cannot decode with."""
    api = "dllm_ops.generate"


class CheckpointError(DllmOpsError):
    """A checkpoint ``dllm_ops.load`` cannot load (or save): no such folder or
    shipped model, missing / corrupt / unexpected files and tensors, a dtype
    the kernels do not run in."""
    api = "dllm_ops.load"


class ModelConfigError(CheckpointError):
    """A checkpoint's config.json lacks a key or names an unknown architecture
    (``dllm_ops.models.ConfigError`` is this class)."""


class PolicyTableError(DllmOpsError):
    """A dLLM-KVQ policy table that is malformed, partial, or made for another
    model, cache mode, bit width or group (read when ``generate`` is given it)."""
    api = "dllm_ops.generate: kv_quant policy"


class TaskError(DllmOpsError):
    """The task suite's names, splits and problem sizes (dllm_ops.tasks)."""
    api = "dllm_ops.tasks"


class LikelihoodError(DllmOpsError):
    """A request the likelihood estimate (dllm_ops.likelihood, lm-eval's
    loglikelihood) cannot score: an empty continuation or context, one longer
    than the model's context, a token outside the vocabulary, bad masks."""
    api = "dllm_ops likelihood"


class CalibrationError(DllmOpsError):
    """The calibration tracer (``python -m dllm_ops.calibrate``): a bad
    schedule, score matrix, answer or trace artifact."""
    api = "dllm_ops.calibrate"


class ServeError(DllmOpsError):
    """A request the server (``python -m dllm_ops serve``) refuses or fails:
    ``status`` is the HTTP status (400 for a bad request), ``param`` the request
    field it concerns (OpenAI's error ``param``), ``code`` a short reason."""
    api = "dllm_ops serve"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None,
                 status: int = 400):
        super().__init__(message)
        self.param, self.code, self.status = param, code, status


__all__ = ["DllmOpsError", "OptionError", "LmEvalArgError", "ConfigError", "DecodeError",
           "CheckpointError", "ModelConfigError", "PolicyTableError", "TaskError",
           "LikelihoodError", "CalibrationError", "ServeError"]
