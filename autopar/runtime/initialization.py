"""Initializing a meta-built model's shards from scratch, one module at a time.

A model too big for one device is built on the meta device; after
`pm.to_empty(device=...)` its shards hold garbage. `init_weights` runs the
model's own initialization on each module in turn: the module's own
parameters and buffers are made whole on the device, initialized, this rank's
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


def module_initializer(model: torch.nn.Module, fn):
    """The function that initializes one module: `fn`, else the model's own `_init_weights` (Hugging
    Face's PreTrainedModel, nanoGPT), else each module's `reset_parameters` (torch.nn's layers)."""
    if fn is not None:
        return fn
    own = getattr(model, "_init_weights", None)
    if callable(own):
        return own

    def reset(module):
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()
    return reset


def init_shards(model: torch.nn.Module, shards: dict, placements: dict, aliases: dict, coords: tuple,
                axis_sizes: tuple, fn=None) -> None:
    """Initialize `shards` ({fqn: this rank's local tensor}) as `model`'s initialization would the whole.

    `model`: the module tree on meta; `placements`: fqn -> placements (whole where absent);
    `aliases`: tied names -> the canonical name `shards` holds them under.
    """
    device = _device_of(shards)
    init = module_initializer(model, fn)
    model_wide = fn is not None or callable(getattr(model, "_init_weights", None))
    untouched = []
    for prefix, module in model.named_modules():
        names = {n: aliases.get(qualified_name(prefix, n), qualified_name(prefix, n))
                 for n, _ in _own_tensors(module)}
        if not any(fqn in shards for fqn in names.values()):
            continue    # no tensor of its own here (or, pipelined, on another stage)
        if not model_wide and not hasattr(module, "reset_parameters"):
            untouched.append(prefix or "<root>")
            continue
        module.to_empty(device=device, recurse=False)
        try:
            with torch.no_grad():
                init(module)
                for n, t in _own_tensors(module):
                    fqn = names[n]
                    if fqn in shards:
                        pl = placements.get(fqn, (R,) * len(axis_sizes))
                        shards[fqn].copy_(shard_full_tensor(t.detach(), pl, coords, axis_sizes))
        finally:
            module.to_empty(device="meta", recurse=False)   # drop the whole tensors before the next module
    if untouched:
        warnings.warn(f"init_weights: no initializer for the tensors of module(s) {untouched} (no "
                      "reset_parameters, no model._init_weights, no fn=): they hold whatever to_empty left; "
                      "pass fn= to initialize them", stacklevel=3)


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
