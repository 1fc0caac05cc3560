"""Cache policies: rules for which tokens each model call recomputes."""
from .base import Policy
from .fastdllm import DualCache, PrefixCache, Vanilla

POLICIES = {"none": Vanilla, "prefix": PrefixCache, "dual": DualCache}


def make_policy(cache: str) -> Policy:
    try:
        return POLICIES[cache]()
    except KeyError:
        raise ValueError(f"dllm_ops.generate: unknown cache {cache!r}; "
                         f"choose from {sorted(POLICIES)}") from None


__all__ = ["Policy", "Vanilla", "PrefixCache", "DualCache", "POLICIES", "make_policy"]
