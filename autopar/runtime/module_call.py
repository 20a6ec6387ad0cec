"""What one call of a ParallelModule runs (module.py): the graph of the current mode, checked against the
weights frozen when it was parallelized, and its arguments -- this rank's inputs checked and cast as the plan
computes, the weights through the gradient buckets. A mixin of ParallelModule, which sets the attributes it
reads (module.py's __init__).
"""
from __future__ import annotations

import warnings

import torch

from ..capture.compute_dtype import cast_inputs
from ..errors import PlanError
from .lowering.input_shapes import (call_sizes, check_input_shapes, check_on_every_rank, check_splits_divide,
                                    ordered_inputs)
from .store import graph_args


class ModuleCall:
    """ParallelModule's preparation of one call (forward, train_step): which graph runs and on what."""

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
        if through_buckets and self.plan.schedule.lowering.float8_gathers and not self._told_float8_gathers:
            self._told_float8_gathers = True
            warnings.warn(f"under torch.compile the module gathers each FSDP weight alone, in the compute dtype: the "
                          f"{len(self.plan.schedule.lowering.float8_gathers)} weights the plan gathers in float8 "
                          "(enable_fsdp_float8_all_gather) move twice the bytes priced; eager runs gather them "
                          "in float8", stacklevel=2)
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
