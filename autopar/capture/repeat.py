"""Capture a deep stack by tracing a shallow copy and repeating its block.

torch.export takes time in proportion to depth (seconds for 80 layers), yet a
stack's layers run the same code on different weights. So `capture_repeated`
traces the model with each stack cut to its first TRACED layers, checks on
that graph that the last traced block repeats the one before it (same ops,
arguments, shapes, and the same wiring to its predecessor), and writes the
remaining blocks as copies of the last one, named as torch.export names
them. The result equals `capture` of the whole model node for node.

Three layers, because block 0 may differ from the rest (it reads the prefix,
not a previous block), and blocks 1 and 2 then show both the repeat and how a
block reads the one before it.

The assumption: layers of one class with the same parameters, buffers and
submodules run the same code. A model whose layers differ in a way these do
not show (a per-layer switch in its config, e.g. full attention on every
fourth layer only) must be captured whole: `autopar.plan(trace_every_layer=True)`.
Wherever the shallow graph contradicts the assumption, the whole model is
captured anyway.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging

import torch
import torch.fx as fx
from torch import nn

from .._compat import storage_id, symint_hint, trace_lock
from ..errors import CaptureError
from .cache import cached_capture
from .export import AUTO, BUFFER, OP, PARAM, Captured, canonical_names, capture, frozen_params
from .gc_paused import gc_paused
from .traced_layers import (TRACED, NotRepeated, TracedLayers, check_repeat, moved_name, name_strides, placeholder_name,
                            renamed_block, section_of, split_name, traced_blocks)

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class RepeatedProgram:
    """What a repeated capture holds in place of the whole model's ExportedProgram.

    Planning reads only `state_dict` (which parameters train). It cannot run
    the model: `parallelize` captures the whole model, as running needs.
    """
    traced: torch.export.ExportedProgram | None   # the program of the shortened model (None: from the cache)
    state_dict: dict                        # the whole model's parameters and buffers, by name


def capture_repeated(model: nn.Module, example_inputs, dynamic_shapes=AUTO, example_kwargs=None) -> Captured:
    """`capture(model, example_inputs, dynamic_shapes, example_kwargs)` for planning, in the time a model with
    TRACED layers per stack takes to trace.

    The stacks are cut short in place while the model is traced (under the
    trace lock) and restored after. A model whose graph does not show a repeat
    is captured whole. The result's `exported` is a RepeatedProgram: it plans,
    it does not run.
    """
    if not isinstance(example_inputs, tuple):
        example_inputs = (example_inputs,)
    stacks = find_stacks(model)
    if not stacks:
        # a model without a stack is traced whole, and kept in the cache all the same: a small model's
        # export (1-2 s for the README's 2-layer GPT) is most of its plan's time
        cap = cached_capture(capture, model, example_inputs, dynamic_shapes, example_kwargs)
        if cap.exported is not None:   # traced now: the capture as it came
            return cap
        return _planning_only(cap, model)
    try:
        with gc_paused():
            # under the trace lock: another thread's capture must not see the shortened model
            with trace_lock, _shortened(model, stacks):
                cap = cached_capture(capture, model, example_inputs, dynamic_shapes, example_kwargs)
            for path, length in stacks.items():
                cap = expand_stack(cap, path, length)
        _check_tensors(cap, model)
    except (CaptureError, NotRepeated) as e:   # a shortened model that does not trace is no verdict
        log.debug("capturing %s layer by layer: %s", type(model).__name__, e)
        return capture(model, example_inputs, dynamic_shapes, example_kwargs)
    return _planning_only(cap, model)


def _planning_only(cap: Captured, model: nn.Module) -> Captured:
    """`cap` with a RepeatedProgram for its program: the whole model's state, for planning only."""
    state = dict(model.named_parameters(remove_duplicate=False))
    state.update(model.named_buffers(remove_duplicate=False))
    # the copied layers' weights are frozen as the whole model's are (the shortened model named only its own)
    return dataclasses.replace(cap, exported=RepeatedProgram(cap.exported, state), frozen_params=frozen_params(model))


# --------------------------------------------------------------------------- stacks in the model

def find_stacks(model: nn.Module) -> dict[str, int]:
    """Module path -> number of layers, for each list of more than TRACED layers that look alike."""
    out = {}
    for path, module in model.named_modules():
        if type(module) not in (nn.ModuleList, nn.Sequential) or len(module) <= TRACED:
            continue
        # a block is named by the outermost numbered segment of its path (blocks.py): a list
        # inside a numbered path is part of an outer block, and the root has no parent to edit
        if not path or any(part.isdigit() for part in path.split(".")):
            continue
        # named_children skips a layer listed twice (shared weights)
        if [name for name, _ in module.named_children()] != [str(i) for i in range(len(module))]:
            continue
        if len({_layout(layer) for layer in module}) == 1:
            out[path] = len(module)
    return out


def _layout(layer: nn.Module) -> tuple:
    """What two layers must share to be taken for repeats: module classes and modes, tensors."""
    modules = tuple((name, type(m), m.training) for name, m in layer.named_modules())
    params = tuple((name, tuple(p.shape), p.dtype, p.requires_grad)
                   for name, p in layer.named_parameters(remove_duplicate=False))
    buffers = tuple((name, tuple(b.shape), b.dtype) for name, b in layer.named_buffers(remove_duplicate=False))
    return modules, params, buffers


@contextlib.contextmanager
def _shortened(model: nn.Module, stacks: dict[str, int]):
    """The model with each stack cut to its first TRACED layers, restored on exit.

    The lists are swapped in place rather than the model copied: it may be huge.
    """
    swapped = []
    try:
        for path in stacks:
            parent_path, _, name = path.rpartition(".")
            parent = model.get_submodule(parent_path)
            whole = getattr(parent, name)
            first = list(whole)[:TRACED]
            swapped.append((parent, name, whole))
            setattr(parent, name, nn.ModuleList(first) if type(whole) is nn.ModuleList else nn.Sequential(*first))
        yield
    finally:
        for parent, name, whole in reversed(swapped):
            setattr(parent, name, whole)


def _check_tensors(cap: Captured, model: nn.Module) -> None:
    """The expanded graph has a placeholder for each of the model's parameters and buffers, and
    ties the same ones (a layer tied to something the shortened model lacks is not a repeat)."""
    canonical = canonical_names(model)   # capture's own rule for tied names, so the two agree
    aliases = {a: c for a, c in canonical.items() if a != c}
    if aliases != cap.aliases:
        raise NotRepeated("parameters tied across a stack")
    for kind, named in ((PARAM, model.named_parameters()), (BUFFER, model.named_buffers())):
        have = {i.target_name for i in cap.info.values() if i.kind == kind}
        if have != {canonical[n] for n, _ in named}:
            raise NotRepeated(f"the expanded graph's {kind}s are not the model's")


# --------------------------------------------------------------------------- names


# --------------------------------------------------------------------------- the expanded graph

class CopiedStorages:
    """Storages for the copies' traced tensors.

    The activation model reads which tensors share a storage from the traced
    (fake) tensors; a copied layer must not share layer 2's. A tensor whose
    storage was made in a layer gets the storage of the same tensor `shift`
    layers on: a traced one, or a new one made once per copy.

    A copy is a meta tensor of the traced example's sizes, not a fake tensor of
    symbolic sizes: planning reads of a copy's value only that it is a tensor
    and which storage it shares (its symbolic shape is in `Captured.info`,
    taken from the template), and a view of a fake tensor costs ~5 ms of
    symbolic arithmetic, which thousands of copies (80 layers) make seconds.
    """

    def __init__(self, cap: Captured, traced: TracedLayers):
        self.traced = traced
        self.owner: dict = {}   # storage id -> (node name, tuple index) that made it
        self.holders: dict = {}  # storage id -> how many traced tensors hold it
        for node in cap.graph.nodes:
            for k, t in _tensors(node.meta.get("val")):
                sid = storage_id(t)
                self.owner.setdefault(sid, (node.name, k))
                self.holders[sid] = self.holders.get(sid, 0) + 1
        self.made: dict = {}    # (block, position, tuple index) -> a tensor on that storage

    def moved(self, val, shift: int):
        if shift == 0 or val is None:
            return val
        if isinstance(val, torch.Tensor):
            return self._moved_tensor(val, shift)
        if isinstance(val, (list, tuple)):
            return type(val)(self.moved(v, shift) if isinstance(v, torch.Tensor) else v for v in val)
        return val   # a SymInt or a Python value is the same in every layer

    def _moved_tensor(self, t: torch.Tensor, shift: int) -> torch.Tensor:
        sid = storage_id(t)
        name, k = self.owner[sid]
        if name not in self.traced.where:
            return t   # made outside the stack: every layer reads the same storage
        block, j = self.traced.where[name]
        key = (block + shift, j, k)
        if key[0] < TRACED:   # moved onto a traced layer: a view of that layer's own (fake) tensor
            base = _element(self.traced.blocks[key[0]][j].meta["val"], k)
            _check_dtype(base, t)
            return base.as_strided(t.shape, t.stride(), t.storage_offset())
        shape, stride, offset = _example_layout(t)
        if self.holders[sid] == 1 and offset == 0:   # no view shares it: a new one will do
            return torch.empty_strided(shape, stride, dtype=t.dtype, device="meta")
        if key not in self.made:
            maker = _element(self.traced.blocks[block][j].meta["val"], k)
            num_bytes = _example_size(maker.untyped_storage().nbytes())
            self.made[key] = torch.empty((num_bytes // maker.itemsize,), dtype=maker.dtype, device="meta")
        base = self.made[key]
        _check_dtype(base, t)
        return base.as_strided(shape, stride, offset)


def _check_dtype(base: torch.Tensor, view: torch.Tensor) -> None:
    if base.dtype != view.dtype:
        raise NotRepeated("a view of another dtype in a layer")


def _example_size(x) -> int:
    """A size as traced: an int, or a symbolic size's example value."""
    if isinstance(x, int):
        return x
    try:
        return symint_hint(x)
    except TypeError:   # an unbacked size (data-dependent) has none; capture() itself cannot read such a shape
        raise NotRepeated(f"a size in a layer with no example value: {x}") from None


def _example_layout(t: torch.Tensor) -> tuple:
    """(sizes, strides, storage offset) of a traced tensor, at the example's sizes."""
    return (tuple(_example_size(d) for d in t.shape), tuple(_example_size(d) for d in t.stride()),
            _example_size(t.storage_offset()))


def _tensors(val):
    if isinstance(val, torch.Tensor):
        return [(None, val)]
    if isinstance(val, (list, tuple)):
        return [(k, v) for k, v in enumerate(val) if isinstance(v, torch.Tensor)]
    return []


def _element(val, k):
    return val if k is None else val[k]


def expand_stack(cap: Captured, stack: str, length: int) -> Captured:
    """`cap` with `stack`'s traced layers extended to `length` by copies of its last one."""
    traced = traced_blocks(cap, stack)
    check_repeat(cap, stack, traced)
    strides = name_strides(traced)
    last = traced.blocks[TRACED - 1]
    top = {}   # op name base -> its highest counter in the last traced layer
    for node in last:
        base, num = split_name(node.name)
        if base in strides:
            top[base] = max(top.get(base, 0), num)
    templates = _layer_templates(cap, last)
    out = _Expansion(cap, stack, traced, CopiedStorages(cap, traced))
    after = False   # past the stack's last op: what follows reads the last layer, names move on
    for template in cap.graph.nodes:
        name = template.name
        if after and template.op not in ("placeholder", "output"):
            base, num = split_name(name)
            if num <= top.get(base, -1):
                raise NotRepeated(f"{name} follows {stack!r} but is numbered as if before its last layer")
            name = moved_name(name, strides, length - TRACED)
        out.env[template.name] = out.emit(template, name, length - TRACED if after else 0, None)
        # after the last traced layer's parameters, buffers, ops: those of the layers not traced
        for block in range(TRACED, length) if template.name in traced.ends else ():
            out.copy_section(templates[traced.ends[template.name]], block, strides)
        after = after or template.name == traced.last_op
    return Captured(cap.exported, out.graph, out.info, cap.symbols, cap.hints, list(cap.input_names),
                    list(cap.input_keys), dict(cap.constant_inputs), dict(cap.aliases), dict(cap.ranges))


def _layer_templates(cap: Captured, last: tuple) -> dict:
    """Section (PARAM / BUFFER / OP) -> [(position in the last traced layer, node)]: what each copy repeats."""
    templates: dict = {}
    for j, node in enumerate(last):
        templates.setdefault(section_of(cap, node), []).append((j, node))
        node_info = cap.info[node.name]
        if node.op == "placeholder" and node.name != placeholder_name(node_info.kind, node_info.target_name):
            raise NotRepeated(f"{node.name} is not named after {node_info.target_name}")
    return templates


@dataclasses.dataclass
class _Expansion:
    """The expanded graph as expand_stack builds it, node by node."""
    cap: Captured
    stack: str
    traced: TracedLayers
    storages: CopiedStorages
    graph: fx.Graph = dataclasses.field(default_factory=fx.Graph)
    info: dict = dataclasses.field(default_factory=dict)     # node name -> NodeInfo
    copies: dict = dataclasses.field(default_factory=dict)   # (block, position) -> node, for the copied layers
    env: dict = dataclasses.field(default_factory=dict)      # node name in cap -> node of the expanded graph

    def lookup(self, shift: int):
        """A node `shift` layers on from the node an argument names (itself outside the stack)."""
        traced = self.traced

        def to_new(x: fx.Node) -> fx.Node:
            if shift and x.name in traced.where:
                b, j = traced.where[x.name]
                return self.copies[(b + shift, j)] if b + shift >= TRACED else self.env[traced.blocks[b + shift][j].name]
            return self.env[x.name]
        return to_new

    def emit(self, template: fx.Node, name: str, shift: int, block: int | None) -> fx.Node:
        """`template` moved on `shift` layers (its arguments, tensors, and when it is a copy of
        layer `block`, its module path and parameter name)."""
        args = fx.node.map_arg(template.args, self.lookup(shift))
        kwargs = fx.node.map_arg(template.kwargs, self.lookup(shift))
        target = name if template.op == "placeholder" else template.target
        # made bare, then wired: create_node walks an op's arguments for raw symbolic sizes to warn of, which
        # the template's were checked for when traced, and thousands of copies make that a third of a second
        node = self.graph.create_node(template.op, target, name=name, type_expr=template.type)
        if node.name != name:
            raise NotRepeated(f"{name} would clash with another node's name")
        if kwargs:
            node.kwargs = kwargs
        if args:
            node.args = args
        node.meta = dict(template.meta)
        node.meta["val"] = self.storages.moved(template.meta.get("val"), shift)
        node_info = self.cap.info[template.name]
        if block is not None:
            node_info = dataclasses.replace(node_info,
                                            module_path=renamed_block(node_info.module_path, self.stack, block),
                                            target_name=renamed_block(node_info.target_name, self.stack, block))
            if "nn_module_stack" in node.meta:
                node.meta["nn_module_stack"] = _moved_module_stack(node.meta["nn_module_stack"], self.stack, block)
        if node_info.kind == OP and shift:
            reads = tuple(self.info[a.name].target_name for a in node.all_input_nodes
                          if self.info[a.name].kind == PARAM)
            node_info = dataclasses.replace(node_info, params_read=reads)
        self.info[node.name] = node_info
        return node

    def copy_section(self, templates: list, block: int, strides: dict) -> None:
        """Layer `block`'s copies of one section of the last traced layer."""
        shift = block - (TRACED - 1)
        for j, t in templates:
            t_info = self.cap.info[t.name]
            if t.op == "placeholder":
                name = placeholder_name(t_info.kind, renamed_block(t_info.target_name, self.stack, block))
            else:
                name = moved_name(t.name, strides, shift)
            self.copies[(block, j)] = self.emit(t, name, shift, block)


def _moved_module_stack(module_stack: dict, stack: str, block: int) -> dict:
    """nn_module_stack's paths moved to layer `block` (its keys are left as traced; nothing reads them)."""
    return {key: (renamed_block(entry[0], stack, block),) + tuple(entry[1:])
            if isinstance(entry, tuple) and entry and isinstance(entry[0], str) else entry
            for key, entry in module_stack.items()}
