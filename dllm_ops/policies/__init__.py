"""Cache policies: rules for which tokens each model call recomputes."""
from .base import Policy
from .fastdllm import DualCache, PrefixCache, Vanilla
from .diagnostic import StaleCache
from .d2cache import D2Cache

POLICIES = {"none": Vanilla, "prefix": PrefixCache, "dual": DualCache,
            "stale": StaleCache,  # diagnostic: never refreshed, must lose accuracy
            "d2cache": D2Cache}


def make_policy(cache: str, d2cache: dict | None = None) -> Policy:
    """The policy for ``cache``; ``d2cache`` holds D2Cache's keyword options
    (rollout_p, current_k, sigma) and is an error with any other cache."""
    if cache not in POLICIES:
        raise ValueError(f"dllm_ops.generate: unknown cache {cache!r}; "
                         f"choose from {sorted(POLICIES)}")
    if d2cache is None:
        return POLICIES[cache]()
    if cache != "d2cache":
        raise ValueError(f"dllm_ops.generate: d2cache options given with cache={cache!r}; "
                         f"they apply only to cache='d2cache'")
    if not isinstance(d2cache, dict):
        raise ValueError(f"dllm_ops.generate: d2cache must be a dict of options, got {type(d2cache).__name__}")
    unknown = sorted(set(d2cache) - {"rollout_p", "current_k", "sigma"})
    if unknown:
        raise ValueError(f"dllm_ops.generate: unknown d2cache option(s) {unknown}; "
                         f"choose from ['current_k', 'rollout_p', 'sigma']")
    return D2Cache(**d2cache)


__all__ = ["Policy", "Vanilla", "PrefixCache", "DualCache", "StaleCache", "D2Cache", "POLICIES",
           "make_policy"]
