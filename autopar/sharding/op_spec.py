"""The vocabulary every sharding rule is written in: OpSpec (einsum-like dim letters per tensor),
the tensor arguments of a node, fresh letters, and the broadcasting elementwise spec most
rules build on.

A rule maps a node to an OpSpec: letters for the dims of each tensor input and
of the output. From that alone strategies.py derives every way to split the op
over one mesh axis:
  - split a letter: every tensor holding it splits along that dim; a letter
    that vanishes from the output (a contraction) leaves partial sums (P);
  - feed partial sums through: for an op linear in input i, P in gives P out.
Letters in `no_shard` may never be split (a softmax dim, a normalized dim, a
dim a view cannot keep whole). Writing rules this way keeps each one a line
or two and makes them testable against the unsharded op.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Callable

import torch
import torch.fx as fx

from ..capture.export import TensorMeta


@dataclass(frozen=True)
class OpSpec:
    inputs: tuple            # letters per tensor input (str), in tensor_args order
    output: str              # letters of the output (each output, for ops returning a tuple)
    no_shard: frozenset = frozenset()
    linear: tuple = ()       # inputs the op is linear in: one of them may be P (the rest R)
    additive: tuple = ()     # inputs added into the output: P whenever the output is P
    replicate_only: bool = False  # no strategy but all-R (factories, unknown ops)
    # (rows letter, keys letter): both split together on one axis, where the op runs as a ring that passes
    # the keys round (attention; runtime/lowering/ring_attention.py); the output splits with the rows
    ring: tuple = ()


def tensor_args(node: fx.Node) -> list[fx.Node]:
    """The node's tensor inputs in argument order, duplicates kept (add(x, x) has two)."""
    out = []

    def visit(a):
        if isinstance(a, fx.Node):
            if _is_tensor_node(a):
                out.append(a)
        elif isinstance(a, (list, tuple)):
            for x in a:
                visit(x)
        elif isinstance(a, dict):
            for x in a.values():
                visit(x)
    visit(node.args)
    visit(node.kwargs)
    return out


def _is_tensor_node(n: fx.Node) -> bool:
    v = n.meta.get("val")
    return isinstance(v, torch.Tensor) or (isinstance(v, (list, tuple)) and bool(v) and isinstance(v[0], torch.Tensor))


class Letters:
    """Hands out fresh dim letters."""
    def __init__(self):
        self.i = 0

    def __call__(self, k: int = 1) -> str:
        chars = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789αβγδεζηθικλμνξοπρστυφχψω"
        s = chars[self.i:self.i + k]
        self.i += k
        return s


def op_arg(node: fx.Node, pos: int, name: str, default):
    """Argument `name` of an aten call, given by position or keyword, or its default."""
    if len(node.args) > pos:
        return node.args[pos]
    return node.kwargs.get(name, default)


def wrap_dim(d: int, ndim: int) -> int:
    """A dim argument as aten takes it (negative from the end) -> its index; 0 for a scalar."""
    return d % ndim if ndim else 0


def elementwise(node, ins: list[TensorMeta], out: TensorMeta, linear=(), additive=()) -> OpSpec:
    """Broadcasting elementwise op: input dims line up with output dims from the right."""
    new = Letters()
    out_l = new(out.ndim)
    no_shard, in_l = set(), []
    for m in ins:
        s = ""
        for j in range(m.ndim):
            od = out.ndim - m.ndim + j
            if m.hint[j] == out.hint[od]:
                s += out_l[od]
            else:  # broadcast size-1 dim: it cannot be split
                c = new()
                no_shard.add(c)
                s += c
        in_l.append(s)
    # a Python scalar operand breaks linearity of add (P + c adds c on every rank)
    if additive and len(ins) < _num_operands(node):
        additive, linear = (), ()
    return OpSpec(tuple(in_l), out_l, frozenset(no_shard), tuple(linear), tuple(additive))


def _num_operands(node) -> int:
    return sum(1 for a in node.args[:2] if not isinstance(a, (str, type(None))))


def op_name(node: fx.Node) -> str:
    """'aten.linear.default', '_operator.getitem', ... — the key into RULES."""
    t = node.target
    if t is operator.getitem:
        return "_operator.getitem"
    return str(t)


Rule = Callable[[fx.Node, list, TensorMeta], OpSpec]
