"""Runtime: the module each rank trains.

ParallelModule holds only this rank's shards of the parameters, under the
original parameter names, so `model.parameters()` feeds any torch.optim
optimizer and a parameter's gradient lands in the same layout as the
parameter. `state_dict()` returns DTensors (or full tensors on request), so a
checkpoint does not depend on the layout it was saved from.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
import torch.fx as fx

from .._compat import new_state_dict, output_spec, unflatten_outputs
from ..capture.compute_dtype import cast_inputs
from ..capture.export import BUFFER, CONSTANT, PARAM, Captured
from ..errors import PlanError
from .collectives import Comm
from .devices import on_mesh_device
from .reduction.grad_buckets import wire_grad_buckets
from .reduction.layer_groups import serve_layer_groups
from .initialization import init_shards
from .lowering.input_shapes import (call_sizes, check_input_shapes, check_on_every_rank, check_splits_divide,
                                    context_axes, input_shape_specs, ordered_inputs, split_requirements)
from .lowering.regather import GatheredParams
from .pipeline.runner import PipelineRunner
from .reduction.zero_buckets import ZeroGradientChecks
from .state_dict import export_tensor, full_grads, load_module_state, load_under_prefix, own_state, stored_layout
from .store import graph_args, moved_constant, on_meta, store_shards



@dataclass(frozen=True)
class OtherMode:
    """The mode the model was not captured in (eval for a training model): its local graph, laid out by the
    same plan, with its re-gather registry; or, where it cannot run, why (`refused`)."""
    graph: fx.GraphModule | None = None
    gathered: GatheredParams | None = None
    refused: str | None = None


class ParallelModule(torch.nn.Module):
    def __init__(self, gm: fx.GraphModule, gathered: GatheredParams, cap: Captured, plan, comm: Comm,
                 model: torch.nn.Module, device_mesh=None, other_mode: OtherMode | None = None,
                 grad_nodes=frozenset()):
        super().__init__()
        # bound to the mesh's ranks, so plan.local_inputs cuts by the coordinates the runtime uses here
        self.plan = plan.on_ranks(device_mesh.mesh.tolist()) if device_mesh is not None else plan
        other_graph = other_mode.graph if other_mode is not None else None
        on_mesh_device((gm, other_graph), device_mesh)
        self.graph_module = gm
        self.comm = comm
        self.device_mesh = device_mesh
        self.gathered = gathered
        # the mode the model was not captured in (api._other_mode); None when the graph is the same in both
        self._captured_training = model.training
        self._other_mode = other_mode
        self._input_shapes = input_shape_specs(cap, plan)
        # the dynamic sizes the plan splits inside the graph, and the axes whose ranks must agree on them
        self._split_requirements = split_requirements(cap, plan)
        self._context_axes = context_axes(self._split_requirements, plan.mesh.axis_names, plan.batch_axes)
        self.output_spec = output_spec(cap.exported)
        self.coords = tuple(a.coord for a in comm.axes)
        # a meta-built model's module tree, for init_weights (held outside nn.Module's registry, so its
        # meta tensors are not this module's parameters); None for a model built with real tensors
        self.__dict__["meta_model"] = model if on_meta(model) else None
        # this device's stages of the graph (pipeline/runner.py) and the weights they read
        self._pipeline = PipelineRunner(self, gm, cap, plan) if plan.pipeline is not None else None
        stored = store_shards(cap, plan, model, self.coords, self._pipeline.weights if self._pipeline else None)
        self.store = stored.store
        self._placeholder_sources = stored.placeholder_sources
        # whole shapes: a shard split unevenly (placement.py) does not tell them
        self.global_shapes = stored.global_shapes
        self.model_names = stored.model_names   # a pipelined module holds only some
        self._compute_dtype = cap.compute_dtype   # floating inputs are cast to it (compute_dtype.py)
        self.aliases = dict(cap.aliases)   # tied names -> canonical name (state_dict lists both)
        # lifted constants as captured, and where the module is now (_apply)
        self._captured_constants, self._constants = stored.constants, dict(stored.constants)
        # how a call's positional and keyword inputs map to the graph's placeholders, and the constants it baked in
        self._input_keys, self._constant_inputs = list(cap.input_keys), dict(cap.constant_inputs)
        self.zero_optimizer = None   # set by autopar.ShardedOptimizer, which ZeRO parameters need
        self._told_uncounted = False   # whether a compiled call warned of the re-gathers record_comm misses
        self._zero_checks = ZeroGradientChecks(self)
        # weights frozen when captured: the graph reduces no gradient of theirs (cost/terms.needs_grad)
        self._frozen = sorted(n for n, _ in self.store.named_parameters() if n in cap.frozen_params)
        self._frozen_params = [self.store.get_parameter(n) for n in self._frozen]   # _apply finds them again
        serve_layer_groups(self, [gathered] + ([other_mode.gathered] if other_graph is not None else []))
        self._grad_buckets, self._routed = self._gradient_reductions(cap, grad_nodes)

    def _apply(self, fn, recurse=True):
        """.to(), .cuda(), to_empty() and the like move the lifted constants with the weights (see _moved)."""
        super()._apply(fn, recurse)
        if hasattr(self, "_frozen"):   # to_empty (a meta-built model) replaces the parameters
            self._frozen_params = [self.store.get_parameter(n) for n in self._frozen]
        self._constants = {name: moved_constant(self._captured_constants[name], current, fn)
                           for name, current in self._constants.items()}
        self._zero_checks.hook()   # to_empty (a meta-built model) replaces the parameters, and their hooks with them
        return self

    def _gradient_reductions(self, cap: Captured, grad_nodes) -> tuple:
        """The buckets that reduce the gradients the graph leaves partial (ZeRO ones are the optimizer's), and
        the weights the graphs route through them at their first use."""
        self._zero_checks.hook()
        other = [self._other_mode.graph] if getattr(self._other_mode, "graph", None) is not None else []
        return wire_grad_buckets(cap, self.plan, self.comm, grad_nodes, dict(self.store.named_parameters()),
                                 [self.graph_module] + other, self._placeholder_sources)

    def no_sync(self):
        """A context whose forwards' gradients are summed on this rank, not reduced over the data axes (their
        backward may run inside or after it, as with DDP's no_sync): the first reducing backward after it
        reduces the sum once (gradient accumulation over microbatches). Gradients of weights split over a data axis (FSDP, ZeRO) are still reduced each
        backward: their reduction is what splits them."""
        return self._grad_buckets.accumulating()

    def init_weights(self, fn=None) -> None:
        """Initialize a meta-built model's shards from scratch, after `to_empty(device=...)`.

        Runs `fn(module)`, else the model's own `_init_weights(module)` (Hugging Face, nanoGPT), else
        each module's `reset_parameters()`, one module at a time on whole tensors, keeping this
        rank's slice (runtime/initialization.py). Seed every rank alike: the shards then hold
        what a single device running the same initialization in `model.modules()` order would.
        """
        if self.meta_model is None:
            raise PlanError("init_weights is for a model built on the meta device (its parameters are "
                            "initialized already otherwise); build it under `with torch.device('meta'):`")
        shards = dict(self.store.named_parameters())
        shards.update(dict(self.store.named_buffers()))
        init_shards(self.meta_model, shards, self.plan.param_placements, self.aliases, self.coords,
                    self.plan.mesh.axis_sizes, fn)

    # ------------------------------------------------------------ pipeline
    @property
    def pipeline_stages(self) -> list:
        """This rank's pipeline stages, (stage index, its pipeline/stages.StageModule) in order; [] unpipelined.
        runtime/observe.py hooks them to see what they send."""
        runner = self._pipeline
        return list(zip(runner.stage_indices, runner.stage_modules)) if runner is not None else []

    def weight_table(self) -> dict:
        """(kind, name) -> tensor, for the weights, buffers and constants a stage reads."""
        return {**{(PARAM, k): v for k, v in self.store.named_parameters()},
                **{(BUFFER, k): v for k, v in self.store.named_buffers()},
                **{(CONSTANT, k): v for k, v in self._constants.items()}}

    def train_step(self, *local_inputs, loss_fn, targets=None, **local_kwargs):
        """Forward and backward of this rank's batch (positional and keyword inputs, as forward takes them);
        returns its mean loss (the same on every rank of a pipeline), with every parameter's gradient that
        of that mean.

        `loss_fn(outputs, targets)` (or `loss_fn(outputs)` without targets) must average over the batch,
        as cross-entropy does: a pipeline applies it per microbatch and averages the microbatches.
        Call optimizer.zero_grad() before and optimizer.step() after, as with forward/backward.
        """
        if self.plan.pipeline is None:
            out = self(*local_inputs, **local_kwargs)
            loss = loss_fn(out) if targets is None else loss_fn(out, targets)
            loss.backward()
            return loss.detach()
        self._graph_for_mode()   # raises if this mode's graph is not the one the stages were cut from
        local_inputs = ordered_inputs(self._input_keys, self._constant_inputs, local_inputs, local_kwargs)
        return self._pipeline.step(self, cast_inputs(tuple(local_inputs), self._compute_dtype), loss_fn, targets)

    def manual_seed(self, seed: int) -> None:
        """Start the random streams of dropout and the other random ops again from `seed`; call it with the same
        seed on every rank (runtime/rng.py: each shard's stream comes from the seed and the shard's coordinates)."""
        self.comm.random_streams.manual_seed(seed)

    def forward(self, *local_inputs, **local_kwargs):
        """The model's forward on this rank's shard of its inputs, called as the model is: positional and
        keyword inputs (`plan.local_inputs`, `plan.local_kwargs` cut them from the global batch)."""
        # compiled, the weights go through the buckets before the graph (grad_buckets.BucketedUse)
        graph_module, gathered, args = self._graph_args(local_inputs, local_kwargs,
                                                        torch.compiler.is_dynamo_compiling())
        if torch.compiler.is_dynamo_compiling():   # no hooks: the graph gathers again itself (rewrite.RedistributeModule)
            return unflatten_outputs(self.output_spec, graph_module(*args))
        gathered.clear()   # weights a backward that raised gathered are stale once an optimizer step ran
        try:
            with gathered.hooks():
                flat = graph_module(*args)
        finally:
            gathered.clear()
        return unflatten_outputs(self.output_spec, flat)

    @torch.compiler.disable
    def _graph_args(self, local_inputs, local_kwargs, through_buckets: bool = False) -> tuple:
        """The graph of this mode, its GatheredParams, and its arguments: the weights (through the gradient
        buckets where those reduce them, here -- or, for the weights the graph routes (_route_to_buckets),
        at their first use in the graph, unless `through_buckets`) and this rank's inputs, cast as the plan
        computes.

        Run eagerly under torch.compile: the buckets' autograd functions hand gradients to Python
        bookkeeping that the compiler cannot trace, and breaking the graph once here, before any tensor
        op, leaves the whole local graph to compile as one."""
        if self.plan.pipeline is not None:
            raise PlanError(f"this plan pipelines over axis {self.plan.pipeline.axis!r}: a forward alone cannot run "
                            "its stages; train with model.train_step(*local_inputs, loss_fn=..., targets=...), "
                            "or plan with pipeline_axis=None")
        local_inputs = ordered_inputs(self._input_keys, self._constant_inputs, local_inputs, local_kwargs)
        if self._context_axes:   # before any collective, so every rank raises alike
            check_on_every_rank(self._input_shapes, self._split_requirements, self._context_axes,
                                [(a.group, a.size, name) for a, name in zip(self.comm.axes, self.plan.mesh.axis_names)],
                                local_inputs)
        else:
            check_input_shapes(self._input_shapes, local_inputs)
            check_splits_divide(self._split_requirements, call_sizes(self._input_shapes, local_inputs))
        local_inputs = cast_inputs(local_inputs, self._compute_dtype)
        graph_module, gathered = self._graph_for_mode()
        if through_buckets and self.comm.log is not None:
            self._check_compiled_logging(gathered)
        args, weights = graph_args(self._placeholder_sources, self.store, self._constants, local_inputs, self)
        # the weights routed here (the others the graph routes at their first use)
        here = [(k, fqn) for k, fqn in weights if fqn not in self._routed or through_buckets]
        for (k, _), view in zip(here, self._grad_buckets.use([n for _, n in here], [args[k] for k, _ in here])):
            args[k] = view
        return graph_module, gathered, args

    def _check_compiled_logging(self, gathered) -> None:
        """record_comm under torch.compile: the op that logs a launch is effectful, and the compiler cannot
        recompute one. A checkpointed block, recomputed whole, is refused (inductor fails on it deep inside);
        a gather backward repeats (recompute.recompute_all_but_logging) is run unlogged, said once."""
        if self.plan.checkpointed:
            raise PlanError("record_comm=True under torch.compile cannot log the collectives of the checkpointed "
                            f"blocks ({', '.join(self.plan.checkpointed)}), which backward recomputes: parallelize "
                            "without record_comm to compile, or run the module eagerly to log them")
        if gathered.needed and not self._told_uncounted:
            self._told_uncounted = True
            warnings.warn("record_comm under torch.compile: the log misses the all-gathers backward repeats for "
                          "the tensors this plan keeps as shards (FSDP weights, sequence-parallel activations), "
                          "and their send buffers are kept for backward: the op that logs cannot be recomputed. "
                          "Run the module eagerly (or autopar.audit) to count them", stacklevel=4)

    def _graph_for_mode(self):
        """The local graph for the current mode: dropout and the like were traced in one mode."""
        thawed = [n for n, p in zip(self._frozen, self._frozen_params) if p.requires_grad] \
            if torch.is_grad_enabled() else []
        if thawed:   # its gradient would go unreduced: a silent wrong gradient
            raise PlanError(f"parameter {thawed[0]!r}{f' and {len(thawed) - 1} more' if len(thawed) > 1 else ''} "
                            f"did not require grad when the model was parallelized, so the module reduces no "
                            f"gradient of it; set requires_grad before autopar.parallelize (freezing after is fine)")
        if self.training == self._captured_training or self._other_mode is None:
            return self.graph_module, self.gathered
        if self._other_mode.refused is not None:
            raise PlanError(f"cannot run in {'train' if self.training else 'eval'} mode: {self._other_mode.refused}; "
                            f"parallelize the model in the mode you will run it in")
        return self._other_mode.graph, self._other_mode.gathered

    # ------------------------------------------------------------ checkpoints
    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        """Parameters under their original names (no 'store.' prefix)."""
        yield from self.store.named_parameters(prefix=prefix, recurse=recurse, remove_duplicate=remove_duplicate)

    def state_dict(self, destination=None, prefix: str = "", keep_vars: bool = False, *, full: bool = False):
        """Original names -> DTensors on the device mesh (or whole tensors with full=True).

        full=True gathers every parameter, which costs one all-gather per split axis. A pipelined module
        gives only its stages' parameters, as DTensors on the mesh without the pipeline axis (plain
        tensors when that is the only axis): DCP saves each under its own name from the ranks that hold
        it, and any plan loads them. `destination`, `prefix` and `keep_vars` are torch's: a parent
        module's state_dict (or torch.compile's wrapper) lists these entries under its own prefix.
        """
        destination = new_state_dict(destination, prefix, self._version)
        for fqn, value in own_state(self, full, keep_vars).items():
            destination[prefix + fqn] = value
        return destination

    def full_grads(self) -> dict:
        """Whole gradients by original parameter name (gathers split ones): for checks and debugging.
        Copies: a bucketed .grad views its bucket, which the next backward fills again."""
        return full_grads(self)

    def export_tensor(self, local, placements, full, shape):
        """This rank's `local` piece of a tensor of whole `shape`: gathered whole, or as a DTensor."""
        return export_tensor(self, local, placements, full, shape)

    @property
    def grad_buckets(self):
        """The data-parallel gradient buckets (runtime/reduction/grad_buckets.GradBuckets)."""
        return self._grad_buckets

    def stored_layout(self, placements) -> tuple:
        """(DeviceMesh, placements) a stored tensor is given as (state_dict.stored_layout)."""
        return stored_layout(self, placements)

    def load_state_dict(self, state_dict, strict: bool = True):
        """Accepts DTensors or whole tensors, in any layout; keeps this module's layout."""
        return load_module_state(self, state_dict, strict)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        """A parent module's load_state_dict (or torch.compile's wrapper's): this module's entries are
        those under `prefix`; what is missing or unexpected is reported to the parent, which decides."""
        load_under_prefix(self, state_dict, prefix, local_metadata, missing_keys, unexpected_keys, error_msgs)
