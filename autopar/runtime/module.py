"""Runtime: the module each rank trains.

ParallelModule holds only this rank's shards of the parameters, under the
original parameter names, so `model.parameters()` feeds any torch.optim
optimizer and a parameter's gradient lands in the same layout as the
parameter. `state_dict()` returns DTensors (or full tensors on request), so a
checkpoint does not depend on the layout it was saved from.
"""
from __future__ import annotations

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
from .lowering.input_shapes import context_axes, input_shape_specs, ordered_inputs, split_requirements
from .lowering.regather import GatheredParams
from .module_call import ModuleCall
from .pipeline.runner import PipelineRunner
from .reduction.zero_buckets import ZeroGradientChecks
from .state_dict import export_tensor, full_grads, load_module_state, load_under_prefix, own_state, stored_layout
from .store import moved_constant, on_meta, store_shards



@dataclass(frozen=True)
class OtherMode:
    """The mode the model was not captured in (eval for a training model): its local graph, laid out by the
    same plan, with its re-gather registry; or, where it cannot run, why (`refused`)."""
    graph: fx.GraphModule | None = None
    gathered: GatheredParams | None = None
    refused: str | None = None


class ParallelModule(ModuleCall, torch.nn.Module):
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
        self._told_float8_gathers = False   # whether a compiled call warned that it gathers float8 weights in bf16
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

        Runs `fn(module)`, else the nearest `_init_weights(module)` of the module or a parent (Hugging
        Face, nanoGPT), then the module's `reset_parameters()` if that left some of its tensors unset
        (nanoGPT's sets no LayerNorm), one module at a time on whole tensors, keeping this rank's slice
        (runtime/initialization.py; load_hf recomputes buffers alike). Seed every rank alike: the shards
        then hold what a single device running the same initialization in `model.modules()` order would.
        A tensor nothing sets holds NaN, and a warning names it.
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
