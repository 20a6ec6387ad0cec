"""ShardedOptimizer: ZeRO-1/2 for any torch.optim optimizer, driven by the plan.

A ZeRO parameter is stored whole on its ZeRO axes, but each rank updates
only a flat 1/n slice of it, so the optimizer state (and, at level 2, the
gradient) exists once across those ranks instead of n times:

    backward   the graph leaves the gradient unreduced on the ZeRO axes
    reduce     reduce-scatter the flat gradient into this rank's slice
               in buckets (zero_buckets.py); level 2: in backward, as soon as a bucket's
               gradients are accumulated; level 1: at step()
    step       the wrapped optimizer updates the slice
    gather     all-gather the updated slices into the whole weight, a bucket
               (the reduction's) at a time

The collectives go through collectives.transform, so they are logged and
priced like every other, and the plan's predictions (cost.zero_collectives)
list exactly these.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ...errors import PlanError
from ...sharding.placement import P, R, S, gathered_size, shard_full_tensor
from ...sharding.redistribute import plan_steps
from ..collectives import transform
from .state import PlaceholderState, drop_placeholder_state, export_state, init_state, load_state
from ..reduction.zero_buckets import ZeroBuckets


@dataclass
class _ZeroParam:
    name: str
    param: torch.nn.Parameter   # the whole weight the graph uses
    slice: torch.nn.Parameter   # this rank's flat slice, which the wrapped optimizer updates
    level: int
    reduce_steps: list          # P -> S(0) on the ZeRO axes, outermost first
    gather_steps: list          # S(0) -> R
    reduce_dtype: torch.dtype   # the gradient's dtype on the network


class ShardedOptimizer:
    """Wraps `optimizer_class(params, **kwargs)` so the plan's ZeRO parameters step on their slice.

    Parameters the plan does not split with ZeRO (DDP, FSDP, TP ones) are
    handed to the wrapped optimizer as they are. An LR scheduler takes the
    wrapped optimizer: `torch.optim.lr_scheduler.StepLR(opt.optimizer, ...)`.
    Gradients of ZeRO parameters are not whole on any rank (`param.grad` is
    this rank's unreduced contribution at level 1, None at level 2): clip with
    `autopar.clip_grad_norm_(module, max_norm, optimizer=this)`, which reduces
    them into the slices first.
    """

    def __init__(self, module, optimizer_class, **kwargs):
        if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)):
            raise PlanError(f"ShardedOptimizer takes an optimizer class such as torch.optim.AdamW (and its "
                            f"keyword arguments), got {optimizer_class!r}")
        plan = module.plan
        names, sizes = plan.mesh.axis_names, plan.mesh.axis_sizes
        coords = tuple(a.coord for a in module.comm.axes)
        self.comm = module.comm
        self.module = module
        self.zero_params: list[_ZeroParam] = []
        self._hooks = []
        if module.zero_optimizer is not None:
            # a new wrapper replaces the old one (e.g. made again after loading a checkpoint): the old
            # one's hooks would otherwise reduce the gradients a second time, into slices nothing steps
            for h in module.zero_optimizer._hooks:
                h.remove()
        policy = plan.precision_policy
        params = []
        self.param_names: list[str] = []   # the wrapped optimizer's parameters' names, in its order
        self.placeholder = PlaceholderState()   # what optim_state.init_state made, until the first step
        for fqn, p in module.named_parameters():
            self.param_names.append(fqn)
            level, axis_names = plan.param_zero.get(fqn, (0, ()))
            if not level or not p.requires_grad:
                params.append(p)
                continue
            axes = [names.index(a) for a in axis_names]
            sliced = tuple(S(0) if a in axes else R for a in range(len(sizes)))
            partial = tuple(P if a in axes else R for a in range(len(sizes)))
            whole = (R,) * len(sizes)
            local = shard_full_tensor(p.detach().reshape(-1), sliced, coords, sizes).clone()
            z = _ZeroParam(fqn, p, torch.nn.Parameter(local), level, plan_steps(partial, sliced),
                           plan_steps(sliced, whole), policy.resolve(p.dtype).reduce)
            if level >= 2:
                self._hooks.append(p.register_post_accumulate_grad_hook(lambda _, z=z: self._arrived(z)))
            self.zero_params.append(z)
            params.append(z.slice)
        self._buckets = {level: self._zero_buckets(module, level) for level in (1, 2)}
        self.optimizer = optimizer_class(params, **kwargs)
        module.zero_optimizer = self

    def _zero_buckets(self, module, level: int) -> ZeroBuckets:
        """The gradient buckets of one ZeRO level, as the plan lists them (planning/schedule.py), over the weights
        that get a gradient here. A bucket's rows are equal slices of its weights: one whose flat size does not
        divide by its axis cannot be in one (cost/buckets.zero_buckets keeps such weights out)."""
        plan, out, zero = module.plan, [], {z.name: z for z in self.zero_params}
        for b in plan.schedule.zero_buckets.get(level, ()):
            (axis_name,) = b.axes
            axis = plan.mesh.axis_names.index(axis_name)
            names = [n for n in b.weights if n in zero]   # zero_params holds those that get a gradient
            uneven = [n for n in names if zero[n].param.numel() % self.comm.axes[axis].size]
            if uneven:
                raise PlanError(f"the plan's ZeRO-{level} bucket puts {uneven[:3]} in one reduce-scatter over "
                                f"{axis_name!r}, but their shard here does not divide by its size: plan again "
                                "(autopar.plan) for this mesh")
            if names:
                out.append((axis, names))
        return ZeroBuckets(out, zero, self.comm, "backward" if level >= 2 else "optimizer")

    def _reduce_level1(self) -> None:
        """Reduce the ZeRO-1 gradients accumulated so far into their slices: in buckets, where they have one."""
        self._buckets[1].flush()
        for z in self.zero_params:
            if z.level == 1 and z.param.grad is not None and z.name not in self._buckets[1]:
                self._reduce(z, "optimizer")

    def _arrived(self, z: _ZeroParam) -> None:
        """A ZeRO-2 weight's gradient is accumulated: into its bucket, or reduced now where it has none."""
        if z.name in self._buckets[2]:
            self._buckets[2].arrive(z.name)
        else:
            self._reduce(z, "backward")

    def _reduce(self, z: _ZeroParam, phase: str) -> None:
        g = z.param.grad.reshape(-1).to(z.reduce_dtype)   # a precision policy's reduce dtype (cost/precision.py)
        for st in z.reduce_steps:
            g = transform(g, st.src, st.dst, st.axis, self.comm, phase)
        g = g.to(z.slice.dtype)
        z.slice.grad = g if z.slice.grad is None else z.slice.grad + g
        if z.level >= 2:
            z.param.grad = None   # the point of level 2: the whole gradient does not outlive backward

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise PlanError("ShardedOptimizer.step does not take a closure: its ZeRO collectives must run "
                            "once per step on every rank")
        self._reduce_level1()
        drop_placeholder_state(self)
        self.optimizer.step()
        for level in (1, 2):
            self._buckets[level].gather_weights()
        for z in self.zero_params:
            if z.name not in self._buckets[z.level]:
                z.param.copy_(self.gather(z, z.slice.detach(), "optimizer").view_as(z.param))
            if z.level == 1:
                z.slice.grad = None   # level 1 keeps the whole gradient, not a second, sliced one

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)
        for z in self.zero_params:
            z.param.grad = None
            z.slice.grad = None

    def full_grads(self) -> dict:
        """Whole gradients by parameter name, ZeRO ones included (for checks; costs collectives).

        Call between backward and step: a level-1 gradient is summed over its
        axes, a level-2 one gathered from the slices.
        """
        grads = self.module.full_grads()
        for z in self.zero_params:
            if z.level == 1 and z.param.grad is not None:
                g = z.param.grad
                for st in z.reduce_steps:
                    g = transform(g, P, R, st.axis, self.comm, "checkpoint")
            elif z.slice.grad is not None:
                g = self.gather(z, z.slice.grad, "checkpoint").view_as(z.param)
            else:
                continue
            grads[z.name] = self.module.export_tensor(g, self.module.plan.param_placements[z.name], True,
                                                       self.module.global_shapes[z.name])
        return grads

    def gather(self, z: _ZeroParam, x: torch.Tensor, phase: str) -> torch.Tensor:
        """The whole flat tensor from this rank's slice (slices of a count the axes do not divide are
        padded for the all-gather: placement.chunk_span)."""
        flat = (z.param.numel(),)
        for st in z.gather_steps:
            x = transform(x, st.src, st.dst, st.axis, self.comm, phase,
                          gathered_size(flat, st.before, st.axis, self.module.plan.mesh.axis_sizes))
        return x

    def slice_grads(self) -> list:
        """Gradients this wrapper holds for ZeRO-2 slices (for audits)."""
        return [z.slice.grad for z in self.zero_params if z.slice.grad is not None]

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    def state_dict(self) -> dict:
        """The state by parameter name, parameter-shaped tensors as DTensors (optim_state.py): what
        torch's get_optimizer_state_dict gives, so DCP saves it beside `module.state_dict()` and any
        plan loads it. Call on every rank (ZeRO slices are gathered); an optimizer that has not
        stepped yet is given its state first (a step at learning rate 0, which counts as none: the
        first real step starts from no state, as on one device), so a checkpoint can be loaded into
        what this returns."""
        init_state(self)
        return export_state(self)

    def load_state_dict(self, state_dict) -> None:
        """Load what `state_dict()` returned under any plan (or DCP loaded into it)."""
        load_state(self, state_dict)

    def reduce_gradients(self) -> None:
        """Reduce level-1 ZeRO gradients into their slices now, as step() would (it then does not again):
        for autopar.clip_grad_norm_, which needs every gradient reduced. Level 2 reduced them in backward."""
        self._reduce_level1()
        for z in self.zero_params:
            if z.level == 1:
                z.param.grad = None   # reduced: step() skips it, full_grads() reads the slice
