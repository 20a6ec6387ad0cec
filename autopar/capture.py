"""Capture: torch.export (non-strict, training IR) of a model into an fx graph.

Per node we keep what later stages need and nothing torch-internal: the shape
as sympy expressions (dims marked dynamic become symbols named after their
torch.export.Dim), the dtype, the module path the node came from, and which
parameter or buffer a placeholder is.
"""
from __future__ import annotations

import traceback
from dataclasses import dataclass, field
from typing import Any

import sympy
import torch
import torch.fx as fx

from ._private import symint_expr, symint_hint, trace_lock
from .errors import CaptureError

PARAM, BUFFER, INPUT, CONSTANT, OP, OUTPUT = "param", "buffer", "input", "constant", "op", "output"


@dataclass(frozen=True)
class TensorMeta:
    shape: tuple          # sympy expressions (Integer for static dims)
    hint: tuple[int, ...]  # the example's sizes, for search and divisibility checks
    dtype: torch.dtype

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize


@dataclass
class NodeInfo:
    kind: str                       # PARAM | BUFFER | INPUT | CONSTANT | OP | OUTPUT
    module_path: str                # e.g. "blocks.0.attn.q" ("" for the root)
    target_name: str | None = None  # FQN of the parameter/buffer a placeholder is
    meta: Any = None                # TensorMeta, list of TensorMeta (tuple output), or None
    params_read: tuple = ()         # FQNs of the parameters an op takes as direct inputs


@dataclass
class Captured:
    exported: torch.export.ExportedProgram
    graph: fx.Graph
    info: dict[str, NodeInfo]
    symbols: dict[str, sympy.Symbol]        # Dim name -> symbol
    hints: dict[sympy.Symbol, int]          # symbol -> example size
    input_names: list[str] = field(default_factory=list)  # user-input placeholders, in order
    aliases: dict[str, str] = field(default_factory=dict)   # tied parameter name -> canonical name

    def nodes(self):
        return self.graph.nodes

    def node(self, name: str) -> fx.Node:
        return self._by_name[name]

    def __post_init__(self):
        self._by_name = {n.name: n for n in self.graph.nodes}


def _module_path(node: fx.Node) -> str:
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return ""
    path = list(stack.values())[-1][0]
    # export prefixes paths with "L['self']." in some versions
    return path.replace("L['self'].", "").replace("L['self']", "")


def _dim_names(dynamic_shapes, example_inputs) -> dict[tuple[int, int], str]:
    """(input index, dim) -> Dim name, from a torch.export dynamic_shapes spec."""
    if dynamic_shapes is None:
        return {}
    specs = list(dynamic_shapes.values()) if isinstance(dynamic_shapes, dict) else list(dynamic_shapes)
    names = {}
    for i, spec in enumerate(specs):
        if isinstance(spec, dict):
            items = spec.items()
        elif isinstance(spec, (list, tuple)):
            items = enumerate(spec)
        else:
            continue
        for d, dim in items:
            name = getattr(dim, "__name__", None)
            if name:
                names[(i, d)] = name
    return names


def capture(model: torch.nn.Module, example_inputs: tuple, dynamic_shapes=None) -> Captured:
    """Export `model` and annotate every node. Raises CaptureError naming the cause."""
    if not isinstance(example_inputs, tuple):
        example_inputs = (example_inputs,)
    try:
        with trace_lock:  # export keeps module-level state: one trace at a time per process
            ep = torch.export.export(model, example_inputs, dynamic_shapes=dynamic_shapes, strict=False)
    except Exception as e:  # export raises many types; the user needs cause + place
        raise CaptureError(_explain_export_failure(model, e)) from e

    sig = ep.graph_signature
    canonical = _canonical_names(model)
    kinds = {}
    for spec in sig.input_specs:
        name = spec.arg.name if hasattr(spec.arg, "name") else None
        kind = {"PARAMETER": PARAM, "BUFFER": BUFFER, "USER_INPUT": INPUT,
                "CONSTANT_TENSOR": CONSTANT}.get(spec.kind.name, CONSTANT)
        kinds[name] = (kind, canonical.get(spec.target, spec.target))
    for spec in sig.output_specs:
        if spec.kind.name != "USER_OUTPUT":
            raise CaptureError(
                f"the model mutates buffer {spec.target!r} in forward (e.g. BatchNorm running stats); "
                "autopar cannot shard a model that updates buffers yet: put such modules in eval mode "
                "or replace them (e.g. LayerNorm)")

    graph = ep.graph
    dim_names = _dim_names(dynamic_shapes, example_inputs)
    input_nodes = [n for n in graph.nodes if n.op == "placeholder" and kinds.get(n.name, (None,))[0] == INPUT]
    rename: dict[sympy.Symbol, sympy.Symbol] = {}
    hints: dict[sympy.Symbol, int] = {}
    for i, node in enumerate(input_nodes):
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            continue
        for d, s in enumerate(val.shape):
            if isinstance(s, torch.SymInt):
                expr = symint_expr(s)
                if isinstance(expr, sympy.Symbol) and expr not in rename:
                    name = dim_names.get((i, d), str(expr))
                    sym = sympy.Symbol(name, integer=True, positive=True)
                    rename[expr] = sym
                    hints[sym] = int(example_inputs[i].shape[d])

    def to_meta(val):
        if isinstance(val, torch.Tensor):
            shape, hint = [], []
            for s in val.shape:
                if isinstance(s, torch.SymInt):
                    e = symint_expr(s).xreplace(rename)
                    shape.append(e)
                    hint.append(int(e.xreplace(hints)) if e.free_symbols <= set(hints) else symint_hint(s))
                else:
                    shape.append(sympy.Integer(int(s)))
                    hint.append(int(s))
            return TensorMeta(tuple(shape), tuple(hint), val.dtype)
        if isinstance(val, (list, tuple)) and val and all(isinstance(v, torch.Tensor) for v in val):
            return [to_meta(v) for v in val]
        return None

    info = {}
    for node in graph.nodes:
        if node.op == "placeholder":
            kind, target = kinds.get(node.name, (CONSTANT, None))
            info[node.name] = NodeInfo(kind, _owner_path(target) if target else "", target, to_meta(node.meta.get("val")))
        elif node.op == "output":
            info[node.name] = NodeInfo(OUTPUT, "", None, None)
        else:
            reads = tuple(info[a.name].target_name for a in node.all_input_nodes
                          if a.name in info and info[a.name].kind == PARAM)
            info[node.name] = NodeInfo(OP, _module_path(node), None, to_meta(node.meta.get("val")), reads)
    symbols = {str(s): s for s in hints}
    aliases = {a: c for a, c in canonical.items() if a != c}
    return Captured(ep, graph, info, symbols, hints, [n.name for n in input_nodes], aliases)


def _canonical_names(model: torch.nn.Module) -> dict[str, str]:
    """Every parameter/buffer name -> the name torch lists first for that tensor.

    Tied weights (GPT-2's embedding and output head) are one tensor under two
    names; export names it by either. autopar uses the name `named_parameters()`
    yields, so plans, optimizers and checkpoints agree with the original model.
    """
    first, out = {}, {}
    for name, t in list(model.named_parameters(remove_duplicate=False)) + list(
            model.named_buffers(remove_duplicate=False)):
        out[name] = first.setdefault(id(t), name)
    return out


def _owner_path(fqn: str) -> str:
    return fqn.rsplit(".", 1)[0] if "." in fqn else ""


def _explain_export_failure(model: torch.nn.Module, err: Exception) -> str:
    """Name the cause and the module where export failed.

    torch.export re-raises from deep inside its tracer, so the user's frame is
    usually only in the message ("The following call raised this error: File
    ..., line ..."); fall back to the traceback. The file is mapped back to the
    model's module (class and path) defined there.
    """
    import inspect
    import re

    text = str(err)
    files = {}
    for name, mod in model.named_modules():
        try:
            files.setdefault(inspect.getsourcefile(type(mod)), []).append((name or "<root>", type(mod).__name__))
        except (TypeError, OSError):
            pass
    candidates = [(f, int(l), c.strip()) for f, l, c in
                  re.findall(r'File "([^"]+)", line (\d+), in \w+\n([^\n]*)', text)]
    e = err
    while e is not None:
        candidates += [(fr.filename, fr.lineno, fr.line or "") for fr in reversed(traceback.extract_tb(e.__traceback__))]
        e = e.__cause__ or e.__context__
    where = None
    for filename, lineno, line in candidates:
        if filename in files:
            mods = files[filename]
            desc = ", ".join(f"{cls} (module {path!r})" for path, cls in mods[:3])
            where = f"{filename}:{lineno}: {line}  -- in {desc}"
            break
    cause = next((ln.strip() for ln in text.splitlines()
                  if ln.strip() and not ln.startswith((" ", "\t", "def ", "#"))), type(err).__name__)
    msg = f"torch.export could not capture {type(model).__name__}: {type(err).__name__}: {cause}"
    if where:
        msg += f"\n  where: {where}"
    msg += ("\n  what to do: make forward traceable by torch.export (no Python control flow on tensor "
            "values, no unsupported Python side effects), or pass dynamic_shapes that match how the "
            "inputs vary")
    return msg
