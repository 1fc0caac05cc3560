"""One errors module (dllm_ops.errors): every bad-input error of the Python
layer is a ValueError and a DllmOpsError, names its API once at the front of
its message, and each area raises its own class."""
import json

import pytest

from dllm_ops import errors
from dllm_ops.errors import (CalibrationError, CheckpointError, ConfigError, DecodeError,
                             DllmOpsError, LikelihoodError, LmEvalArgError, ModelConfigError,
                             OptionError, PolicyTableError, ServeError, TaskError)

CLASSES = [OptionError, LmEvalArgError, ConfigError, DecodeError, CheckpointError, ModelConfigError,
           PolicyTableError, TaskError, LikelihoodError, CalibrationError, ServeError]


def test_every_error_class_is_listed():
    """A class added to errors.py joins CLASSES (and so the checks below)."""
    defined = {v for v in vars(errors).values()
               if isinstance(v, type) and issubclass(v, DllmOpsError) and v is not DllmOpsError}
    assert defined == set(CLASSES)
    assert set(errors.__all__) == {c.__name__ for c in CLASSES} | {"DllmOpsError"}


@pytest.mark.parametrize("cls", [DllmOpsError, *CLASSES])
def test_prefixed_once(cls):
    e = cls("bad thing")
    assert isinstance(e, ValueError) and isinstance(e, DllmOpsError)
    assert str(e) == f"{cls.api}: bad thing"
    assert str(cls(str(e))) == str(e)        # already prefixed: not doubled
    # another API's prefix is not this one's: the message gets this class's prefix
    assert str(cls("elsewhere: x")) == f"{cls.api}: elsewhere: x"


def test_prefixes_are_todays():
    """The prefixes the messages carried before the errors module (tests and
    users match on them)."""
    assert {c.__name__: c.api for c in CLASSES} == {
        "OptionError": "dllm_ops", "LmEvalArgError": "dllm_ops lm_eval model",
        "ConfigError": "dllm_ops config",
        "DecodeError": "dllm_ops.generate", "CheckpointError": "dllm_ops.load",
        "ModelConfigError": "dllm_ops.load",
        "PolicyTableError": "dllm_ops.generate: kv_quant policy",
        "TaskError": "dllm_ops.tasks", "LikelihoodError": "dllm_ops likelihood",
        "CalibrationError": "dllm_ops.calibrate",
        "ServeError": "dllm_ops serve"}
    assert issubclass(ModelConfigError, CheckpointError)
    assert issubclass(LmEvalArgError, OptionError)


def test_old_import_paths_name_the_same_classes():
    from dllm_ops import models, options
    from dllm_ops.models import config as model_config, loader
    from dllm_ops.quant import policy_table
    assert options.OptionError is OptionError
    assert models.CheckpointError is loader.CheckpointError is CheckpointError
    assert models.ConfigError is model_config.ConfigError is ModelConfigError
    assert policy_table.PolicyTableError is PolicyTableError


# ---- one real bad input per area -------------------------------------------------

def test_checkpoint_folder_without_config(tmp_path):
    from dllm_ops.models import load
    with pytest.raises(CheckpointError, match=r"^dllm_ops\.load: .*config\.json not found$"):
        load(str(tmp_path))
    with pytest.raises(CheckpointError, match=r"^dllm_ops\.load: 'no-such-model' is neither"):
        load("no-such-model")


def test_unknown_architecture():
    from dllm_ops.models import from_hf_config
    with pytest.raises(ModelConfigError, match=r"^dllm_ops\.load: cfg\.json: unknown model_type "
                                               r"'gpt2'"):
        from_hf_config({"model_type": "gpt2"}, "cfg.json")


@pytest.mark.parametrize("text,msg", [("{not json", "not valid JSON"),
                                      ('{"format": "dllm-kvq-policy/1"}', "missing field 'model'"),
                                      ("[1, 2]", "expected a JSON object, got list")])
def test_malformed_policy_table(tmp_path, text, msg):
    from dllm_ops.quant.policy_table import PolicyTable
    path = tmp_path / "table.json"
    path.write_text(text)
    with pytest.raises(PolicyTableError, match=msg) as e:
        PolicyTable.load(str(path))
    assert str(e.value).startswith(f"dllm_ops.generate: kv_quant policy: {path}: ")


def test_text_option_not_key_value():
    from dllm_ops.options import parse_pairs
    with pytest.raises(OptionError) as e:
        parse_pairs(["cache"])
    assert str(e.value) == "dllm_ops: option 'cache' is not KEY=VALUE"


def test_calibration_inputs(tmp_path):
    from dllm_ops.calibrate.trace import Schedule, load_artifact
    with pytest.raises(CalibrationError, match=r"^dllm_ops\.calibrate: gen_length 12 must be a "
                                               r"positive multiple of block_length 8$"):
        Schedule(gen_length=12, block_length=8, steps_per_block=4)
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"format": "other"}))
    with pytest.raises(CalibrationError, match=r"^dllm_ops\.calibrate: .*: not a dllm-trace/1 artifact$"):
        load_artifact(str(path))
