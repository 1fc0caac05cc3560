"""Cache policies: rules for which tokens each model call recomputes."""
from ..config import CacheConfig
from .base import Policy
from .fastdllm import DualCache, PrefixCache, Vanilla
from .diagnostic import StaleCache
from .d2cache import D2Cache

POLICIES = {"none": Vanilla, "prefix": PrefixCache, "dual": DualCache,
            "stale": StaleCache,  # diagnostic: never refreshed, must lose accuracy
            "d2cache": D2Cache}


def make_policy(cache: CacheConfig | str) -> Policy:
    """The policy of a cache configuration (a method name is ``CacheConfig(method=name)``)."""
    if isinstance(cache, str):
        cache = CacheConfig(method=cache)
    if cache.method == "d2cache":
        d = cache.d2cache
        return D2Cache(rollout_p=d.rollout_p, current_k=d.current_k, sigma=d.density_sigma)
    return POLICIES[cache.method]()


__all__ = ["Policy", "Vanilla", "PrefixCache", "DualCache", "StaleCache", "D2Cache", "POLICIES",
           "make_policy"]
