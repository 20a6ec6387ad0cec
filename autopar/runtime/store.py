"""What a ParallelModule holds: this rank's shards under the original names, and what feeds each of its
graph's placeholders (a weight, a buffer, a lifted constant, or an input).

The shards live in a `Store`, a copy of the model's module tree holding only tensors, so
`named_parameters()` keeps the model's own names and any torch.optim optimizer takes them.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..capture.export import BUFFER, CONSTANT, INPUT, PARAM, Captured
from ..errors import PlanError
from ..sharding.placement import shard_full_tensor


class Store(torch.nn.Module):
    """The original module tree, holding local shards of parameters and buffers."""

    def _load_from_state_dict(self, *args, **kwargs):
        # the ParallelModule above loads these shards by their original names (its _load_from_state_dict);
        # a parent's load_state_dict, recursing down to here, would report them missing under "store."
        pass


@dataclass
class Stored:
    store: Store
    placeholder_sources: list       # (kind, fqn) per graph placeholder, in order (fqn None for an input)
    # tensors export lifted out of forward (kept whole): the values the model's code computes with, no state
    # of the model's, so not in state_dict
    constants: dict = field(default_factory=dict)
    global_shapes: dict = field(default_factory=dict)   # parameter name -> whole shape
    model_names: set = field(default_factory=set)       # every parameter and buffer name of the whole model


def store_shards(cap: Captured, plan, model: torch.nn.Module, coords: tuple, needed: set | None) -> Stored:
    """This rank's shards of `model`'s weights (those in `needed`: a pipeline's stages hold only their own;
    None: all), cut as plan.param_placements says and kept in the precision policy's master dtype, and
    buffers whole."""
    full_params = dict(model.named_parameters(remove_duplicate=False))
    full_buffers = dict(model.named_buffers(remove_duplicate=False))
    master_dtypes = _master_dtypes(full_params, plan)
    out = Stored(Store(), [], global_shapes={fqn: tuple(p.shape) for fqn, p in full_params.items()},
                 model_names=set(full_params) | set(full_buffers))
    params, buffers = set(), set()
    for node in cap.graph.nodes:
        if node.op != "placeholder":
            continue
        info = cap.info[node.name]
        fqn = info.target_name
        if info.kind == PARAM:
            if fqn not in params and (needed is None or fqn in needed):
                full = full_params[fqn]
                local = shard_full_tensor(full.detach(), plan.param_placements[fqn], coords, plan.mesh.axis_sizes)
                local = local.to(master_dtypes.get(fqn, local.dtype), copy=True)
                _set_by_path(out.store, fqn, torch.nn.Parameter(local, full.requires_grad), True)
                params.add(fqn)
            out.placeholder_sources.append((PARAM, fqn))
        elif info.kind == BUFFER:
            if fqn not in buffers and (needed is None or fqn in needed):
                _set_by_path(out.store, fqn, full_buffers[fqn].detach().clone(), False)
                buffers.add(fqn)
            out.placeholder_sources.append((BUFFER, fqn))
        elif info.kind == CONSTANT:
            out.placeholder_sources.append((CONSTANT, fqn))
            out.constants[fqn] = cap.exported.constants[fqn]
        else:
            out.placeholder_sources.append((INPUT, None))
    return out


def graph_args(sources: list, store: Store, constants: dict, local_inputs, module) -> tuple:
    """(the graph's arguments in placeholder order, (position, name) of each weight among them): weights and
    buffers from `store`, lifted constants, and the inputs in turn. `module` holds them all: a constant made
    on meta with the model has no values unless the module is on meta too."""
    params, buffers = dict(store.named_parameters()), dict(store.named_buffers())
    it = iter(local_inputs)
    args, weights = [], []
    for kind, fqn in sources:
        if kind == PARAM:
            weights.append((len(args), fqn))
            args.append(params[fqn])
        elif kind == BUFFER:
            args.append(buffers[fqn])
        elif kind == CONSTANT:
            constant = constants[fqn]
            if constant.is_meta and not on_meta(module):
                raise PlanError(valueless_constant(fqn))
            args.append(constant)
        else:
            args.append(next(it))
    return args, weights


def _set_by_path(root: torch.nn.Module, fqn: str, value, as_param: bool):
    *path, leaf = fqn.split(".")
    mod = root
    for p in path:
        if not hasattr(mod, p):
            mod.add_module(p, Store())
        mod = getattr(mod, p)
    if as_param:
        mod.register_parameter(leaf, value)
    else:
        mod.register_buffer(leaf, value)


def _master_dtypes(params: dict, plan) -> dict:
    """Parameter name -> the dtype the plan's precision policy keeps it in (floating ones only)."""
    policy = plan.precision_policy
    return {fqn: policy.resolve(p.dtype).master for fqn, p in params.items() if p.dtype.is_floating_point}


def on_meta(model: torch.nn.Module) -> bool:
    tensors = [*model.parameters(), *model.buffers()]
    return bool(tensors) and all(t.is_meta for t in tensors)


def moved_constant(captured: torch.Tensor, current: torch.Tensor, fn) -> torch.Tensor:
    """A lifted constant on the device `fn` (nn.Module._apply's function) moves the weights to, in its own dtype
    and with its captured values: torch's Module.to leaves a plain tensor attribute's dtype alone, so the
    single-device model computes with it as it is; and no checkpoint holds it, so a trip through the meta
    device (to("meta"), then to_empty) must not lose its values, as it does the weights' (reloaded after)."""
    device = fn(torch.empty(0, dtype=current.dtype, device=current.device)).device
    if captured.is_meta:   # a model built on the meta device: no values to move anywhere
        return captured
    return captured.to(device)


def valueless_constant(name: str) -> str:
    return (f"the model's forward computes with tensor constant {name!r} (a plain tensor attribute, or a tensor made "
            "in forward), made on the meta device with the model, so it has no values to run with; make it a buffer "
            "(register_buffer(..., persistent=False)) that init_weights or a checkpoint fills, or create it on a real "
            "device")
