"""KV caches left out of what a captured model returns.

Every Hugging Face causal LM's default config has `use_cache=True`, so a model
called as shipped (`model(input_ids=..., labels=...)`) also returns its keys and
values as a `DynamicCache`: a Python object torch.export cannot return, and one
a training step never reads. While a model is traced, its outputs are rebuilt
without such caches (`out.past_key_values` is then None, the field's default).
Nothing is lost: the keys and values are computed for attention either way, and
returning them would only keep them alive after the step.

transformers is not a dependency: a cache is recognised as an instance of its
`Cache` class only when the model's code has imported transformers already.
"""
from __future__ import annotations

import contextlib
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


@contextlib.contextmanager
def caches_left_out(model: torch.nn.Module):
    """While open, `model`'s outputs leave out KV caches (a forward hook, which torch.export traces)."""
    cache_types = _cache_types()
    if not cache_types:
        yield
        return
    handle = model.register_forward_hook(lambda module, args, out: without_caches(out, cache_types))
    try:
        yield
    finally:
        handle.remove()
