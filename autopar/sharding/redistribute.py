"""Which collectives turn one placement into another, forward and backward.

This is pure bookkeeping over placements: the cost model prices the steps,
the plan lists them, and the rewriter inserts them, so the three cannot
disagree about what a plan communicates.

Backward is the conjugate of forward. The gradient of a tensor has the same
placement as the tensor on an axis that splits it, and is replicated
otherwise; the only exception is where the tensor enters an op that is split
over an axis on which the tensor is replicated: each rank then contributes
part of the gradient, so it arrives as partial sums ("grad_partial" axes).
Each step's backward turns the gradient's placement at its output into the
one its input expects, with the same table as the forward.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Sequence

from .placement import P, Placements, R, is_shard, local_shape, numel, shard_dim

# kinds of one-axis transition; "chunk" and "zero" need no communication
NONE, ALL_GATHER, REDUCE_SCATTER, ALL_REDUCE, ALL_TO_ALL, CHUNK, ZERO = (
    "none", "all_gather", "reduce_scatter", "all_reduce", "all_to_all", "chunk", "zero_nonroot")
COMMUNICATING = (ALL_GATHER, REDUCE_SCATTER, ALL_REDUCE, ALL_TO_ALL)


class UnsupportedRedistribution(ValueError):
    """The transition cannot be done one axis at a time (nested splits out of order)."""


def transition(src: str, dst: str) -> str:
    """The one-axis collective that turns `src` into `dst`."""
    if src == dst:
        return NONE
    if is_shard(src) and dst == R:
        return ALL_GATHER
    if src == R and is_shard(dst):
        return CHUNK
    if src == P and dst == R:
        return ALL_REDUCE
    if src == P and is_shard(dst):
        return REDUCE_SCATTER
    if is_shard(src) and is_shard(dst):
        return ALL_TO_ALL
    if src == R and dst == P:
        return ZERO
    raise UnsupportedRedistribution(f"no collective turns {src} into {dst}")


def grad_placement(p: str, partial: bool) -> str:
    """Placement of the gradient of a tensor laid out as `p` on one axis."""
    if is_shard(p):
        return p
    if p == R and partial:
        return P
    return R


@dataclass(frozen=True)
class Step:
    """One axis of a redistribution, as one autograd function in the rewritten graph."""
    axis: int
    src: str          # placement on `axis` before the step
    dst: str          # after
    grad_src: str     # gradient placement expected at the step's input
    grad_dst: str     # gradient placement arriving at its output
    before: Placements  # whole placement tuple before the step (for shapes)
    after: Placements

    # (cached: plan_steps keeps its Steps, and the search asks their kinds of ~100k layout pairs)
    @functools.cached_property
    def forward_kind(self) -> str:
        return transition(self.src, self.dst)

    @functools.cached_property
    def backward_kind(self) -> str:
        return transition(self.grad_dst, self.grad_src)


def _check_nesting(placements: Placements, axis: int, dim: int | None) -> None:
    """A split on `axis` may change only if no later axis splits the same dim."""
    if dim is None:
        return
    for later in range(axis + 1, len(placements)):
        if shard_dim(placements[later]) == dim:
            raise UnsupportedRedistribution(
                f"axis {axis} splits dim {dim} inside a split on axis {later}")


def plan_steps(src: Placements, dst: Placements, grad_partial: Sequence[int] = (),
               fallback: bool = True, keep_partial: Sequence[int] = ()) -> list[Step]:
    """One Step per axis whose forward or backward does something.

    `keep_partial`: axes (where src is R) on which the gradient should reach
    src as partial sums, not reduced: a ZeRO parameter's gradient is
    reduce-scattered later, by the optimizer wrapper. A gradient that arrives
    whole there is made partial by keeping it on one rank only.

    Splits are undone innermost axis first and made outermost axis first,
    which keeps nested splits of one dim in mesh order. Where one axis at a
    time cannot get there (an outer split of a dim must change while an inner
    one of the same dim stays), every split is gathered first and the target
    cut afterwards: more bytes, but always possible (`fallback=False` refuses).
    """
    return list(_plan_steps(tuple(src), tuple(dst), tuple(grad_partial), fallback, tuple(keep_partial)))


def planned_steps(src: Placements, dst: Placements, grad_partial: tuple = (), keep_partial: tuple = ()) -> tuple:
    """plan_steps' answer as the kept tuple itself, for tuples (the search's pricing of a layout pair: a list
    made per call was a fifth of it on 4 axes)."""
    return _plan_steps(src, dst, grad_partial, True, keep_partial)


@functools.cache   # pure, and the search asks the same layout pairs for every edge
def _plan_steps(src: Placements, dst: Placements, grad_partial: tuple, fallback: bool,
                keep_partial: tuple) -> tuple:
    return tuple(_steps(src, dst, grad_partial, fallback, keep_partial))


def _steps(src, dst, grad_partial, fallback, keep_partial) -> list[Step]:
    try:
        return _direct_steps(src, dst, grad_partial, keep_partial)
    except UnsupportedRedistribution:
        if not fallback or any(is_shard(s) and d == P for s, d in zip(src, dst)):
            raise
        mid = tuple(R if is_shard(s) else s for s in src)
        first = _direct_steps(src, mid, [a for a in grad_partial if mid[a] == dst[a]], keep_partial)
        return first + _direct_steps(mid, dst, [a for a in grad_partial if mid[a] != dst[a]])


def _direct_steps(src: Placements, dst: Placements, grad_partial: Sequence[int],
                  keep_partial: Sequence[int] = ()) -> list[Step]:
    n = len(src)
    grad_dst_all = tuple(grad_placement(d, a in grad_partial) for a, d in enumerate(dst))
    grad_src_all = tuple(grad_placement(s, a in keep_partial) for a, s in enumerate(src))
    unsplit = [a for a in reversed(range(n)) if is_shard(src[a]) and src[a] != dst[a]]
    rest = [a for a in range(n) if a not in unsplit]
    steps, cur = [], tuple(src)
    for a in unsplit + rest:
        if cur[a] == dst[a] and grad_src_all[a] == grad_dst_all[a]:
            continue
        _check_nesting(cur, a, shard_dim(cur[a]))
        after = cur[:a] + (dst[a],) + cur[a + 1:]
        _check_nesting(after, a, shard_dim(dst[a]))
        if is_shard(src[a]) and dst[a] == P:
            raise UnsupportedRedistribution(f"cannot turn split {src[a]} into partial on axis {a}")
        steps.append(_one_of(Step(a, cur[a], dst[a], grad_src_all[a], grad_dst_all[a], cur, after)))
        cur = after
    return steps


@functools.cache
def _one_of(step: Step) -> Step:
    """The first Step made equal to `step`: equal steps of different layout pairs are then one object, and the
    search's memo of their bytes (int_step_full_bytes) finds them by identity, not field by field."""
    return step


def gathers_again(steps, is_param: bool) -> bool:
    """Is a tensor that `steps` gather kept as its shard and gathered again when backward reads it?

    A weight (FSDP): whenever a step all-gathers it; the other steps are local cuts
    or casts, made again with it. An activation (Megatron's sequence parallelism:
    the sequence-split norm output gathered for a column-parallel linear): only
    when every step all-gathers, so the rerun moves what forward moved and
    nothing else (an all-reduce or all-to-all is not repeated to save memory).
    """
    kinds = [s.forward_kind for s in steps]
    if is_param:
        return ALL_GATHER in kinds
    return bool(kinds) and all(k == ALL_GATHER for k in kinds)


@dataclass(frozen=True)
class Collective:
    """One collective a plan launches per step: what, on which axis, how many bytes."""
    kind: str
    axis: int
    full_bytes: object   # bytes of the tensor whole along `axis` (int or sympy)
    phase: str           # "forward" | "backward"
    where: str           # the node it feeds
    tensor: str = ""     # the node whose output it moves (a parameter's placeholder for weights)


def step_collectives(step: Step, shape: Sequence, itemsize: int, axis_sizes: Sequence[int],
                     where: str, regather: int = 0, tensor: str = "") -> list[Collective]:
    """The collectives one step launches. `regather`: how many times it is gathered again in backward."""
    out = []
    if step.forward_kind in COMMUNICATING:
        fb = step_full_bytes(step, shape, itemsize, axis_sizes)
        out.append(Collective(step.forward_kind, step.axis, fb, "forward", where, tensor))
        if step.forward_kind == ALL_GATHER:
            out += [Collective(ALL_GATHER, step.axis, fb, "backward", where, tensor) for _ in range(int(regather))]
    if step.backward_kind in COMMUNICATING:
        out.append(Collective(step.backward_kind, step.axis, step_full_bytes(step, shape, itemsize, axis_sizes),
                              "backward", where, tensor))
    return out


@functools.lru_cache(maxsize=1 << 16)
def int_step_full_bytes(step: Step, shape: tuple, itemsize: int, axis_sizes: tuple) -> int:
    """step_full_bytes at sizes that are ints (memoised: the search asks it of ~200k steps a plan, most
    of them alike)."""
    return step_full_bytes(step, shape, itemsize, axis_sizes)


def step_full_bytes(step: Step, shape: Sequence, itemsize: int, axis_sizes: Sequence[int]):
    """Bytes of the tensor whole along the step's axis; where the step splits it, n pieces of the largest
    shard: the padded buffer a split that does not divide moves (placement.py)."""
    for placements in (step.before, step.after):
        if is_shard(placements[step.axis]):
            return numel(local_shape(shape, placements, axis_sizes)) * axis_sizes[step.axis] * itemsize
    return numel(local_shape(shape, step.before, axis_sizes)) * itemsize
