"""Cache policies: rules for which tokens each model call recomputes."""
from .base import Policy
from .fastdllm import DualCache, PrefixCache, Vanilla
from .diagnostic import StaleCache

POLICIES = {"none": Vanilla, "prefix": PrefixCache, "dual": DualCache,
            "stale": StaleCache}  # diagnostic: never refreshed, must lose accuracy


def make_policy(cache: str) -> Policy:
    try:
        return POLICIES[cache]()
    except KeyError:
        raise ValueError(f"dllm_ops.generate: unknown cache {cache!r}; "
                         f"choose from {sorted(POLICIES)}") from None


__all__ = ["Policy", "Vanilla", "PrefixCache", "DualCache", "StaleCache", "POLICIES", "make_policy"]
