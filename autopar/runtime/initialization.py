"""Initializing a meta-built model's shards from scratch, one module at a time.

A model too big for one device is built on the meta device; after
`pm.to_empty(device=...)` its shards hold garbage. `init_weights` runs the
model's own initialization on each module in turn: the module's own
parameters and buffers are made whole on the device, initialized (the nearest
`_init_weights`, then `reset_parameters` for what that leaves unset:
module_initializers, run_initializers), this rank's
slice copied into its shard, and the whole tensors dropped before the next
module. So a rank never holds more than its shards plus one module's whole
weights, and every rank draws the same random numbers a single device would
(seed them alike), in `model.modules()` order.
"""
from __future__ import annotations

import warnings

import torch

from ..errors import PlanError
from ..sharding.placement import R, shard_full_tensor


def module_initializers(model: torch.nn.Module, prefix: str, fn=None) -> list:
    """The functions that may initialize the module at `prefix` of `model` (each called as `f(module)`), in
    the order to try them: `fn` alone when given; else the nearest `_init_weights` of the module or a parent,
    then the module's own `reset_parameters`. [] when nothing would initialize it.

    The nearest `_init_weights`, not the root's: Transformers initializes a sub-model that is itself a
    PreTrainedModel (LlamaForCausalLM's `.model`) with that sub-model's own, and a user's wrapper around a
    Hugging Face or nanoGPT model has none at the root. `reset_parameters` stays in the list after it
    because an `_init_weights` covers only the modules its model knows (nanoGPT's sets Linear and Embedding,
    not LayerNorm): `run_initializers` tries the next only for the tensors the first left unset.
    init_weights and load_hf both run them so, and a module's weights and its recomputed buffers come from
    the same initialization.
    """
    if fn is not None:
        return [fn]
    out = []
    nearest = _nearest_init_weights(model, prefix)
    if nearest is not None:
        out.append(nearest)
    if callable(getattr(model.get_submodule(prefix), "reset_parameters", None)):
        out.append(_reset_parameters)
    return out


def _nearest_init_weights(model: torch.nn.Module, prefix: str):
    """The `_init_weights` of the module at `prefix`, else of its closest parent that has one, else None."""
    parts = prefix.split(".") if prefix else []
    for depth in range(len(parts), -1, -1):
        own = getattr(model.get_submodule(".".join(parts[:depth])), "_init_weights", None)
        if callable(own):
            return own
    return None


def _reset_parameters(module: torch.nn.Module) -> None:
    module.reset_parameters()


def run_initializers(module: torch.nn.Module, names, inits: list) -> list:
    """Run `inits` (module_initializers' list) on `module`, whose own tensors are real, until none of its
    tensors `names` is left unset; the names still unset after them all (those `inits` do not compute).

    As on one device, where a module is built set and its model's `_init_weights` then overwrites what it
    covers: the tensors `names` are filled with a sentinel (fill_sentinel) first, and an initializer runs
    only while one of them still holds it, so a module the first sets whole draws no more random numbers
    than that one does (every later module's draws stay the single device's). A tensor an earlier
    initializer set keeps its value: a `reset_parameters` run for a Linear's bias that `_init_weights` left
    does not overwrite the weight it set. Call under torch.no_grad().
    """
    names = list(names)
    for n in names:
        fill_sentinel(getattr(module, n))
    kept = {}
    for i, init in enumerate(inits):
        init(module)
        for n, value in kept.items():
            getattr(module, n).copy_(value)     # the earlier initializer's, not this one's
        unset = [n for n in names if is_sentinel(getattr(module, n))]
        if not unset:
            return []
        if i + 1 < len(inits):
            kept.update({n: getattr(module, n).detach().clone() for n in names if n not in unset and n not in kept})
    return [n for n in names if is_sentinel(getattr(module, n))]


def fill_sentinel(t: torch.Tensor) -> None:
    """Mark `t` as not set: NaN, or an integer tensor's largest value (a bool tensor cannot be marked)."""
    if t.is_floating_point() or t.is_complex():
        t.fill_(float("nan"))
    elif t.dtype != torch.bool:
        t.fill_(torch.iinfo(t.dtype).max)


def is_sentinel(t: torch.Tensor) -> bool:
    """Does `t` still hold (some of) fill_sentinel's mark? A bool tensor cannot say: taken as set."""
    if t.is_floating_point() or t.is_complex():
        return bool(t.isnan().any())
    if t.dtype == torch.bool:
        return False
    return bool((t == torch.iinfo(t.dtype).max).any())


def init_shards(model: torch.nn.Module, shards: dict, placements: dict, aliases: dict, coords: tuple,
                axis_sizes: tuple, fn=None) -> None:
    """Initialize `shards` ({fqn: this rank's local tensor}) as `model`'s initialization would the whole.

    `model`: the module tree on meta; `placements`: fqn -> placements (whole where absent);
    `aliases`: tied names -> the canonical name `shards` holds them under. A tensor no initializer of its
    module sets holds NaN (integers: their largest value) and is named in a warning.
    """
    device = _device_of(shards)
    untouched, not_set = [], []
    for prefix, module in model.named_modules():
        names = {n: aliases.get(qualified_name(prefix, n), qualified_name(prefix, n))
                 for n, _ in _own_tensors(module)}
        if not any(fqn in shards for fqn in names.values()):
            continue    # no tensor of its own here (or, pipelined, on another stage)
        inits = module_initializers(model, prefix, fn)
        if not inits:
            untouched.append(prefix or "<root>")
            continue
        module.to_empty(device=device, recurse=False)
        try:
            with torch.no_grad():
                # all its own tensors, held here or not: every rank runs the same initializers (same draws)
                unset = run_initializers(module, names, inits)
                not_set += [qualified_name(prefix, n) for n in unset if names[n] in shards]
                for n, t in _own_tensors(module):
                    fqn = names[n]
                    if fqn in shards:
                        pl = placements.get(fqn, (R,) * len(axis_sizes))
                        shards[fqn].copy_(shard_full_tensor(t.detach(), pl, coords, axis_sizes))
        finally:
            module.to_empty(device="meta", recurse=False)   # drop the whole tensors before the next module
    if untouched:
        warnings.warn(f"init_weights: no initializer for the tensors of module(s) {untouched} (no "
                      "reset_parameters, no _init_weights of the module or its parents, no fn=): they hold "
                      "whatever to_empty left; pass fn= to initialize them", stacklevel=3)
    if not_set:
        warnings.warn(f"init_weights: no initializer of their module sets tensor(s) {not_set} (fn=, else "
                      "neither the nearest _init_weights of the module or its parents nor its reset_parameters): "
                      "they hold NaN (an integer tensor its largest value); pass fn= to initialize them",
                      stacklevel=3)


def _own_tensors(module: torch.nn.Module) -> list:
    return [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]


def _device_of(shards: dict) -> torch.device:
    devices = {t.device for t in shards.values()}
    if any(d.type == "meta" for d in devices):
        raise PlanError("init_weights fills this rank's shards, which are still on the meta device: call "
                        "pm.to_empty(device=...) first")
    if len(devices) != 1:
        raise PlanError(f"init_weights expects every shard on one device, found {sorted(map(str, devices))}")
    return devices.pop()


def qualified_name(prefix: str, name: str) -> str:
    """`name` under the module path `prefix` ("" for the root), as named_parameters spells it."""
    return f"{prefix}.{name}" if prefix else name
