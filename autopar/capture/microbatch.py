"""A microbatch's capture for planning, derived from the whole batch's without tracing again.

A pipelined plan is made for the graph of one microbatch (planner.plan_captured's `recapture`).
A capture is symbolic: with a dynamic batch, the graph and every shape expression are the same
at any batch export allows, and only the example sizes (`Captured.hints`, each TensorMeta's
`hint`) differ. So the microbatch's capture is the whole batch's with the batch symbol's example
size changed and every hint evaluated again from its shape -- what `capture` itself computes.

`at_batch` returns None wherever that is not provably what torch.export would give at that size;
the caller then captures again. The derived capture plans; it does not run: its `exported`, and
the fake tensors in its graph's `meta["val"]`, are the whole batch's (planning reads of those
only the parameters' requires_grad, which tensors share storage and their number of dims, none of
which depends on the batch).
"""
from __future__ import annotations

import dataclasses

import sympy

from .export import Captured, TensorMeta

# ops that check sizes at run time (export's deferred guards): a condition true at the traced batch
# may be false at another, where export would have refused or specialized
_RUNTIME_ASSERTS = ("aten._assert_scalar", "aten.sym_constrain_range", "aten._assert_async")


def microbatch_of(cap: Captured, m: int) -> Captured | None:
    """`cap` at 1/m of its batch, as capturing it with api.microbatch_inputs' inputs would give it (every
    tensor input's first size // m), or None where that needs a capture of its own."""
    symbol = _input_batch_symbol(cap)
    if symbol is None:
        return None
    return at_batch(cap, symbol, cap.hints[symbol] // m)


def at_batch(cap: Captured, symbol: sympy.Symbol, size: int) -> Captured | None:
    """`cap` with the batch `symbol` at example size `size`: the same graph, `hints` and every TensorMeta's
    hint evaluated at the new size. None when it might differ from a capture at that size:
    - `symbol` is not dim 0 of every tensor input, plain, and in no other input dim (a microbatch cuts
      dim 0 of every input and nothing else);
    - `size` is below 2 (export specializes sizes 0 and 1: a capture there is static) or outside the
      sizes export allows the symbol (`Captured.ranges`, none known: refused);
    - the graph checks sizes at run time (a guard export deferred, which may fail at `size`);
    - a shape has a symbol with no example size (data-dependent), or does not evaluate to a size."""
    if symbol not in cap.hints or symbol not in cap.ranges or _input_batch_symbol(cap) != symbol or size < 2:
        return None
    least, most = cap.ranges[symbol]
    if (least is not None and size < least) or (most is not None and size > most):
        return None
    if any(str(node.target).startswith(_RUNTIME_ASSERTS) for node in cap.graph.nodes):
        return None
    hints = {**cap.hints, symbol: size}
    sized = _Sizes(hints)
    info = {}
    for name, node_info in cap.info.items():
        meta = sized.meta(node_info.meta)
        if meta is _REFUSED:
            return None
        info[name] = node_info if meta is node_info.meta else dataclasses.replace(node_info, meta=meta)
    return dataclasses.replace(cap, info=info, hints=hints)


def _input_batch_symbol(cap: Captured) -> sympy.Symbol | None:
    """The symbol that is dim 0 of every tensor input and appears in no other dim of any input; None if
    there is no such one (a static batch, one export specialized, inputs whose batches vary apart)."""
    metas = [cap.info[n].meta for n in cap.input_names]
    tensors = [m for m in metas if isinstance(m, TensorMeta) and m.ndim > 0]
    if not tensors:
        return None
    first = tensors[0].shape[0]
    if not isinstance(first, sympy.Symbol) or any(m.shape[0] != first for m in tensors):
        return None
    if any(first in d.free_symbols for m in tensors for d in m.shape[1:]):
        return None
    return first


_REFUSED = object()   # a shape that does not evaluate to a size at the new hints


@dataclasses.dataclass
class _Sizes:
    """TensorMetas re-sized at `hints`; each shape expression evaluated once (a model repeats few)."""
    hints: dict
    done: dict = dataclasses.field(default_factory=dict)   # expression -> its size, or _REFUSED

    def meta(self, meta):
        if isinstance(meta, list):
            out = [self.meta(m) for m in meta]
            return _REFUSED if any(m is _REFUSED for m in out) else out
        if not isinstance(meta, TensorMeta) or all(not d.free_symbols for d in meta.shape):
            return meta   # None, or static: the same at any batch
        hint = tuple(self.size(d) for d in meta.shape)
        if any(h is _REFUSED for h in hint):
            return _REFUSED
        return meta if hint == meta.hint else TensorMeta(meta.shape, hint, meta.dtype)

    def size(self, expr):
        if expr not in self.done:
            self.done[expr] = _evaluated(expr, self.hints)
        return self.done[expr]


def _evaluated(expr, hints: dict):
    if not expr.free_symbols <= set(hints):   # a size with no example value: capture read torch's hint
        return _REFUSED
    value = sympy.sympify(expr.xreplace(hints))   # a bare symbol is replaced by the int itself
    if not value.is_Integer or value < 0:
        return _REFUSED
    return int(value)
