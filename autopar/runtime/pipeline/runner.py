"""This device's pipeline stages of a ParallelModule, and the schedules that run them (ParallelModule.train_step
calls `step`). stages.py cuts the graph and makes each stage a module; this holds them and runs a step."""
from __future__ import annotations

import weakref

import torch
import torch.distributed as dist
import torch.fx as fx

from ..._compat import pipeline_stage
from ...capture.export import INPUT, PARAM, Captured
from ...errors import PlanError
from ..devices import mesh_device
from .held_weights import HELD, HeldWeights, held_gathers
from .stages import ZERO_BUBBLE, StageModule, StepLoss, cut, make_schedule, stage_graph


class PipelineRunner:
    """The stages of `plan.pipeline` that this rank's coordinate on the pipeline axis holds."""

    def __init__(self, pm, gm: fx.GraphModule, cap: Captured, plan):
        pipe = plan.pipeline
        placeholders_of = {n.name: (cap.info[n.name].kind, cap.info[n.name].target_name)
                           for n in gm.graph.nodes if n.op == "placeholder" and cap.info[n.name].kind != INPUT}
        specs = cut(gm, cap, pipe.stage_of(), pipe.num_stages)
        # FSDP weights gathered once per step and held whole across its microbatches (held_weights.py), or, when
        # the plan reshards after forward, gathered by each stage in each microbatch
        held = held_gathers(gm, placeholders_of) if _holds_weights(plan) else {}
        built = [stage_graph(gm, spec, placeholders_of, frozenset(held)) for spec in specs]
        p = pipe.num_stages // pipe.stages_per_device
        holders: dict = {}
        for s, (_, weights) in enumerate(built):
            for kind, fqn in _sources(weights, held):
                if kind == PARAM:
                    holders.setdefault(fqn, set()).add(s % p)
        shared = sorted(f for f, devices in holders.items() if len(devices) > 1)
        if shared:
            raise PlanError(f"parameters {shared[:3]} are read by stages on different devices of pipeline axis "
                            f"{pipe.axis!r} (tied weights, e.g. an embedding shared with the output head); autopar "
                            "cannot keep such copies in step yet: untie them, or plan without a pipeline "
                            "(pipeline_axis=None)")
        self.pipe = pipe
        self.stage_indices = pipe.stages_on(pm.coords[plan.mesh.axis_index(pipe.axis)])
        read = {w[1] for s in self.stage_indices for w in built[s][1] if w[0] == HELD}
        self.held = HeldWeights([g for name, g in held.items() if name in read], gm)   # in graph order
        # the ParallelModule by weak reference: it holds the stages, which read its weights at each call
        self.stage_modules = [StageModule(built[s][0], built[s][1], weakref.ref(pm), s == pipe.num_stages - 1,
                                          self.held) for s in self.stage_indices]
        # what the stages read
        self.weights = {fqn for s in self.stage_indices for _, fqn in _sources(built[s][1], held)}
        self.stages = None    # torch PipelineStages, made at the first step
        self.schedules = {}   # whether the loss takes targets -> (torch schedule, its StepLoss)

    def step(self, pm, local_inputs: tuple, loss_fn, targets):
        """One train_step over the microbatches: this rank's mean loss, broadcast from the last stage."""
        pipe = self.pipe
        group = pm.device_mesh.get_group(pipe.axis)
        device = mesh_device(pm.device_mesh)
        if self.stages is None:
            self.stages = [pipeline_stage(m, s, pipe.num_stages, device, group)
                           for s, m in zip(self.stage_indices, self.stage_modules)]
        has_targets = targets is not None   # decided before the placeholder targets below replace None
        inferring = has_targets not in self.schedules   # torch's first step runs the stages on made-up inputs too
        if has_targets not in self.schedules:
            step_loss = StepLoss(has_targets, pipe.microbatches)
            self.schedules[has_targets] = (make_schedule(self.stages, pipe.schedule, pipe.microbatches, step_loss),
                                           step_loss)
        schedule, step_loss = self.schedules[has_targets]
        first, last = 0 in self.stage_indices, pipe.num_stages - 1 in self.stage_indices
        if first and local_inputs and local_inputs[0].shape[0] % pipe.microbatches:
            raise PlanError(f"this rank's batch of {local_inputs[0].shape[0]} does not divide into "
                            f"{pipe.microbatches} microbatches (plan.pipeline.microbatches); give the global batch "
                            "the plan was made for, cut by plan.local_inputs")
        if not has_targets and last:   # torch's schedule splits a target per microbatch even when the loss takes none
            targets = torch.zeros(local_inputs[0].shape[0] if local_inputs else pipe.microbatches, device=device)
        losses = []
        for m in self.stage_modules:   # (the first step's extra forwards would end the count early)
            m.microbatches_left = None if inferring else pipe.microbatches
        # every microbatch's data-axis gradient summed here, reduced once below: a bucket as soon as the last
        # microbatch's backward through the stages that read its weights is done (GradBuckets.last_read)
        buckets = pm.grad_buckets
        summing = buckets.through_autograd() if pipe.schedule == ZERO_BUBBLE else buckets.accumulating()
        # the outputs are not merged: only the losses are used, and a model that returns its loss (0-dim)
        # would make torch's merge fail to concatenate the microbatches' scalars
        # held weights are gathered here, once, and their summed gradients reduced as the schedule ends
        with summing, step_loss.calling(loss_fn), self.held.holding(pm):
            schedule.step(*(local_inputs if first else ()), target=targets if last else None, losses=losses,
                          return_outputs=False)
        buckets.flush()
        loss = (torch.stack([x.detach() for x in losses]).sum() if last
                else torch.zeros((), dtype=torch.float32, device=device))   # NCCL: on the GPU
        if last:
            loss = loss.to(torch.float32)
        p = pipe.num_stages // pipe.stages_per_device
        dist.broadcast(loss, group=group, group_src=(pipe.num_stages - 1) % p)
        return loss


def _holds_weights(plan) -> bool:
    """Whether the step gathers FSDP weights once and holds them (reshard_after_forward False); a checkpointed
    block then reads the held weights too (rewrite keeps their gathers out of its region)."""
    return not plan.reshard_after_forward


def _sources(weights: list, held: dict) -> list:
    """A stage's (kind, name) per weight placeholder, a held one as the weight it gathers."""
    return [held[name].source if kind == HELD else (kind, name) for kind, name in weights]
