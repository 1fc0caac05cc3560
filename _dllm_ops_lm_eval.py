"""Makes the plain `lm_eval` command know the model ``dllm_ops``.

lm-eval finds only the models its own package lists (0.4.13, the version
requirements.txt pins, reads no plugin entry points for models: its registry
is filled by imports), so this module, imported at interpreter start by a
one-line .pth file (`make build` writes it into the venv; `pip install .`
installs it), waits for ``lm_eval.models`` to be
imported and then registers ``dllm_ops`` as a lazy entry pointing at
dllm_ops.lm_eval_model:DllmOpsLM. It imports nothing itself: a Python that
never imports lm_eval pays one finder lookup per import and nothing else.
"""
import importlib.abc
import importlib.machinery
import sys

MODEL_NAME = "dllm_ops"
MODEL_TARGET = "dllm_ops.lm_eval_model:DllmOpsLM"


def register(registry_module) -> None:
    registry = registry_module.model_registry
    if MODEL_NAME not in registry:
        registry.register(MODEL_NAME, target=MODEL_TARGET)


class _AfterLmEvalModels(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != "lm_eval.models":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_register(module):
            exec_module(module)
            register(sys.modules["lm_eval.api.registry"])

        spec.loader.exec_module = exec_then_register
        return spec


if not any(isinstance(f, _AfterLmEvalModels) for f in sys.meta_path):
    sys.meta_path.insert(0, _AfterLmEvalModels())
