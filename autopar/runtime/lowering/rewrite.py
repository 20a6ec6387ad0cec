"""Rewrite: the captured graph -> this rank's local fx.GraphModule.

Every tensor edge whose producer layout differs from what the consumer's
strategy needs gets a `RedistributeModule` (a call_module node, so it shows
up by name in `print(gm.code)`); shape arguments of views are divided by the
split of the output dim; `sym_size` reads of a local tensor are multiplied
back to the global size, so all integer arithmetic in the graph stays in
global terms, as it was traced.
"""
from __future__ import annotations

import bisect
import operator

import torch
import torch.fx as fx
from torch.utils.checkpoint import checkpoint

from ...capture.export import PARAM, Captured
from ...errors import PlanError
from ...sharding.local_ops import PLAIN
from ...sharding.op_spec import op_name, tensor_args
from ...sharding.placement import R
from ...sharding.redistribute import NONE, gathers_again
from ..collectives import CastAndRedistribute, Comm, Redistribute, forward_phase, scale_grad, transform
from ..reduction.layer_groups import GroupGather, LayerGroup, in_flight
from .recompute import CheckpointRegion, outline, recompute_all_but_logging
from .regather import GatheredParams
from ..rng import RandomOp, shard_key
from .float8 import Float8InputScale, Float8Linear
from .local_ops import run_local
from .ring_attention import ring_attention
from .vocab_parallel import vocab_parallel_loss

VIEW_OPS = {"aten.view.default", "aten._unsafe_view.default"}
SQUEEZE_OPS = {"aten.squeeze.default", "aten.squeeze.dim", "aten.squeeze.dims"}
DROPPED_OPS = {"aten._assert_tensor_metadata.default"}  # checks global metadata a local shard fails


class RedistributeModule(torch.nn.Module):
    """The steps of one layout change. `wholes`: per step, the length of the dim it splits or gathers
    (a parameter's may not divide: placement.py), or None to take it from the local shard."""

    def __init__(self, steps, comm: Comm, label: str, gathered: GatheredParams | None = None, wholes=None,
                 cast=None):
        super().__init__()
        self.steps, self.comm, self.label, self.gathered = steps, comm, label, gathered
        self.wholes = tuple(wholes or (None,) * len(steps))
        # (compute dtype, reduce dtype) for a weight stored in the master dtype (mixed precision), else None
        self.cast = cast
        self.group, self.group_index = None, None   # the FSDP layer group it gathers with (layer_groups.py)
        # with `gathered`: an activation, not a weight, so what backward keeps of it is activation memory
        self.activation = False

    def forward(self, x):
        if torch.compiler.is_dynamo_compiling():
            return self._compiled(x)
        local = x
        if self.group is not None:
            phase = forward_phase()
            if phase != "recompute" and torch.is_grad_enabled() and x.requires_grad:
                self.group.used(self.group_index)   # (a recompute's gradient never reaches the group)
            x = GroupGather.apply(x, self.group, self.group_index, phase)
            for s, whole in zip(self.steps[1:], self.wholes[1:]):   # local cuts (groupable); the group sums
                if s.forward_kind != NONE:
                    x = Redistribute.apply(x, s, self.comm, whole)
        else:
            x = self._steps(x)
        if self.gathered is not None:
            self.gathered.register(x, local.detach(), self)
        return x

    def _compiled(self, x):
        """Under torch.compile: the steps alone, each collective a functional one in the graph, and no Python
        state. The layer group (one flat gather per layer, its reduce-scatter set at the end of backward) and
        the saved-tensor hooks that gather again are eager machinery the compiler cannot trace; here a
        gather that backward must repeat rather than keep is run as a region whose every op backward
        recomputes (as SimpleFSDP does), so the compiled backward keeps the shard and gathers it again."""
        if self.gathered is None:
            return self._steps(x)
        return checkpoint(self._steps, x, use_reentrant=False, context_fn=recompute_all_but_logging)

    def _steps(self, x):
        """The steps in order (a weight kept in the master dtype cast to the compute dtype first)."""
        if self.cast is not None:
            return CastAndRedistribute.apply(x, self.steps, self.wholes, self.comm, *self.cast)
        for s, whole in zip(self.steps, self.wholes):
            x = Redistribute.apply(x, s, self.comm, whole)
        return x

    def saved(self) -> None:
        """Autograd saved this weight gathered (GatheredParams.pack): backward gathers it again once."""
        if self.group is not None:
            self.group.packed(self.group_index)

    @torch.no_grad()
    def gather_again(self, local):
        if self.group is not None:
            x = self.group.unpacked(self.group_index)
            if isinstance(x, tuple):   # gathered in float8 (its bits, its scale): a float8 linear reads the bits
                return x[0]
            for s, whole in zip(self.steps[1:], self.wholes[1:]):
                x = transform(x, s.src, s.dst, s.axis, self.comm, "backward", whole)
            return x
        x = local if self.cast is None else local.to(self.cast[0])
        for s, whole in zip(self.steps, self.wholes):
            x = transform(x, s.src, s.dst, s.axis, self.comm, "backward", whole)
        return x

    def extra_repr(self) -> str:
        return self.label


def weight_casts(lowering) -> dict:
    """Parameter node -> (compute dtype, reduce dtype) for each weight the plan stores in a master dtype and
    casts where it is used (planning/lowering.Lowering.casts, dtypes by name); empty without mixed precision."""
    return {name: tuple(_dtype(d) for d in pair) for name, pair in lowering.casts.items()}


def _dtype(name: str) -> torch.dtype:
    """The torch dtype str() names ("torch.bfloat16")."""
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise PlanError(f"the plan casts a weight to {name!r}, which is no torch dtype")
    return dtype


def _describe(steps, axis_names) -> str:
    parts = []
    for s in steps:
        f, b = s.forward_kind, s.backward_kind
        parts.append(f"{axis_names[s.axis]}: {s.src}->{s.dst} (fwd {f}, bwd {b})")
    return "; ".join(parts)


def rewrite(cap: Captured, plan, comm: Comm, grad_nodes: set) -> tuple[fx.GraphModule, GatheredParams]:
    """This rank's local graph of `cap` under `plan`, and the record of the FSDP weights it gathers.

    `grad_nodes`: the captured nodes a gradient flows back to (only their
    layout changes carry a gradient reduction).
    """
    rw = _Rewriter(cap, plan, comm, grad_nodes)
    made_for = []   # (number of nodes in g before, original node): which node each new one was made for
    for node in cap.graph.nodes:
        made_for.append((len(rw.g.nodes), node.name))
        rw.emit(node)
    rw.g.lint()
    gm = fx.GraphModule(rw.root, rw.g, class_name="LocalGraph")
    # which captured node each local node was made for: a pipeline cuts the local graph by it (stages.py)
    gm.meta["origin"] = _origins(gm, made_for)
    if plan.checkpointed:
        gm = _checkpoint_blocks(gm, cap, plan, made_for, comm, rw.lowering.recomputed)
        gm.meta["origin"] = _region_origins(gm, gm.meta["origin"])
        _mark_recomputed_groups(gm)
    rw.gathered.needed = any(isinstance(m, RedistributeModule) and m.gathered is not None for m in gm.modules())
    # the outputs' gradient factor the graph left out, for the module's GradBuckets to apply: on the final
    # graph module (checkpointing may have made another), which the module reads it from
    gm.meta["bucket_grad_scale"] = rw.bucket_grad_scale
    return gm, rw.gathered


def _origins(gm: fx.GraphModule, made_for: list) -> dict:
    """{local node name: the captured node it was made for}, from rewrite's `made_for` marks."""
    starts = [k for k, _ in made_for]
    return {new.name: made_for[bisect.bisect_right(starts, k) - 1][1] for k, new in enumerate(gm.graph.nodes)}


def _region_origins(gm: fx.GraphModule, origin: dict) -> dict:
    """`origin` with each checkpointed region's call (and the getitems of its results) made for the captured
    node its body's last op was made for: a pipeline cuts between blocks, never inside one, so that is the
    stage of the whole region. The body's nodes keep the names they had in the local graph (outline)."""
    out = dict(origin)
    for node in gm.graph.nodes:
        if node.op == "call_module" and isinstance(gm.get_submodule(node.target), CheckpointRegion):
            # the body's last node the rewrite made (a call_function or a module call: a ring attention)
            body = [n.name for n in gm.get_submodule(node.target).body.graph.nodes
                    if n.op not in ("placeholder", "output") and n.name in origin]
            if not body:
                continue   # nothing of the captured graph in it: the pipeline cut reports it if it matters
            out[node.name] = origin[body[-1]]
            for user in node.users:
                out[user.name] = out[node.name]
    return out


class _Rewriter:
    """One rewrite in progress: the local graph being built, and what each captured node became in it.

    emit() is called on the captured nodes in order; each adds the node's
    local counterpart, preceded by whatever layout changes its inputs need.
    """

    def __init__(self, cap: Captured, plan, comm: Comm, grad_nodes: set):
        self.cap, self.comm, self.grad_nodes = cap, comm, grad_nodes
        self.strategies = plan.node_strategies
        self.names = plan.mesh.axis_names
        self.coords = tuple(a.coord for a in comm.axes)
        self.sizes = plan.mesh.axis_sizes
        self.root = torch.nn.Module()          # owns the RedistributeModules (and get_attr targets)
        self.gathered = GatheredParams()
        self.g = fx.Graph()
        self.env: dict[str, fx.Node] = {}      # captured node name -> its local counterpart
        # one layout change per (producer, layout, gradient reduction), shared by all its consumers
        self._cache: dict = {}
        self._count = 0
        # what the plan decided for this graph beyond its layouts (planning/lowering.Lowering): the api makes sure
        # it was made for this graph (api._with_schedule, api._for_graph)
        self.lowering = plan.schedule.lowering
        self.casts = weight_casts(self.lowering)
        self.pipelined = plan.pipeline is not None
        # (op, input index) whose input autograd keeps: where a gather feeds one, the plan keeps the shard and
        # gathers again in backward (regather.py); its layer groups and buckets too (planning/schedule.py)
        self.schedule = plan.schedule
        self.reshard = plan.reshard_after_forward
        self.groups: dict = {}   # index in plan.schedule.layer_groups -> LayerGroup
        self.in_flight = in_flight()   # the groups' reduce-scatters, one in flight at a time
        # weights whose data-axis gradient the buckets reduce, and activations whose gradient flows on to them
        # partial (Lowering.partial_gradients, made by cost/buckets.partial_gradients)
        self.deferred = self.lowering.partial_gradients
        self._float8_gathers: dict = {}   # float8 linear -> its weight's RedistributeModule, from map_args to emit
        self._float8_scales: dict = {}    # float8 linear -> the node making the input scale it shares
        self.bucket_grad_scale = self.lowering.grad_scale

    def emit(self, node: fx.Node) -> None:
        """Add the local counterpart of captured `node` (nothing for an op that is dropped)."""
        if node.op == "placeholder":
            self.env[node.name] = self.g.placeholder(node.name)
        elif node.op == "get_attr":
            self._emit_get_attr(node)
        elif node.op == "output":
            self._emit_output(node)
        else:
            self._emit_op(node)

    def out_placement(self, name: str):
        """The layout the plan gives node `name`'s output (replicated where it has no strategy)."""
        s = self.strategies.get(name)
        return s.output if s is not None else (R,) * len(self.sizes)

    def redistribute(self, producer: fx.Node, dst, gp, reader: tuple | None = None, use: tuple | None = None) -> fx.Node:
        """`producer`'s local value in layout `dst`, with gradient reduction `gp` on the way back, for
        `reader` ((op, tensor input index), if an op reads it). `use`: that use's key in the plan's
        Lowering.grouped (`reader`, or ("output", index) for an output)."""
        src = self.out_placement(producer.name)
        gp = tuple(gp) if producer.name in self.grad_nodes else ()
        if reader is not None and producer.name in self.grad_nodes:
            # an op whose gradient is left partial hands its inputs partial gradients on those axes
            gp = tuple(sorted(set(gp) | set(self.deferred.get(reader[0], ()))))
        # a ZeRO parameter's gradient stays unreduced on its axes: the optimizer reduce-scatters it
        zero = self.strategies.get(producer.name)
        keep = tuple(zero.zero_axes) if zero is not None and producer.name in self.grad_nodes else ()
        # a weight's data-axis gradient all-reduce is left to the buckets (grad_buckets.py), as is that of an
        # activation whose partial gradient flows on to such weights
        keep += self.deferred.get(producer.name, ())
        if tuple(src) == tuple(dst) and set(gp) == set(keep) and producer.name not in self.casts:
            return self.env[producer.name]
        key = (producer.name, tuple(dst), gp)
        # the steps planning chose for this change (planning/lowering.LayoutChange, one per key)
        change = self.lowering.layout_changes.get(key)
        if change is None:
            raise PlanError(f"the plan's lowering has no layout change of {producer.name} to {tuple(dst)} (gradient "
                            f"partial on {gp}): it was made for another graph; plan again (autopar.plan)")
        if reader is not None and reader[1] == 1 and reader[0] in self.lowering.float8_gathers:
            return self._float8_gathered(producer, change, reader)
        if key not in self._cache:
            self._cache[key] = self._call_redistribute(producer, change, reader if use is None else use)
        if reader in self.schedule.regathered and producer.name in self.grad_nodes:
            module = self.root.get_submodule(self._cache[key].target)
            if module.gathered is None and change.activation_gathers_again:
                module.gathered, module.activation = self.gathered, True
        return self._cache[key]

    def _call_redistribute(self, producer: fx.Node, change, use) -> fx.Node:
        """A new RedistributeModule making the plan's layout `change` of `producer`, and the node calling it on
        `producer` for `use` (redistribute's)."""
        self._count += 1
        mod_name = f"redist_{self._count}_{producer.name}"
        self.root.add_module(mod_name, self._redistribute_module(producer, change, use))
        return self.g.call_module(mod_name, (self.env[producer.name],))

    def _float8_gathered(self, producer: fx.Node, change, reader: tuple) -> fx.Node:
        """The weight of float8 linear `reader[0]` that its FSDP layer group gathers in float8 (the plan's
        Lowering.float8_gathers): its RedistributeModule joins the group but is not called; the linear's
        Float8Linear calls the group with the local shard, which this returns."""
        module = self._redistribute_module(producer, change, reader)
        if module.group is None or any(st.forward_kind != NONE for st in change.steps[1:]):
            raise PlanError(f"the plan gathers the weight of {reader[0]} in float8, and its layout change here "
                            f"({module.label}) is not one gather with its layer: plan again (autopar.plan)")
        self._float8_gathers[reader[0]] = module
        return self.env[producer.name]

    def _redistribute_module(self, producer: fx.Node, change, use) -> RedistributeModule:
        """The RedistributeModule making the plan's layout `change` of `producer` for `use`, joined to its FSDP
        layer group where the plan serves that use from one."""
        steps = list(change.steps)
        is_param = self.cap.info[producer.name].kind == PARAM
        cast = self.casts.get(producer.name)
        # an FSDP weight, or one cast for its op (mixed precision), is made again for backward, not kept --
        # unless the plan keeps FSDP weights gathered until backward (plan.reshard_after_forward False); so
        # is an activation gathered whole for an op that keeps it (sequence parallelism, as Megatron)
        # (an activation is gathered again where redistribute finds a reader that keeps it)
        gathers = change.weight_gathers_again
        regathered = is_param and (gathers and self.reshard or cast is not None and not gathers)
        # a parameter's storage may split a dim unevenly (placement.py): its steps need the whole length
        wholes = change.wholes
        label = f"{producer.name}: {_describe(steps, self.names)}" + (f"; cast to {cast[0]}" if cast else "")
        module = RedistributeModule(steps, self.comm, label, self.gathered if regathered else None, wholes, cast)
        # a weight use the plan serves from its FSDP layer group (none on a pipeline: its stages hold only their
        # own weights)
        grouped = self.lowering.grouped.get(use) if is_param and not self.pipelined else None
        if grouped is not None:
            self._join_group(module, producer.name, steps, grouped)
        return module

    def _join_group(self, module: RedistributeModule, producer: str, steps: list, grouped: tuple) -> None:
        """Serve `module`'s gather from the plan's layer group of its weight (planning.schedule.LayerGroup) with
        the signature `grouped` ((gather axis, dtype, summed axes), from the plan's Lowering.grouped)."""
        info = self.cap.info[producer]
        if producer in self.deferred:   # the group would own a gradient the buckets must also see: one is lost
            raise PlanError(f"{info.target_name!r} is both gathered with its layer and bucketed on mesh axes "
                            f"{self.deferred[producer]}; report this (cost/buckets.deferred_axes excludes it)")
        axis, dtype, sum_axes = grouped
        if axis != self.names[steps[0].axis]:
            raise PlanError(f"the plan gathers {info.target_name!r} with its layer on {axis!r}, and its layout change "
                            f"here gathers on {self.names[steps[0].axis]!r}: plan again (autopar.plan)")
        k = self.schedule.layer_group_of(info.target_name, axis, dtype, sum_axes)
        if k is None:
            raise PlanError(f"the plan's layer groups list no group gathering {info.target_name!r} on "
                            f"{axis!r} in {dtype} (summed over {sum_axes}): its schedule was made "
                            "for another model or another autopar, or for the model with weights frozen "
                            "(requires_grad False) that it trains now; plan again (autopar.plan)")
        if k not in self.groups:
            group = self.groups[k] = LayerGroup(steps[0].axis, self.comm, tuple(self.names.index(a) for a in sum_axes),
                                                self.in_flight)
            if self.gathered.groups:   # forward gathers the groups in the order it first needs them
                group.prev, self.gathered.groups[-1].next = self.gathered.groups[-1], group
            self.gathered.groups.append(group)
        module.group = self.groups[k]
        module.group_index = module.group.add(module, info.target_name)

    def map_args(self, node: fx.Node, s):
        """`node`'s args and kwargs in the local graph, each tensor input in the layout strategy `s` wants."""
        count = [0]

        def visit(a):
            if isinstance(a, fx.Node):
                if a.name in self.cap.info and _is_tensor(a):
                    i = count[0]
                    count[0] += 1
                    if s is None:
                        return self.env[a.name]
                    return self.redistribute(a, s.inputs[i], s.grad_partial(i), reader=(node.name, i))
                return self.env[a.name]
            if isinstance(a, (list, tuple)):
                return type(a)(visit(x) for x in a)
            if isinstance(a, dict):
                return {k: visit(v) for k, v in a.items()}
            return a
        return visit(node.args), visit(node.kwargs)

    def _emit_get_attr(self, node: fx.Node) -> None:
        """Carry over an attribute of the exported module, e.g. the body of a no_grad region (a higher-order op's)."""
        attr = getattr(self.cap.exported.graph_module, node.target)
        if isinstance(attr, torch.nn.Module):
            self.root.add_module(node.target, attr)
        else:
            self.root.register_buffer(node.target, attr)
        self.env[node.name] = self.g.get_attr(node.target)

    def _emit_output(self, node: fx.Node) -> None:
        """The outputs in the plan's output layouts, each gradient scaled as the plan says (Lowering's
        output_grad_scales; by the gradient buckets instead, where its grad_scale says they can)."""
        s = self.strategies["output"]
        outs = []
        for i, a in enumerate(tensor_args(node)):
            x = self.redistribute(a, s.inputs[i], (), use=("output", i))
            scale = self.lowering.output_grad_scales[i]
            if scale != 1.0 and a.name in self.grad_nodes and self.bucket_grad_scale == 1.0:
                x = self.g.call_function(scale_grad, (x, scale))
            outs.append(x)
        self.g.output(tuple(outs))

    def _emit_op(self, node: fx.Node) -> None:
        """A call_function node, run on this rank's shards (its inputs redistributed first)."""
        name = op_name(node)
        if name in DROPPED_OPS:
            return
        s = self.strategies.get(node.name)
        op = self.lowering.ops.get(node.name, PLAIN)   # how the plan runs it (sharding/local_ops.LocalOp)
        if name == "aten.sym_size.int":
            self.env[node.name] = self._global_size(node, op.size_factor)
            return
        args, kwargs = self.map_args(node, s)
        if name in SQUEEZE_OPS:
            self.env[node.name] = self._squeeze(node, args)
            return
        if op.shape_factors:
            args = (args[0], _localize_shape(self.g, args[1], op.shape_factors)) + tuple(args[2:])
        # a traced view may rely on strides the local tensor lacks (CPU SDPA returns a
        # transposed layout, so `.contiguous()` vanished from the trace): reshape copies only then
        if name in VIEW_OPS:
            new = self.g.call_function(torch.ops.aten.reshape.default, args, kwargs)
        elif op.ring is not None:   # attention passing keys and values round a context axis
            self._count += 1
            mod_name = f"ring_attention_{self._count}_{node.name}"
            self.root.add_module(mod_name, ring_attention(op.ring, self.comm, node.name))
            mask = args[3] if len(args) > 3 else kwargs.get("attn_mask")
            new = self.g.call_module(mod_name, tuple(args[:3]) + ((mask,) if mask is not None else ()))
        elif node.name in self.lowering.float8:   # a linear whose matmuls run in float8
            self._count += 1
            mod_name = f"float8_{self._count}_{node.name}"
            recipe, splits = self.lowering.float8[node.name]
            label = f"{node.name}: {recipe}, amaxes reduced over " + ", ".join(
                f"{what} {[self.names[a] for pair in split for a in pair] or 'none'}"
                for what, split in zip(("input", "weight", "grad"), splits))
            gather = self._float8_gathers.pop(node.name, None)
            if gather is not None:   # its group casts the weight's shard and gathers float8 (layer_groups.py)
                member = gather.group.members[gather.group_index]
                member.float8_axes = tuple(sorted({gather.group.axis, *splits[1][0], *splits[1][1]}))
                label += f"; weight gathered in float8 on {self.names[gather.group.axis]} ({gather.label})"
            self.root.add_module(mod_name, Float8Linear(splits, recipe, self.comm, label, gather))
            new = self.g.call_module(mod_name, tuple(args), {**kwargs, **self._float8_input_scale(node, args[0])})
        elif op.vocab_loss is not None:   # a cross-entropy over this rank's classes
            self._count += 1
            mod_name = f"vocab_parallel_{self._count}_{node.name}"
            self.root.add_module(mod_name, vocab_parallel_loss(op.vocab_loss, self.comm, self.coords, self.sizes))
            new = self.g.call_module(mod_name, (args[0], args[1]))
        else:
            # the local op first: a causal attention over this rank's rows keeps its offset with dropout on too
            target, args, kwargs = run_local(op, node.target, self.coords, self.sizes, args, kwargs)
            if op.random is not None:
                new = self._call_random(node, op.random, target, args, kwargs)
            else:
                new = self.g.call_function(target, args, kwargs)
        new.meta = {k: v for k, v in node.meta.items() if k in ("nn_module_stack", "stack_trace")}
        self.env[node.name] = new

    def _float8_input_scale(self, node: fx.Node, x: fx.Node) -> dict:
        """{"x_scale": the node making the forward scale of float8 linear `node`'s activation `x`} where linears
        share it (Lowering.float8_shared_scales: the first makes it, before itself; the others read it); {} where
        the linear makes its own."""
        shared = self.lowering.float8_shared_scales
        owner = shared.get(node.name)
        if owner is not None:
            return {"x_scale": self._float8_scales[owner]}
        if node.name not in set(shared.values()):
            return {}
        recipe, splits = self.lowering.float8[node.name]
        self._count += 1
        mod_name = f"float8_scale_{self._count}_{node.name}"
        readers = [n for n, o in shared.items() if o == node.name]
        self.root.add_module(mod_name, Float8InputScale(recipe, splits, self.comm,
                                                        f"{x.name} for {', '.join([node.name] + readers)}"))
        self._float8_scales[node.name] = self.g.call_module(mod_name, (x,))
        return {"x_scale": self._float8_scales[node.name]}

    def _call_random(self, node: fx.Node, axes: tuple, target, args, kwargs) -> fx.Node:
        """A random op (`target`, local_ops.run_local's) drawing from the stream of this rank's shard of its
        output (rng.py): per shard on the mesh `axes` that split the output, shared where none does."""
        key = shard_key(axes, self.coords)
        self._count += 1
        mod_name = f"random_{self._count}_{node.name}"
        shards = ", ".join(f"{self.names[a]}={c}" for a, c in key) or "shared by all ranks"
        label = f"{node.name}: stream {shards}"
        self.root.add_module(mod_name, RandomOp(target, self.comm.random_streams, key, label))
        return self.g.call_module(mod_name, args, kwargs)

    def _global_size(self, node: fx.Node, f: int) -> fx.Node:
        """A sym_size read of a local tensor, multiplied back (by `f`, the plan's split of the dim it reads) to the
        global size the graph computes with."""
        t, d = node.args[0], node.args[1]
        x = self.g.call_function(node.target, (self.env[t.name], d))
        return self.g.call_function(operator.mul, (x, f)) if f > 1 else x

    def _squeeze(self, node: fx.Node, args) -> fx.Node:
        """A squeeze of exactly the dims that are size 1 whole: a split dim may be size 1 on a rank."""
        whole = self.cap.info[node.args[0].name].meta
        whole = whole[0] if isinstance(whole, list) else whole
        dims = squeezed_dims(node, whole.hint)
        return self.g.call_function(torch.ops.aten.squeeze.dims, (args[0], dims))


def _mark_recomputed_groups(gm: fx.GraphModule) -> None:
    """Tell each FSDP layer group whose weights a checkpointed region gathers that backward's rerun of that
    region gathers it again (LayerGroup.recomputed): backward then prefetches that gather."""
    for region in gm.modules():
        if isinstance(region, CheckpointRegion):
            for m in region.body.modules():
                if isinstance(m, RedistributeModule) and m.group is not None:
                    m.group.recomputed = True


def _checkpoint_blocks(gm: fx.GraphModule, cap: Captured, plan, made_for: list, comm: Comm,
                       recomputed: tuple) -> fx.GraphModule:
    """Run every block the plan recomputes (`recomputed`: planning/lowering.Region, a block of a stack in
    `plan.checkpointed`, or its attention core) under activation checkpointing (recompute.py); a per-op one
    caching what the plan priced (its SavePolicy)."""
    order = {(r.path, r.index): k for k, r in enumerate(recomputed)}
    policy_of = {(r.path, r.index): r.policy for r in recomputed}
    block_of = {n: (r.path, r.index) for r in recomputed for n in r.nodes}
    starts = [k for k, _ in made_for]
    members: dict = {}
    for k, new in enumerate(gm.graph.nodes):
        origin = made_for[bisect.bisect_right(starts, k) - 1][1]
        if origin in block_of:
            members.setdefault(block_of[origin], []).append(new)
    keys = sorted(members, key=order.__getitem__)
    policies = [policy_of[key] for key in keys]
    regions = [members[key] for key in keys]
    if plan.pipeline is not None and not plan.reshard_after_forward:
        # the step gathers these weights once and holds them (runtime/pipeline/held_weights.py): the region reads
        # the held whole weight as an input, in forward and in its rerun, instead of gathering it itself
        is_param = {name for name, info in cap.info.items() if info.kind == PARAM}
        regions = [_without_weight_gathers(gm, region, is_param) for region in regions]
    return outline(gm, regions, [f"{p}.{i}" for p, i in keys], comm, policies)


def weight_gather(gm: fx.GraphModule, node: fx.Node, is_param) -> RedistributeModule | None:
    """The layout change `node` calls if it all-gathers a weight (on any axis; its other steps are casts and
    local cuts) straight from the weight's placeholder, else None. `is_param`: the parameters' placeholder
    names. Under a pipeline that keeps FSDP weights whole these run once per step (held_weights.py)."""
    if node.op != "call_module" or not isinstance(gm.get_submodule(node.target), RedistributeModule):
        return None
    (src,) = node.args
    module = gm.get_submodule(node.target)
    if src.op != "placeholder" or src.name not in is_param or not gathers_again(module.steps, is_param=True):
        return None
    return module


def _without_weight_gathers(gm: fx.GraphModule, region: list, is_param) -> list:
    """`region` less its weight gathers, each moved in front of it (it reads only its placeholder)."""
    gathers = [n for n in region if weight_gather(gm, n, is_param) is not None]
    kept = [n for n in region if n not in gathers]
    for node in gathers if kept else ():   # (a region of nothing but gathers is left empty: outline skips it)
        kept[0].prepend(node)
    return kept


def squeezed_dims(node: fx.Node, shape) -> list:
    """The dims the traced squeeze removed: those it names (or all) that are size 1 in the whole tensor."""
    nd = len(shape)
    if len(node.args) < 2:
        named = range(nd)
    elif isinstance(node.args[1], int):
        named = [node.args[1]]
    else:
        named = node.args[1]
    return sorted({d % nd for d in named if shape[d % nd] == 1})


def _is_tensor(n: fx.Node) -> bool:
    v = n.meta.get("val")
    return isinstance(v, torch.Tensor) or (isinstance(v, (list, tuple)) and bool(v) and isinstance(v[0], torch.Tensor))


def _localize_shape(g: fx.Graph, shape, factors: tuple):
    """A shape argument in global terms divided by the plan's split of each dim (`factors`, LocalOp.shape_factors)."""
    out = []
    for v, f in zip(shape, factors):
        if f == 1 or (isinstance(v, int) and v == -1):
            out.append(v)
        elif isinstance(v, int):
            out.append(v // f)
        else:
            out.append(g.call_function(operator.floordiv, (v, f)))
    return type(shape)(out)
