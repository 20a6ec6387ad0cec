"""Per-op selective checkpointing of one region (the plan's "per-op" kind: torchtitan's per-op SAC).

The region caches the results of the matmuls and fused attention kernels its SavePolicy
(cost/checkpointing.py) names, and recomputes every other op in backward. Ops are matched by position
in the region, per family: the k-th aten.mm/addmm call of the region, counted from zero at each
checkpoint call, is cached where the plan priced the k-th captured op that runs as one cached; likewise
for the fused attention kernels. So the run caches exactly what the plan priced, eager or compiled.

Eager, the two dispatch modes below do the caching themselves rather than torch's SAC modes
(torch.utils.checkpoint.create_selective_checkpoint_contexts): those index every op by its own count
in the region, and an FSDP weight a region's forward took from a gather launched ahead of it
(runtime/reduction/layer_groups.py) is gathered by the rerun itself, so the rerun runs view and copy
ops forward did not, which torch's modes refuse ("not found in storage"). Only the cached families'
positions matter here, and the rest is simply run again.

Compiled, torch's SAC context tags each traced op with the same decision (MUST_SAVE, or PREFER_RECOMPUTE,
which the partitioner treats as must-recompute; torch 2.13 asks the policy in forward only). The
partitioner then saves a cached result only where backward reads it (a block's last matmul, read by
nothing but the residual add, is not kept), so a compiled per-op plan keeps at most what was priced.

A region that runs another count of either family than its capture (an attention's math fallback where
the plan priced a fused kernel, a ring) raises CheckpointPolicyError: caching by position would cache
other ops than those priced.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from ..._compat import dispatch_mode_class, scaled_mm_op, tensor_version
from ...errors import PlanError

# (a float8 linear's forward runs one _scaled_mm where a linear runs one mm: runtime/lowering/float8.py; torchtitan's
# per-op policy saves it too)
_MM = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, scaled_mm_op())
# the fused kernels scaled_dot_product_attention runs as (on a CPU: _scaled_dot_product_flash_attention_for_cpu)
_ATTENTION = tuple(getattr(torch.ops.aten, name).default for name in (
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu")
    if hasattr(torch.ops.aten, name))
MATMUL, ATTENTION = "matmul", "attention"


class CheckpointPolicyError(PlanError):
    """A per-op checkpointed region ran other matmuls or attention kernels than the plan priced."""


class _Positions(NamedTuple):
    """The part of a SavePolicy a count reads (per family, whether each op by position is cached), rebuilt
    from the constants a compiled region's context_fn carries."""
    matmuls: tuple
    attentions: tuple


class PositionCounter:
    """One checkpoint call's count of a region's matmuls and fused attention kernels."""

    def __init__(self, policy, label: str):
        self.policy, self.label = policy, label
        self.seen = {MATMUL: 0, ATTENTION: 0}

    def position(self, func) -> tuple | None:
        """(family, index in the region) of this call, counted; None for an op of neither family."""
        kind = MATMUL if func in _MM else ATTENTION if func in _ATTENTION else None
        if kind is None:
            return None
        k = self.seen[kind]
        self.seen[kind] += 1
        if k >= len(self._flags(kind)):
            raise self.mismatch()
        return kind, k

    def cached(self, position) -> bool:
        return position is not None and self._flags(position[0])[position[1]]

    def _flags(self, kind: str) -> tuple:
        return self.policy.matmuls if kind == MATMUL else self.policy.attentions

    def check(self) -> None:
        """After the region's forward: it ran as many of each family as the plan priced."""
        if (self.seen[MATMUL], self.seen[ATTENTION]) != (len(self.policy.matmuls), len(self.policy.attentions)):
            raise self.mismatch()

    def mismatch(self) -> CheckpointPolicyError:
        return CheckpointPolicyError(
            f"per-op checkpointing of block {self.label}: the plan priced {len(self.policy.matmuls)} matmuls "
            f"(aten.mm/addmm) and {len(self.policy.attentions)} fused attention kernels, the block ran "
            f"{self.seen[MATMUL]} and {self.seen[ATTENTION]} (so far): it runs other kernels than those of the "
            "hardware the plan was made for (an attention's math fallback, a ring); plan for the hardware it "
            "runs on, or use checkpointing='full'")


def _tensors(out) -> list:
    return [t for t in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(t, torch.Tensor)]


def _detached(out):
    # detached: the cache must not hold the graph that holds the checkpoint that holds the cache
    if isinstance(out, (tuple, list)):
        return type(out)(t.detach() if isinstance(t, torch.Tensor) else t for t in out)
    return out.detach()


Mode = dispatch_mode_class()


class _Caching(Mode):
    """Forward: run every op; keep the results of the cached ones, by position."""

    def __init__(self, counter: PositionCounter, store: dict, observer=None):
        super().__init__()
        self.counter, self.store, self.observer = counter, store, observer

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        position = self.counter.position(func)
        if self.counter.cached(position):
            self.store[position] = (_detached(out), [tensor_version(t) for t in _tensors(out)])
            if self.observer is not None:
                self.observer(tuple(_tensors(out)))
        return out


class _Cached(Mode):
    """Backward's rerun: a cached op's result from the cache, every other op run again."""

    def __init__(self, policy, label: str, store: dict):
        super().__init__()
        self.counter, self.store = PositionCounter(policy, label), store

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        position = self.counter.position(func)
        if position in self.store:
            out, versions = self.store.pop(position)
            if [tensor_version(t) for t in _tensors(out)] != versions:
                raise CheckpointPolicyError(f"per-op checkpointing of block {self.counter.label}: the result of "
                                            f"{func} cached in forward was changed in place before backward")
            return out
        return func(*args, **(kwargs or {}))


def per_op_eager(policy, label: str, observer=None, calls: list | None = None):
    """torch.utils.checkpoint's context_fn for a per-op region run eagerly: a fresh count and cache for each
    checkpoint call. `observer` sees each cached result (autopar.audit); `calls` collects each call's
    forward counter (its caller checks the counts after forward)."""
    def context_fn():
        counter, store = PositionCounter(policy, label), {}
        if calls is not None:
            calls.append(counter)
        return _Caching(counter, store, observer), _Cached(policy, label, store)
    return context_fn


def per_op_compiled(policy, label: str):
    """The context_fn for a per-op region under torch.compile: torch's SAC contexts, which tag each traced
    op with the policy's decision for the partitioner. (A functools.partial of constants: the one kind of
    context_fn besides a module-level function that dynamo takes.)"""
    return functools.partial(_compiled_contexts, policy.matmuls, policy.attentions, label)


def _compiled_contexts(matmuls: tuple, attentions: tuple, label: str):
    counter = PositionCounter(_Positions(matmuls, attentions), label)

    def decide(ctx, op, *args, **kwargs):
        if op is torch.ops.autopar.logged_send.default:   # effectful: kept (recompute.recompute_all_but_logging)
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.MUST_SAVE if counter.cached(counter.position(op)) else \
            CheckpointPolicy.PREFER_RECOMPUTE
    return create_selective_checkpoint_contexts(decide)
