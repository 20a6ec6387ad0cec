"""PlanOptions: every option of a planning request, in one place, each with its default and the reason for it.

autopar.plan, compare, parallelize and min_axis_size take these as keywords (`autopar.plan(model, inputs,
mesh, memory_limit="80GB", strategy="fsdp")`); the `autopar` command sets them from its flags. The
planner (planner.plan_captured) reads them from here, so a new option is written once, here.
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace

from ..cost.buckets import DEFAULT_BUCKET_BYTES
from ..cost.checkpointing import check_mode
from ..cost.precision import optimizer_spec, precision_of
from ..errors import AutoparError, PlanError
from ..search.classics import CONTEXT_STRATEGIES, CONTEXT_WEIGHTS


@dataclass(frozen=True)
class PlanOptions:
    """What to plan for, and how hard to search.

    - `hardware`: a preset ("h100", "h100-hbm2e", "h200", "a100", "tpu-v5p", "cpu", "cpu-gloo"), a
      `cost_models.Hardware`, an `autopar.calibrate` result or the path of the JSON spec it wrote. None:
      "cpu-gloo" for a CPU DeviceMesh, else "h100" (what large models train on). "h100-hbm2e" is the 96 GB
      HBM2e H100 capped at 500 W of Meta's Grand Teton hosts, where torchtitan's published runs ran.
    - `memory_limit`: bytes per device, or a string like "80GB" / "70GiB". None: no limit.
    - `strategy`: "auto" (the whole search, which may mix strategies layer by layer) or a named one:
      "ddp", "zero1", "zero2", "fsdp", "tp", "tp+sp", "fsdp+tp", "cp", "fsdp+cp", "fsdp+tp+cp"
      (autopar.STRATEGIES). "cp" (context parallelism) splits the sequence over every axis, weights whole as
      under ddp; each rank attends from its rows to keys and values gathered whole, or, where that moves
      fewer bytes, from every row on its share of the heads (an all-to-all each way). "fsdp+cp" puts fsdp on
      the first axis and cp on the last, and splits every weight over both (torchtitan's FSDP over its
      dp_shard_cp mesh: each weight gathered over cp and dp for use, its gradient reduce-scattered back);
      "fsdp+tp+cp" fsdp on the first, cp on the second last, tp on the last, weights split over fsdp and cp
      as well. Their data axes (all before cp) may be absent: "fsdp+cp" on {"cp": 8} splits the sequence and
      the weights 8 ways (torchtitan's dp_shard 1). `auto` searches a cp axis only where no plan of its own
      fits `memory_limit`.
    - `context_weights`: how context axes store weights: "split" (FSDP over them; gathered whole for each
      use) or "whole" (as ddp: their gradients all-reduced). None: "split" under "fsdp+cp" and
      "fsdp+tp+cp", "whole" under "cp", the search's choice per weight under "auto". Only for those
      strategies (a PlanError names it otherwise); "whole" under "fsdp+cp" is fsdp on the data axes alone.
    - `precision`: an autopar.Precision or "bf16-mixed"; None keeps the model's own dtype.
    - `optimizer`: "adamw" (the default: what large models train with), "adam", "sgd", "sgd-momentum" or a
      torch optimizer; with `precision` it sets the bytes each parameter costs.
    - `checkpointing`: "auto" lets the search recompute stacks of repeated blocks when that is what fits
      `memory_limit` (it only costs time, so never without a limit), each block whole, only its attention
      core, per op or every second block, whichever is fastest; "full" recomputes every block of such stacks; "selective" only
      their attention cores (Megatron's selective recompute); "per-op" every block but the results of its
      fused attention kernels and of every second matmul (the 1st, 3rd, ... aten.mm/addmm of the block: q, v,
      gate and down of a Llama block), which forward keeps (torchtitan's per-op selective checkpointing);
      "per-layer" every second block whole, the 2nd, 4th, ... (torchtitan's layer selective checkpointing,
      ac_freq 2), the others keeping their activations; "none" never.
    - `links`: {axis name: cost_models.Link} overriding the hardware's link for an axis (by default the
      last mesh axis is taken to be inside a node).
    - `time_limit`: seconds HiGHS may spend on one ILP before the greedy's plan is taken instead (60: a
      search that cannot finish in a minute is one to be told about). Near its limit HiGHS rations work by
      the clock, so among equally cheap plans the one it returns can vary with the machine's load; None (no
      limit) always gives the same plan for the same request.
    - `pipeline_axis`: None never pipelines (a pipelined module trains through train_step, not forward, so
      the search does not pick one unasked); "auto" lets the search pipeline over an axis when that is
      faster or is what fits; a name pins the axis.
    - `microbatches`: None lets the search try p, 2p and 4p.
    - `schedule`: None or "1f1b" (it holds fewer activations than "gpipe" for the same bubble),
      "gpipe", "interleaved-1f1b", "zero-bubble" (torch's ScheduleInterleavedZeroBubble: a third of
      1F1B's bubble), or "auto" (the fastest as priced).
    - `stages_per_device`: the virtual stages each device runs under interleaved 1F1B (torchtitan's number of
      stages over the pipeline degree; torch's schedule takes a device's list of them). None lets the search try
      every v from 2 while the model has a layer per stage: more cut the bubble to (p-1)/(v m), at a send per
      stage and more microbatches in flight on a device's first stage.
    - `bucket_bytes`: the most bytes one data-parallel gradient all-reduce carries; DDP's 25 MiB: large
      enough that per-call latency is small beside the bytes, small enough that the first buckets go out
      while backward still runs.
    - `reshard_after_forward`: whether an FSDP weight an op keeps for backward is kept as its shard and
      gathered again in backward (True, FSDP2's default: FSDP is chosen for memory) or kept whole (False:
      one all-gather per layer fewer, those weights' bytes more); "auto", the faster that fits
      `memory_limit`. None: True for a named strategy, "auto" under strategy="auto"; under a pipeline
      "auto" for every strategy (resharded, a pipeline gathers each weight once per microbatch; kept whole,
      once per step, as torchtitan runs FSDP under a pipeline).
    """
    hardware: object = None
    memory_limit: object = None
    strategy: str = "auto"
    precision: object = None
    optimizer: object = "adamw"
    checkpointing: str = "auto"
    links: object = None
    time_limit: float | None = 60.0
    pipeline_axis: str | None = None
    microbatches: int | None = None
    schedule: str | None = None
    stages_per_device: int | None = None
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    reshard_after_forward: bool | str | None = None
    context_weights: str | None = None

    @classmethod
    def from_keywords(cls, where: str, options: dict, also: str = "") -> "PlanOptions":
        """The options `where` (a function's name, for the error) was given, checked: an unknown name or a bad
        value raises AutoparError / PlanError before any capture, which takes seconds. `also`: the function's
        other keywords, which the error lists beside the planning options."""
        unknown = sorted(set(options) - OPTION_NAMES)
        if unknown:
            raise AutoparError(f"unknown option(s) {unknown} for {where}; it takes {also + ' and ' if also else ''}"
                               f"the planning options {sorted(OPTION_NAMES)} (autopar.PlanOptions)")
        return cls(**options).checked()

    def checked(self) -> "PlanOptions":
        """These options with every value checked, the time limit as a float."""
        precision_of(self.precision)
        optimizer_spec(self.optimizer)
        check_mode(self.checkpointing)
        reshard_after(self.strategy, self.reshard_after_forward)
        check_context_weights(self.strategy, self.context_weights)
        if isinstance(self.bucket_bytes, bool) or not isinstance(self.bucket_bytes, int) or self.bucket_bytes < 1:
            raise PlanError(f"bucket_bytes must be a positive number of bytes (DDP's default is "
                            f"{DEFAULT_BUCKET_BYTES}), got {self.bucket_bytes!r}")
        return replace(self, time_limit=check_time_limit(self.time_limit))


OPTION_NAMES = frozenset(f.name for f in fields(PlanOptions))


def check_time_limit(time_limit) -> float | None:
    if time_limit is None:
        return None
    if isinstance(time_limit, bool) or not isinstance(time_limit, (int, float)) or not time_limit > 0:
        raise PlanError(f"time_limit must be a positive number of seconds per ILP solve, or None for no limit, "
                        f"got {time_limit!r}")
    return float(time_limit)


def check_context_weights(strategy: str, context_weights) -> None:
    """context_weights is None, or one of CONTEXT_WEIGHTS with a strategy that has a context axis."""
    if context_weights is None:
        return
    if context_weights not in CONTEXT_WEIGHTS:
        raise PlanError(f"context_weights must be 'split' (FSDP over the context axes), 'whole' (as ddp) or None "
                        f"(split under fsdp+cp and fsdp+tp+cp, whole under cp, the search's choice under auto), "
                        f"got {context_weights!r}")
    if strategy not in CONTEXT_STRATEGIES + ("auto",):
        raise PlanError(f"context_weights={context_weights!r} says how a context axis stores weights, and strategy "
                        f"{strategy!r} has none; use it with {', '.join(CONTEXT_STRATEGIES)} or 'auto', or leave it "
                        f"None")


def reshard_after(strategy: str, reshard_after_forward) -> bool | None:
    """Problem.reshard_after_forward for a request: as asked ("auto": the search's choice), or by default True
    for a named strategy (whoever names FSDP asks for its memory) and the search's choice under "auto"."""
    if not (reshard_after_forward is None or isinstance(reshard_after_forward, bool)
            or isinstance(reshard_after_forward, str) and reshard_after_forward == "auto"):
        raise PlanError(f"reshard_after_forward must be True, False, 'auto' (the faster that fits memory_limit) or "
                        f"None (True for a named strategy, 'auto' under strategy='auto'), got {reshard_after_forward!r}")
    if reshard_after_forward is None:
        return None if strategy == "auto" else True
    return None if reshard_after_forward == "auto" else reshard_after_forward
