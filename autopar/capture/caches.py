"""KV caches: not built while a model is captured, and left out of what it returns.

Every Hugging Face causal LM's default config has `use_cache=True`, so a model
called as shipped (`model(input_ids=..., labels=...)`) builds a `DynamicCache`
of its keys and values and returns it: a Python object torch.export cannot
return, and one a training step never reads. Worse, the cache starts as an
empty tensor made in forward (a constant the graph would carry, on the meta
device for a model built there) and each layer copies its keys and values into
it. So while a model is traced, a forward whose signature takes `use_cache` is
called with `use_cache=False`: the same numbers, without the copies. Whatever
cache a model returns anyway is left out of its outputs (`out.past_key_values`
is then None, the field's default).

transformers is not a dependency: a cache is recognised as an instance of its
`Cache` class only when the model's code has imported transformers already.
"""
from __future__ import annotations

import contextlib
import inspect
import sys
from collections.abc import Mapping

import torch


def _cache_types() -> tuple:
    module = sys.modules.get("transformers.cache_utils")
    cache = getattr(module, "Cache", None)
    return (cache,) if isinstance(cache, type) else ()


def without_caches(out, cache_types: tuple):
    """`out` with every KV cache among its top-level fields left out (a ModelOutput or dict rebuilt
    without them, a tuple's made None)."""
    if not cache_types:
        return out
    if isinstance(out, Mapping):
        if not any(isinstance(v, cache_types) for v in out.values()):
            return out
        return type(out)(**{k: v for k, v in out.items() if not isinstance(v, cache_types)})
    if isinstance(out, tuple) and any(isinstance(v, cache_types) for v in out):
        return type(out)(None if isinstance(v, cache_types) else v for v in out)
    return out


def _takes_use_cache(model: torch.nn.Module) -> bool:
    try:
        return "use_cache" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


def _no_cache(module, args, kwargs):
    return args, {**kwargs, "use_cache": False}


@contextlib.contextmanager
def caches_left_out(model: torch.nn.Module):
    """While open, `model` is called with use_cache=False where its forward takes it, and its outputs leave
    out KV caches (forward hooks, which torch.export traces)."""
    cache_types = _cache_types()
    handles = []
    if _takes_use_cache(model):
        handles.append(model.register_forward_pre_hook(_no_cache, with_kwargs=True))
    if cache_types:
        handles.append(model.register_forward_hook(lambda module, args, out: without_caches(out, cache_types)))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
