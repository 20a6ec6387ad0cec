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

Not quite the same numbers: HF's masking_utils looks for packed sequences
(`position_ids` restarting per document) only when the 2D attention_mask is None
*and* there is no cache, and then masks attention per document. A model whose
config has use_cache=True, called as its authors call it on a packed batch
(`position_ids`, no attention_mask), builds a cache and so attends across the
documents; with the cache forced off it would mask them (tests/test_caches.py's
tiny Llama: loss 4.145448 traced against 4.143707 as shipped). So where the call as shipped would
build a cache, a Hugging Face model given position_ids and no attention_mask is
also given an attention_mask of ones (made from the input's sizes): "no padding"
to HF, as None is, but one that turns the packed-sequence detection off as the
cache did. The module then follows the shipped model: plain causal attention
(capture/causal_masks.py makes that mask `is_causal`). Called with use_cache=False
(or under HF's gradient checkpointing, which turns the cache off), it masks per
document, as the model itself does then.

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


def _is_hf_model(model: torch.nn.Module) -> bool:
    module = sys.modules.get("transformers.modeling_utils")
    base = getattr(module, "PreTrainedModel", None)
    return isinstance(base, type) and isinstance(model, base)


def _builds_cache(model: torch.nn.Module, kwargs: dict) -> bool:
    """Whether the model as shipped builds a cache on this call: the call's use_cache, else its config's
    (HF's merge_with_config_defaults), off where HF's gradient checkpointing runs."""
    use_cache = kwargs.get("use_cache")
    if use_cache is None:
        use_cache = getattr(getattr(model, "config", None), "use_cache", None)
    checkpointing = any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules())
    return bool(use_cache) and not (checkpointing and model.training and torch.is_grad_enabled())


def _packed_unmasked_tokens(model: torch.nn.Module, args: tuple, kwargs: dict):
    """The call's input_ids (or inputs_embeds), which size the batch and the sequence, where it gives
    position_ids and no attention_mask to a forward that takes one; else None."""
    try:
        signature = inspect.signature(model.forward)
        called = signature.bind_partial(*args, **kwargs).arguments
    except (TypeError, ValueError):
        return None
    if "attention_mask" not in signature.parameters or called.get("attention_mask") is not None \
            or called.get("position_ids") is None:
        return None
    tokens = called.get("input_ids")
    tokens = tokens if tokens is not None else called.get("inputs_embeds")
    return tokens if isinstance(tokens, torch.Tensor) else None


def _no_cache(module, args, kwargs):
    """use_cache=False, and where that alone would turn on HF's packed-sequence mask (module docstring)
    an attention_mask of ones, as the shipped call's cache kept it off."""
    as_shipped = dict(kwargs, use_cache=False)
    tokens = _packed_unmasked_tokens(module, args, kwargs)
    if tokens is not None and _is_hf_model(module) and _builds_cache(module, kwargs):
        # from the sizes alone (no input's values), so causal_masks.py can still make the mask is_causal
        ones = torch.ones(tokens.shape[:2], dtype=torch.long, device=tokens.device)
        at = list(inspect.signature(module.forward).parameters).index("attention_mask")
        if at < len(args):   # given positionally (as None): replaced there, not given twice
            args = (*args[:at], ones, *args[at + 1:])
        else:
            as_shipped["attention_mask"] = ones
    return args, as_shipped


@contextlib.contextmanager
def caches_left_out(model: torch.nn.Module):
    """While open, `model` is called with use_cache=False where its forward takes it (with an attention_mask
    of ones on a packed batch that would have built a cache, as above), and its outputs leave out KV caches
    (forward hooks, which torch.export traces)."""
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
