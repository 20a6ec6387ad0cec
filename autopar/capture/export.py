"""Capture: torch.export (non-strict, training IR) of a model into an fx graph.

Per node we keep what later stages need and nothing torch-internal: the shape
as sympy expressions (dims marked dynamic become symbols named after their
torch.export.Dim), the dtype, the module path the node came from, and which
parameter or buffer a placeholder is.
"""
from __future__ import annotations

import re
import traceback
from dataclasses import dataclass, field
from typing import Any

import sympy
import torch
import torch.fx as fx

from .._compat import symint_expr, symint_hint, trace_lock
from ..errors import CaptureError
from .caches import caches_left_out
from .causal_masks import rewrite_causal_masks
from .iota_index import rewrite_row_counts
from .losses import split_losses

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
    # per user-input placeholder, where the call passes it: a position in forward's arguments (int) or a
    # keyword (str); and the inputs that are no tensor (None, flags), which the graph has baked in
    input_keys: list = field(default_factory=list)
    constant_inputs: dict = field(default_factory=dict)
    aliases: dict[str, str] = field(default_factory=dict)   # tied parameter name -> canonical name
    ranges: dict = field(default_factory=dict)  # dynamic dim symbol -> (least, most or None) sizes allowed
    # traced with floating weights in this dtype (compute_dtype.py; None: the model's own), and the
    # dtype the model holds each parameter in (by name), which a policy's master copy defaults to
    compute_dtype: Any = None
    param_dtypes: dict = field(default_factory=dict)
    # the parameters (by name) the model did not train when captured (requires_grad False): they take no
    # gradient, no optimizer state and no gradient reduction. Read off the model (frozen_params), as a cached or
    # shortened capture's (repeat.py) values do not carry requires_grad
    frozen_params: frozenset = frozenset()

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


def _dim_names(dynamic_shapes, keys: list) -> dict[tuple[int, int], str]:
    """(user input index, dim) -> Dim name, from a torch.export dynamic_shapes spec.

    `keys`: each user input's key (input_leaves). A dict spec is keyed by forward's parameter names:
    a keyword input's spec is under its name (or inside the dict of a **kwargs parameter), and the
    positional inputs' specs are the other entries, in order."""
    if dynamic_shapes is None:
        return {}
    keywords = {k for k in keys if isinstance(k, str)}
    if isinstance(dynamic_shapes, dict):
        positional = [v for k, v in dynamic_shapes.items() if k not in keywords and not (
            isinstance(v, dict) and keywords & set(v))]
        by_keyword = {k: v for k, v in dynamic_shapes.items() if k in keywords}
        for v in dynamic_shapes.values():   # a **kwargs parameter's dict of specs
            if isinstance(v, dict) and keywords & set(v):
                by_keyword.update({k: v[k] for k in keywords & set(v)})
    else:
        positional, by_keyword = list(dynamic_shapes), {}
    names = {}
    for i, key in enumerate(keys):
        spec = by_keyword.get(key) if isinstance(key, str) else positional[key] if key < len(positional) else None
        items = spec.items() if isinstance(spec, dict) else enumerate(spec) if isinstance(spec, (list, tuple)) else ()
        for d, dim in items:
            name = getattr(dim, "__name__", None)
            if name:
                names[(i, d)] = name
    return names


def input_leaves(example_inputs: tuple, example_kwargs: dict) -> tuple[list, list, dict]:
    """The user inputs as torch.export flattens (args, kwargs): (keys, values) of those that become graph
    placeholders, in order -- tensors and Python constants other than None -- and the constants by key
    (None included: a keyword given as None has no placeholder). Keys are positions (int) or keywords (str).

    autopar takes each input as one tensor or one constant: a list or dict of tensors would need
    its structure carried through the plan's input layouts, so it is refused here, by name."""
    keys, values, constants = [], [], {}
    for key, value in [*enumerate(example_inputs), *example_kwargs.items()]:
        if isinstance(value, (list, tuple, dict)):
            what = f"keyword input {key!r}" if isinstance(key, str) else f"input {key}"
            raise CaptureError(f"{what} is a {type(value).__name__}: autopar takes each input as a tensor or a "
                               "Python constant; pass the tensors it holds as separate inputs")
        if not isinstance(value, torch.Tensor):
            constants[key] = value
            if value is None:
                continue
        keys.append(key)
        values.append(value)
    return keys, values, constants


# dynamic_shapes="auto" (the default of plan and parallelize): every dim of every tensor input may
# vary where the model allows it (torch.export's Dim.AUTO), because every user's last batch is
# smaller and evaluation sets have other lengths. None keeps every dim as in the example.
AUTO = "auto"


def _auto_dynamic_shapes(example_inputs):
    """Dim.AUTO on every dim of every tensor, in the inputs' own structure (tuples, lists, dicts)."""
    if isinstance(example_inputs, torch.Tensor):
        return {d: torch.export.Dim.AUTO for d in range(example_inputs.dim())} if example_inputs.dim() else None
    if isinstance(example_inputs, (tuple, list)):
        return type(example_inputs)(_auto_dynamic_shapes(t) for t in example_inputs)
    if isinstance(example_inputs, dict):
        return {k: _auto_dynamic_shapes(v) for k, v in example_inputs.items()}
    return None


def _auto_spec(model, example_inputs: tuple, example_kwargs: dict):
    """The "auto" spec keyed by forward's parameter names, the form export matches against the
    signature (a forward(*xs) takes one tuple, not len(xs) inputs; a forward(**kwargs) one dict)."""
    import inspect
    try:
        bound = inspect.signature(model.forward).bind(*example_inputs, **example_kwargs)
    except (TypeError, ValueError):   # no signature to read: one spec per input, in call order
        return _auto_dynamic_shapes((*example_inputs, *example_kwargs.values()))
    return {name: _auto_dynamic_shapes(value) for name, value in bound.arguments.items()}


def _auto_dim_names(values: list) -> dict[tuple[int, int], str]:
    """Names for the dims export makes dynamic on its own: "batch" for dim 0, "seq" for dim 1."""
    names = {}
    for i, t in enumerate(values):
        if isinstance(t, torch.Tensor):
            for d in range(t.dim()):
                names[(i, d)] = {0: "batch", 1: "seq"}.get(d, f"input{i}_dim{d}")
    return names


def capture(model: torch.nn.Module, example_inputs: tuple, dynamic_shapes=AUTO, example_kwargs=None) -> Captured:
    """Export `model` called as `model(*example_inputs, **example_kwargs)` and annotate every node.
    Raises CaptureError naming the cause.

    `dynamic_shapes`: as torch.export takes it, or "auto" (see AUTO)."""
    if not isinstance(example_inputs, tuple):
        example_inputs = (example_inputs,)
    example_kwargs = dict(example_kwargs or {})
    keys, values, constants = input_leaves(example_inputs, example_kwargs)
    auto = isinstance(dynamic_shapes, str) and dynamic_shapes == AUTO
    spec = _auto_spec(model, example_inputs, example_kwargs) if auto else dynamic_shapes
    ep = _export(model, example_inputs, example_kwargs, spec)
    canonical = canonical_names(model)
    kinds = _placeholder_kinds(ep, canonical)
    input_nodes = _user_inputs(ep.graph, kinds)
    if len(input_nodes) != len(keys):   # export flattened the inputs otherwise than input_leaves did
        raise CaptureError(f"torch.export made {len(input_nodes)} input placeholders of the {len(keys)} inputs "
                           f"{keys}; pass each input as one tensor or one Python constant")
    dim_names = _auto_dim_names(values) if auto else _dim_names(dynamic_shapes, keys)
    rename, hints = _dim_symbols(input_nodes, values, dim_names, merge_alike=auto)
    with trace_lock:   # it enters the export's fake mode, and mode stacks are per process
        # HF's padding mask: a gather along the batch that is a slice, where the sizes are one symbol once
        # merged (rename: the mask's batch and input_ids' are export's two symbols, checked equal per call)
        try:
            rewrite_row_counts(ep.graph, rename)
        except Exception as e:   # a pattern the rewrite misreads: say where, as _export does for export's own
            raise CaptureError(f"the padding-gather rewrite (capture/iota_index.py) failed on this model's graph: "
                               f"{type(e).__name__}: {e}") from e
    graph = _renumbered(ep.graph)
    input_nodes = _user_inputs(graph, kinds)
    info = _node_infos(graph, kinds, _MetaReader(rename, hints))
    symbols = {str(s): s for s in hints}
    ranges = {}
    for expr, vr in ep.range_constraints.items():   # the sizes export allows each dynamic dim
        if expr in rename:   # a merged symbol (_dim_symbols) takes what all its dims allow
            lo, hi = ranges.get(rename[expr], (None, None))
            lo, hi = _tighter(lo, _as_int(vr.lower), max), _tighter(hi, _as_int(vr.upper), min)
            ranges[rename[expr]] = (lo, hi)
    aliases = {a: c for a, c in canonical.items() if a != c}
    return Captured(ep, graph, info, symbols, hints, [n.name for n in input_nodes], keys, constants, aliases, ranges,
                    frozen_params=frozen_params(model))


def _export(model, example_inputs: tuple, example_kwargs: dict, dynamic_shapes):
    """torch.export's training graph, with mean losses split (losses.py), the KV caches a model
    returns left out (caches.py) and causal masks made `is_causal` (causal_masks.py); CaptureError on failure."""
    try:
        with trace_lock, caches_left_out(model):  # export keeps module-level state: one trace at a time per process
            ep = torch.export.export(model, example_inputs, example_kwargs or None, strict=False,
                                     dynamic_shapes=dynamic_shapes)
            # under the lock too: it enters the export's fake mode, and mode stacks are per process
            split_losses(ep.graph)   # before anything reads the graph: plans see the split form
            rewrite_causal_masks(ep.graph)   # a causal mask built from shapes: is_causal=True (flash attention)
    except Exception as e:  # export raises many types; the user needs cause + place
        raise CaptureError(_explain_export_failure(model, e)) from e
    return ep


def _user_inputs(graph: fx.Graph, kinds: dict) -> list:
    """The placeholders of the user's inputs, in order."""
    return [n for n in graph.nodes if n.op == "placeholder" and kinds.get(n.name, (None,))[0] == INPUT]


def _placeholder_kinds(ep, canonical: dict) -> dict:
    """Placeholder name -> (kind, canonical target name); refuses a model that mutates buffers."""
    sig = ep.graph_signature
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
    return kinds


def _dim_symbols(input_nodes: list, example_inputs: tuple, dim_names: dict,
                 merge_alike: bool = False) -> tuple[dict, dict]:
    """Export's size symbols -> ours, named after the dims (batch, seq, ...), and each one's example size.

    `merge_alike` (dynamic_shapes="auto"): dims of one name and one example size are one symbol. Export
    gives every Dim.AUTO dim a symbol of its own unless the model's code equates them, and it rarely does
    for a batch: HF's input_ids, attention_mask and labels are (batch, seq), (batch2, seq2), (batch3,
    seq3) as traced, which would leave the mask's and the labels' terms out of `max_batch` and the like.
    The module then checks at each call that such dims agree (input_shapes.py)."""
    rename: dict[sympy.Symbol, sympy.Symbol] = {}
    hints: dict[sympy.Symbol, int] = {}
    for i, node in enumerate(input_nodes):
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            continue
        for d, s in enumerate(val.shape):
            if not isinstance(s, torch.SymInt):
                continue
            expr = symint_expr(s)
            if isinstance(expr, sympy.Symbol) and expr not in rename:
                base = dim_names.get((i, d), str(expr))
                hint = int(example_inputs[i].shape[d])
                taken = {str(v): v for v in rename.values()}
                name, k = base, 1
                while name in taken and not (merge_alike and hints[taken[name]] == hint):
                    k += 1   # another dim of that name varies on its own: a symbol each
                    name = f"{base}{k}"
                sym = taken.get(name) or sympy.Symbol(name, integer=True, positive=True)
                rename[expr] = sym
                hints[sym] = hint
    return rename, hints


@dataclass
class _MetaReader:
    """A traced value's TensorMeta, its sizes in our symbols."""
    rename: dict
    hints: dict

    def __call__(self, val):
        if isinstance(val, torch.Tensor):
            shape, hint = [], []
            for s in val.shape:
                if isinstance(s, torch.SymInt):
                    e = symint_expr(s).xreplace(self.rename)
                    shape.append(e)
                    hint.append(int(e.xreplace(self.hints)) if e.free_symbols <= set(self.hints) else symint_hint(s))
                else:
                    shape.append(sympy.Integer(int(s)))
                    hint.append(int(s))
            return TensorMeta(tuple(shape), tuple(hint), val.dtype)
        if isinstance(val, (list, tuple)) and val and all(isinstance(v, torch.Tensor) for v in val):
            return [self(v) for v in val]
        return None


def _node_infos(graph: fx.Graph, kinds: dict, to_meta: _MetaReader) -> dict:
    """NodeInfo of every node: kind, module path, parameter name, meta, parameters read."""
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
    return info


def _renumbered(graph: fx.Graph) -> fx.Graph:
    """A copy whose op names count per name in graph order (linear, linear_1, ...), with no gaps.

    torch.export skips the numbers of nodes it made and erased (symbolic size arithmetic,
    differently in different layers), so alike layers would not step by alike numbers; plans
    name nodes, and capture/repeat.py names copied layers by those steps.
    """
    out = fx.Graph()
    env: dict = {}
    for node in graph.nodes:
        name = node.name
        if node.op == "call_function":
            name = re.sub(r"_\d+$", "", name)   # the namespace numbers it: base, base_1, ...
        new = out.create_node(node.op, node.target, fx.map_arg(node.args, env.get), fx.map_arg(node.kwargs, env.get),
                              name=name, type_expr=node.type)
        if node.op != "call_function":
            new.name = node.name   # as export named it (fx would rename a placeholder called `input`)
        new.meta = dict(node.meta)
        env[node] = new
    return out


def _tighter(a, b, pick):
    return b if a is None else a if b is None else pick(a, b)


def _as_int(bound):
    """A range bound as an int, None for infinity (export's own infinity does not say is_finite=False)."""
    try:
        return int(bound)
    except (TypeError, ValueError, AttributeError, OverflowError):
        return None


def frozen_params(model: torch.nn.Module) -> frozenset:
    """The names of the parameters the model does not train (requires_grad False), every alias of a tied one."""
    return frozenset(name for name, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad)


def canonical_names(model: torch.nn.Module) -> dict[str, str]:
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


# ops whose result depends on train/eval mode: the mode is baked into the graph as traced
_MODE_OPS = ("aten.dropout", "aten.native_dropout", "aten.feature_dropout", "aten.alpha_dropout",
             "aten.feature_alpha_dropout", "aten.bernoulli", "aten.rand", "aten.randn", "aten.randint",
             "aten.rrelu", "aten.batch_norm", "aten._native_batch_norm_legit", "aten.instance_norm")


def mode_dependent_ops(graph: fx.Graph) -> list[str]:
    """Names of the nodes a model's train/eval mode may have shaped (dropout, random ops, norms with
    running stats). A graph without any is the same in both modes, unless forward branches on
    `self.training` with no such op on either side."""
    out = []
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        name = str(node.target)
        if name.startswith(_MODE_OPS):
            if "dropout" in name and len(node.args) > 1 and node.args[1] == 0:
                continue   # p = 0: the same in both modes (HF configs default to it)
            out.append(node.name)
        elif name == "aten.scaled_dot_product_attention.default":
            p = node.args[4] if len(node.args) > 4 else node.kwargs.get("dropout_p", 0.0)
            if p:
                out.append(node.name)
    return out
