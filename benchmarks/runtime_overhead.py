"""Step time of autopar's module against the same strategy written by hand with PyTorch's own tools.

    python benchmarks/runtime_overhead.py                                  # all strategies; several minutes on 2 cores
    python benchmarks/runtime_overhead.py --strategies ddp,tp --rounds 3
    python benchmarks/runtime_overhead.py --layers 1 --hidden 64 --vocab 256 --seq 32 --steps 2 --rounds 2   # smoke, ~1 min
    python benchmarks/runtime_overhead.py --hardware h100                  # price the plan for another device
    python benchmarks/runtime_overhead.py --hardware my_host.json          # a JSON spec (autopar.calibrate writes one)
    python benchmarks/runtime_overhead.py --calibrate                      # calibrate on the ranks, then plan
    python benchmarks/runtime_overhead.py --strategies ddp --bucket-mb 4   # both sides with 4 MiB gradient buckets
    python benchmarks/runtime_overhead.py --model 1b                       # on GPUs: NCCL, bf16-mixed, a ~1B GPT
    python benchmarks/runtime_overhead.py --model 1b --batch 4 --dp 1 --strategies ddp,fsdp,zero1   # one GPU
    python benchmarks/runtime_overhead.py --precision bf16-mixed           # bf16 compute on CPU ranks too

For each strategy, `world` real processes (torch.multiprocessing, spawn) join a gloo process group,
each with `--threads` intra-op threads (default 1: the ranks share the machine's cores); with
`--device cuda` (the default where there is a GPU per rank) an NCCL one, a GPU each, and bf16-mixed
precision unless `--precision` says otherwise. Every rank
builds the same seeded GPT (autopar.testing.GPT) and the same global batch (idx and targets, int64
[batch, seq]), and deep-copies the model twice:

    autopar: pm = autopar.parallelize(model, mesh, (idx,), strategy=...); opt = autopar.ShardedOptimizer(pm, AdamW)
             loss = gpt_loss(pm(*pm.plan.local_inputs(idx)), *pm.plan.local_targets(targets))
    native:  ddp      DistributedDataParallel (default 25 MB buckets)
             fsdp     FSDP2 fully_shard on each block of model.h, then on the root
             tp       parallelize_module: Megatron TP (q/k/v/fc colwise, o/proj rowwise, one input-gradient
                      all-reduce per attention); embeddings rowwise and lm_head colwise with its logits
                      gathered, because autopar's tp splits every matrix too
             tp+sp    torchtitan's plan: tp plus SequenceParallel layer norms, PrepareModuleInput,
                      sequence-split embeddings and loss_parallel (logits stay split over the vocabulary,
                      which autopar cannot do yet: its outputs are whole or batch-split)
             fsdp+tp  tp on mesh["tp"], then fully_shard per block and on the root over mesh["dp"] (2 x 2)
             zero1    DDP with ZeroRedundancyOptimizer(AdamW): torch's ZeRO-1 (all-reduced gradients, each rank
                      updating its parameters and broadcasting them); autopar's reduce-scatters the gradients
                      and all-gathers the updated slices, a bucket at a time

Two details of the native versions:
the attention reads hs = C // n_head from its input's width, which TP leaves whole, so the native
TP copies view q/k/v with a fixed head width and the local head count (_local_heads_forward); and
DTensor leaves some gradients in another layout than their parameter (SequenceParallel norms:
Partial, re-reduced by every AdamW op that reads them), so the native step redistributes them once
after backward (grads_as_params).

A step is zero_grad + forward + loss + backward + AdamW.step. Each side runs 3 warm-up steps (the
first step's loss is checked against the other side's and a single-device forward: "loss match"
warns past 1e-4 relative, which would mean a wrong native version), one step under the profiler
(collectives per step), then `--rounds` rounds of `--steps` timed steps of each side, the side going
first swapping every round, a barrier before each step. "ms" is the median over steps of the step's
time on its slowest rank; the quartiles printed below the table show how much other load on the
machine moved it, and the ratio per round (each round's median of one side over the other's, the two
run back to back) how far one run's ratio can be trusted; and the minor page faults a step takes on each
side, which move the ratio (docs/ARCHITECTURE.md section 5e). Collectives are counted the same way on
both sides: the gloo work items ("gloo:*" profiler events) one step launches, by kind from the c10d
op that launched each (gloo itself runs a reduce-scatter as an all-reduce of the whole buffer: twice
a ring reduce-scatter's bytes).
"predicted ms" is the plan's `predicted.step_time` on the hardware it was planned for (printed
below the table; the planner's default for a CPU mesh is the "cpu-gloo" preset, gloo's loopback
links as autopar.calibrate measured them on a 2-core VM; `--calibrate` measures the ranks first with
autopar.calibrate and plans with that),
"prediction error" that against autopar's measured step.
"MFU" is model FLOPs utilization: the GPT's model FLOPs per step (6 per matmul weight per token for
forward and backward, plus attention's 12 * layers * n_embd * seq per token, PaLM's convention,
causal masking not subtracted; gpt_flops_per_step) over the step's time, the ranks and the peak FLOP/s
of the hardware the plan was priced on at the compute dtype. On CPU ranks that peak is the "cpu-gloo"
preset's rough figure (or the calibrated one), so MFU there compares the two sides, nothing more.

bf16-mixed on the native side is what each PyTorch tool offers for it: DDP and DTensor TP run forward
and loss under torch.autocast(bfloat16) with float32 weights and gradients; FSDP2 takes
MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32), so it all-gathers bf16 like autopar.
Their losses then differ from one device's float32 by bf16 rounding; "loss match" allows 2e-2 there.
"""
import argparse
import collections
import contextlib
import copy
import datetime
import os
import resource
import statistics
import sys
import tempfile
import time
import traceback
import types
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn import functional as F

import autopar
import cost_models as cm
from cost_models.hardware import resolve_hardware
from autopar.testing import GPT, GPTConfig, gpt_loss

# strategy -> (mesh shape, axis names); ranks = product of the shape
STRATEGIES = {
    "ddp": ((2,), ("dp",)),
    "fsdp": ((2,), ("dp",)),
    "tp": ((2,), ("tp",)),
    "tp+sp": ((2,), ("tp",)),
    "fsdp+tp": ((2, 2), ("dp", "tp")),
    "zero1": ((2,), ("dp",)),
}
# what the table's "native" column calls each hand-written version (built by native_module)
NATIVE_NAMES = {"ddp": "DDP", "fsdp": "FSDP2 fully_shard", "tp": "DTensor TP", "tp+sp": "DTensor TP+SP, loss_parallel",
                "fsdp+tp": "DTensor TP + FSDP2", "zero1": "DDP + ZeroRedundancyOptimizer"}
WARMUP = 3
LOSS_RTOL = {"fp32": 1e-4, "bf16-mixed": 2e-2}
PRECISIONS = {"fp32": None, "bf16-mixed": "bf16-mixed"}   # --precision -> autopar's precision=
# --model presets: the small GPT the table was measured on (2 gloo ranks), and a ~1B GPT for GPUs
# (1.04e9 parameters: 18 layers of 2048, vocab 32768, untied; AdamW in float32 is 17 GB, under ddp on an 80 GB GPU)
MODELS = {"small": dict(layers=4, hidden=256, heads=4, vocab=2048, seq=128, batch=8),
          "1b": dict(layers=18, hidden=2048, heads=16, vocab=32768, seq=2048, batch=8)}
# c10d op names -> collective kind, matched on the name without underscores, first match wins
KINDS = (("reducescatter", "reduce_scatter"), ("allreduce", "all_reduce"), ("allgather", "all_gather"),
         ("alltoall", "all_to_all"), ("broadcast", "broadcast"), ("barrier", "barrier"),
         ("send", "send"), ("recv", "recv"))


def mesh_shape(strategy: str, dp: int | None = None) -> tuple:
    """The strategy's mesh shape, its "dp" axis resized to `dp` where given (--dp)."""
    shape, names = STRATEGIES[strategy]
    return tuple(dp if dp is not None and name == "dp" else size for size, name in zip(shape, names))


def world_size(strategy: str, dp: int | None = None) -> int:
    n = 1
    for size in mesh_shape(strategy, dp):
        n *= size
    return n


# ----------------------------------------------------------------------------- model and data

def build_model(args, device) -> GPT:
    """The same weights on every rank and for both sides (each side deep-copies it)."""
    torch.manual_seed(args.seed)   # drawn on the CPU, so a GPU run starts from the same weights
    return GPT(GPTConfig(vocab_size=args.vocab, block_size=args.seq, n_layer=args.layers,
                         n_head=args.heads, n_embd=args.hidden, dropout=0.0)).to(device)


def make_batch(args, device):
    g = torch.Generator().manual_seed(args.seed + 1)
    idx = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
    targets = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
    return idx.to(device), targets.to(device)


def gpt_flops_per_step(args) -> float:
    """Model FLOPs of one training step over the global batch (PaLM's convention, see the docstring):
    2 per matmul weight per token forward and 4 backward, for the blocks' 12 * n_embd**2 weights a layer
    and lm_head's; attention's scores and weighted sum add 12 * layers * n_embd * seq per token. The matmul
    part equals torch.utils.flop_counter.FlopCounterMode's count of a forward and backward of this GPT
    (checked at 2 layers, n_embd 64; that counter does not count the CPU's attention kernel)."""
    matmul_weights = 12 * args.layers * args.hidden ** 2 + args.vocab * args.hidden
    per_token = 6 * matmul_weights + 12 * args.layers * args.hidden * args.seq
    return float(per_token * args.batch * args.seq)


def batch_shard(t: torch.Tensor, mesh, axis: str) -> torch.Tensor:
    """This rank's rows of a global batch split over one mesh axis (what a data-parallel rank reads)."""
    return t.chunk(mesh.size(mesh.mesh_dim_names.index(axis)))[mesh.get_local_rank(axis)].contiguous()


# ----------------------------------------------------------------------------- the native versions

def _local_heads_forward(self, x):
    """CausalSelfAttention.forward for column-parallel q/k/v: the head width is fixed, the head count local.

    The model computes hs = C // self.n_head from its input's width, which tensor parallelism leaves
    whole, while q/k/v hold only this rank's heads: setting the local n_head alone (torchtitan's way)
    would double hs. torchtitan's models view with a fixed head_dim for this reason; same math.
    """
    B, T, _ = x.shape
    q = self.q(x).view(B, T, self.n_head, self.head_size).transpose(1, 2)
    k = self.k(x).view(B, T, self.n_head, self.head_size).transpose(1, 2)
    v = self.v(x).view(B, T, self.n_head, self.head_size).transpose(1, 2)
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    y = y.transpose(1, 2).contiguous().view(B, T, -1)
    return self.resid_dropout(self.o(y))


def _use_local_heads(model, tp: int):
    for block in model.h:
        attn = block.attn
        attn.head_size = model.config.n_embd // attn.n_head
        attn.n_head //= tp
        attn.forward = types.MethodType(_local_heads_forward, attn)


def _tp_plan(model, sequence_parallel: bool) -> dict:
    """parallelize_module's plan: Megatron TP, and with sequence_parallel torchtitan's Llama plan mapped onto GPT."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel)
    if not sequence_parallel:
        plan = {"wte": RowwiseParallel(input_layouts=Replicate()), "wpe": RowwiseParallel(input_layouts=Replicate()),
                "lm_head": ColwiseParallel(output_layouts=Replicate())}
        for i in range(len(model.h)):
            # a replicated DTensor input: q, k and v's input gradients add up as partial sums and are
            # all-reduced once (Megatron's f), not once per projection as three local inputs would be
            plan.update({f"h.{i}.attn": PrepareModuleInput(input_layouts=(Replicate(),),
                                                           desired_input_layouts=(Replicate(),),
                                                           use_local_output=False),
                         f"h.{i}.attn.q": ColwiseParallel(), f"h.{i}.attn.k": ColwiseParallel(),
                         f"h.{i}.attn.v": ColwiseParallel(), f"h.{i}.attn.o": RowwiseParallel(),
                         f"h.{i}.fc": ColwiseParallel(), f"h.{i}.proj": RowwiseParallel()})
        return plan
    # The residual stream stays split along the sequence (dim 1; wpe's output (T, C) along dim 0):
    # gathered before attention and fc, reduce-scattered after o and proj; logits split over the vocab.
    plan = {"wte": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "wpe": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(0)),
            "ln_f": SequenceParallel(),
            "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False)}
    for i in range(len(model.h)):
        plan.update({f"h.{i}.ln_1": SequenceParallel(), f"h.{i}.ln_2": SequenceParallel(),
                     # gathered, and kept a DTensor: one reduce-scatter of q, k and v's input gradients
                     f"h.{i}.attn": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                                       use_local_output=False),
                     f"h.{i}.attn.q": ColwiseParallel(), f"h.{i}.attn.k": ColwiseParallel(),
                     f"h.{i}.attn.v": ColwiseParallel(), f"h.{i}.attn.o": RowwiseParallel(output_layouts=Shard(1)),
                     f"h.{i}.fc": ColwiseParallel(input_layouts=Shard(1)),
                     f"h.{i}.proj": RowwiseParallel(output_layouts=Shard(1))})
    return plan


def grads_as_params(module):
    """Give each DTensor gradient its parameter's placements, once, before the optimizer reads it.

    DTensor leaves the gradients of SequenceParallel's replicated norm weights Partial, and each
    AdamW op that reads one all-reduces it again (3 all-reduces per weight per step); a rowwise
    embedding's gradient comes back Replicate (cut locally). One redistribute each is what a careful
    hand-written version does.
    """
    for p in module.parameters():
        g = p.grad
        if g is not None and hasattr(g, "placements") and g.placements != p.placements:
            p.grad = g.redistribute(p.device_mesh, p.placements)


def _entered(*contexts):
    """One context manager factory entering each of `contexts` (factories) in turn."""
    @contextlib.contextmanager
    def entered():
        with contextlib.ExitStack() as stack:
            for context in contexts:
                stack.enter_context(context())
            yield
    return entered


def native_module(strategy: str, model, mesh, bucket_mb: float | None = None, precision: str = "fp32"):
    """(module, step context, data axis or None): `strategy` applied by hand to `model` (changed in place).
    The step context wraps forward, loss and backward: loss_parallel for tp+sp, autocast for bf16 without FSDP."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor.parallel import loss_parallel, parallelize_module
    bf16 = precision == "bf16-mixed"
    # FSDP2's own mixed precision: it gathers bf16 weights and reduces float32 gradients, like autopar's
    shard = ({"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)}
             if bf16 else {})
    autocast = ((lambda: torch.autocast(mesh.device_type, dtype=torch.bfloat16)) if bf16 and "fsdp" not in strategy
                else contextlib.nullcontext)
    if strategy in ("ddp", "zero1"):   # zero1: its optimizer is torch's ZeroRedundancyOptimizer (native_optimizer)
        return torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=bucket_mb), autocast, "dp"
    if strategy == "fsdp":
        for block in model.h:
            fully_shard(block, mesh=mesh, **shard)
        return fully_shard(model, mesh=mesh, **shard), autocast, "dp"
    tp_mesh = mesh["tp"]
    _use_local_heads(model, tp_mesh.size())
    sp = strategy == "tp+sp"
    parallelize_module(model, tp_mesh, _tp_plan(model, sequence_parallel=sp))
    if strategy == "fsdp+tp":
        for block in model.h:
            fully_shard(block, mesh=mesh["dp"], **shard)
        return fully_shard(model, mesh=mesh["dp"], **shard), autocast, "dp"
    # loss_parallel: cross-entropy on vocab-split logits; it must wrap backward too
    return model, (_entered(loss_parallel, autocast) if sp else autocast), None


def native_optimizer(strategy: str, module, lr: float):
    """AdamW; for zero1 wrapped in torch's ZeRO-1, ZeroRedundancyOptimizer: DDP all-reduces the gradients,
    each rank updates the parameters it owns and broadcasts them."""
    if strategy == "zero1":
        from torch.distributed.optim import ZeroRedundancyOptimizer
        return ZeroRedundancyOptimizer(module.parameters(), optimizer_class=torch.optim.AdamW, lr=lr)
    return torch.optim.AdamW(module.parameters(), lr=lr)


# ----------------------------------------------------------------------------- one side's training step

class Side:
    """A module, its optimizer and this rank's inputs; step() is one training step."""

    def __init__(self, module, opt, inputs, targets, loss_context=contextlib.nullcontext, after_backward=None):
        self.module, self.opt, self.inputs, self.targets = module, opt, inputs, targets
        self.loss_context, self.after_backward = loss_context, after_backward
        # a GPU runs the step's kernels after step() returns: wait for them before reading the clock
        self.sync = torch.cuda.synchronize if inputs[0].is_cuda else (lambda: None)
        self.times, self.losses, self.faults = [], [], []
        self.num_steps = 0   # all steps, the untimed ones under the profiler too

    def step(self) -> torch.Tensor:
        self.num_steps += 1
        self.opt.zero_grad(set_to_none=True)
        with self.loss_context():
            loss = gpt_loss(self.module(*self.inputs), self.targets)
            loss.backward()
        if self.after_backward is not None:
            self.after_backward(self.module)
        self.opt.step()
        return loss.detach()

    def timed_step(self):
        dist.barrier()   # every rank starts the step together: the step's time is its slowest rank's
        self.sync()
        f0, t0 = _minor_faults(), time.perf_counter()
        loss = self.step()
        self.sync()
        self.times.append(time.perf_counter() - t0)
        self.faults.append(_minor_faults() - f0)
        # a float, not the tensor: a 0-d tensor kept from every step pins a small block among the freed
        # activations, and the heap, fragmented, grows and takes page faults on either side by chance
        self.losses.append(loss_value(loss))


def _minor_faults() -> int:
    """Page faults this process took so far that the OS served without I/O. A step that takes many touches
    pages the process had not touched before or had given back, ~5-10 us a page on the VM this was
    measured on: 1024 of them (4 MiB) a step moved the ddp ratio by ~0.05."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def loss_value(loss: torch.Tensor) -> float:
    """This rank's loss as a float (loss_parallel gives a replicated DTensor)."""
    return float(loss.to_local() if hasattr(loss, "to_local") else loss)


def count_collectives(side: Side) -> dict:
    """{kind: count} of the collectives one step of `side` launches, and their total under "total"."""
    from torch.profiler import ProfilerActivity, profile
    dist.barrier()   # outside the profile: not part of the step
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        side.step()
    counts, total = collections.Counter(), 0
    for e in prof.events():
        if e.name.startswith(("gloo:", "nccl:")):   # the work the backend ran: one per collective
            total += 1
        elif e.name.startswith("c10d::"):     # the op that launched it (gloo's names merge reduce-scatter)
            name = e.name.split("::", 1)[1].replace("_", "")
            counts[next((k for key, k in KINDS if key in name), e.name)] += 1
    return {**counts, "total": total}


def _union(intervals: list) -> list:
    """Sorted, merged (start, end) intervals."""
    merged = []
    for a, b in sorted(intervals):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return merged


def _intersection_length(xs: list, ys: list) -> float:
    """Total length of the overlap of two merged interval lists."""
    total, i, j = 0.0, 0, 0
    while i < len(xs) and j < len(ys):
        total += max(0.0, min(xs[i][1], ys[j][1]) - max(xs[i][0], ys[j][0]))
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return total


def stream_overlap(side: Side) -> dict:
    """On a GPU: how much of one step's communication ran beside its compute, read off a profiler trace.

    The compute stream is the one with the most kernel time; every other stream's work is counted as
    communication: NCCL's kernels and copies, and on the native fsdp side FSDP2's copy-in and
    copy-out streams (autopar has no stream of its own). Returns the ms of GPU time those streams
    were busy, the ms of it while the compute stream ran a kernel too, and the compute stream's
    busy ms."""
    import json

    from torch.profiler import ProfilerActivity, profile
    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        side.step()
        torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        with open(f.name) as trace:
            events = json.load(trace)["traceEvents"]
    by_stream = collections.defaultdict(list)
    for e in events:
        if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "stream" in e.get("args", {}):
            by_stream[e["args"]["stream"]].append((e["ts"], e["ts"] + e.get("dur", 0)))
    if not by_stream:
        return {}
    busy = {s: _union(iv) for s, iv in by_stream.items()}
    compute = max(busy, key=lambda s: sum(b - a for a, b in busy[s]))
    comm = _union([iv for s, ivs in busy.items() if s != compute for iv in ivs])
    return {"comm_ms": sum(b - a for a, b in comm) / 1e3,
            "overlapped_ms": _intersection_length(comm, busy[compute]) / 1e3,
            "compute_ms": sum(b - a for a, b in busy[compute]) / 1e3, "streams": len(busy)}


# ----------------------------------------------------------------------------- one rank

def build_sides(args, strategy, mesh, model, idx, targets) -> tuple:
    """(autopar Side or None, autopar info, native Side); autopar's exception goes into the info."""
    info = {}
    hardware = args.hardware if args.hardware is not None else ("cpu-gloo" if args.device == "cpu" else "h100")
    if args.calibrate:   # on these ranks, with their threads, before either side runs
        PHASE[0] = "calibrating"
        hardware = autopar.calibrate(mesh)
    try:
        t0 = time.perf_counter()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            buckets = {} if args.bucket_mb is None else {"bucket_bytes": int(args.bucket_mb * 2**20)}
            pm = autopar.parallelize(copy.deepcopy(model), mesh, (idx,), strategy=strategy, hardware=hardware,
                                     precision=PRECISIONS[args.precision], **buckets)
        exposed = pm.plan.predicted.exposed_comm_time
        info.update(build_s=time.perf_counter() - t0, predicted=pm.plan.predicted.step_time,
                    predicted_compute=pm.plan.predicted.compute_time, predicted_exposed=sum(exposed.values()),
                    hardware=pm.plan.hardware, warnings=sorted({str(w.message).split("\n")[0] for w in caught}),
                    planned_collectives=len(pm.plan.collectives),
                    peak_flops=resolve_hardware(hardware)[0].flops_per_second(
                        pm.plan.precision.get("compute") or "float32"))
        opt = autopar.ShardedOptimizer(pm, torch.optim.AdamW, lr=args.lr)
        ours = Side(pm, opt, pm.plan.local_inputs(idx), *pm.plan.local_targets(targets))
    except Exception as e:   # every rank fails alike (rank 0 plans and broadcasts the plan or its error)
        info["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        ours = None
    module, loss_context, data_axis = native_module(strategy, copy.deepcopy(model), mesh, args.bucket_mb,
                                                    args.precision)
    inputs, tgt = (idx, targets) if data_axis is None else (batch_shard(idx, mesh, data_axis),
                                                            batch_shard(targets, mesh, data_axis))
    native = Side(module, native_optimizer(strategy, module, args.lr), (inputs,), tgt, loss_context,
                  after_backward=grads_as_params)
    return ours, info, native


PHASE = ["starting"]   # what this rank is doing, for the error report of a rank that fails or hangs


def measure(rank: int, args, strategy: str) -> dict:
    """Everything one rank measures for one strategy (see the module docstring for the protocol)."""
    from torch.distributed.device_mesh import init_device_mesh
    shape, names = mesh_shape(strategy, args.dp), STRATEGIES[strategy][1]
    mesh = init_device_mesh(args.device, shape, mesh_dim_names=names)
    device = torch.device(args.device, torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    model, (idx, targets) = build_model(args, device), make_batch(args, device)
    reference = None
    if rank == 0:   # the single-device loss the first step of both sides must reproduce
        with torch.no_grad():
            reference = float(gpt_loss(model(idx), targets))
    PHASE[0] = "building both sides"
    ours, info, native = build_sides(args, strategy, mesh, model, idx, targets)
    sides = {"autopar": ours, "native": native} if ours is not None else {"native": native}
    for name, side in sides.items():
        PHASE[0] = f"{name} warm-up"
        for _ in range(WARMUP):
            side.timed_step()
    first = {name: s.losses[0] for name, s in sides.items()}
    collectives, overlap = {}, {}
    for name, side in sides.items():
        PHASE[0] = f"{name} step under the profiler"
        collectives[name] = count_collectives(side)
        if args.device == "cuda":
            try:
                overlap[name] = stream_overlap(side)
            except Exception as e:   # a trace this code cannot read costs its line in the report, not the run
                overlap[name] = {"error": f"{type(e).__name__}: {e}"}
        side.times.clear()
        side.faults.clear()
    for r in range(args.rounds):
        order = list(sides.items()) if r % 2 == 0 else list(reversed(sides.items()))
        for name, side in order:
            PHASE[0] = f"{name} round {r + 1}"
            for _ in range(args.steps):
                side.timed_step()
    PHASE[0] = "done"
    return {"times": {n: s.times for n, s in sides.items()}, "faults": {n: s.faults for n, s in sides.items()},
            "first_loss": first,
            "last_loss": {n: s.losses[-1] for n, s in sides.items()},
            "num_steps": {n: s.num_steps for n, s in sides.items()},
            "collectives": collectives, "overlap": overlap, "reference": reference, "autopar": info,
            "flops": gpt_flops_per_step(args), "precision": args.precision}


def run_rank(rank: int, world: int, port: int, args, strategy: str, result_dir: str):
    """One spawned rank: join gloo, measure, leave rank<r>.pt (or rank<r>.err with the traceback)."""
    # kineto's "USDT ..." lines and torch's warnings go to a log file, not the table; a failure's
    # traceback goes to rank<r>.err, whose last line the parent puts in the row
    log = open(os.path.join(result_dir, f"rank{rank}.log"), "w")
    os.dup2(log.fileno(), 2)
    torch.set_num_threads(args.threads)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    if args.device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=args.timeout))
    try:
        result = measure(rank, args, strategy)
        dist.barrier()   # no rank tears gloo down while a peer still talks to it
        torch.save(result, os.path.join(result_dir, f"rank{rank}.pt"))
    except BaseException:
        # the time first: a rank's failure makes its peers fail too, and the parent reports the first
        with open(os.path.join(result_dir, f"rank{rank}.err"), "w") as f:
            f.write(f"{time.time()!r}\n{PHASE[0]}\n{traceback.format_exc()}")
        raise
    finally:
        dist.destroy_process_group()


# ----------------------------------------------------------------------------- the parent

def spawn(strategy: str, args) -> list:
    """Run measure() on the strategy's ranks; their results in rank order, or RuntimeError naming a failure."""
    from autopar.testing.harness import free_port
    world = world_size(strategy, args.dp)
    with tempfile.TemporaryDirectory(prefix="runtime_overhead_") as result_dir:
        # children read OMP_NUM_THREADS when they import torch, before run_rank runs
        saved = os.environ.get("OMP_NUM_THREADS")
        os.environ["OMP_NUM_THREADS"] = str(args.threads)
        try:
            ctx = mp.start_processes(run_rank, args=(world, free_port(), args, strategy, result_dir),
                                     nprocs=world, join=False, start_method="spawn")
        finally:
            if saved is None:
                del os.environ["OMP_NUM_THREADS"]
            else:
                os.environ["OMP_NUM_THREADS"] = saved
        try:
            # no deadline of its own: a rank stuck in a collective raises after --timeout (gloo's), and
            # join raises as soon as any rank has failed
            while not ctx.join():
                pass
        except mp.ProcessRaisedException:
            raise RuntimeError(_first_error(result_dir, world)) from None
        except mp.ProcessExitedException as e:
            raise RuntimeError(f"rank {e.error_index} exited: {e.msg}") from None
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
                p.join()
        return [torch.load(os.path.join(result_dir, f"rank{r}.pt"), weights_only=False) for r in range(world)]


def _first_error(result_dir: str, world: int) -> str:
    """The rank that failed first (by its .err file's time), where it was, and its traceback's last line."""
    failures = []
    for r in range(world):
        path = os.path.join(result_dir, f"rank{r}.err")
        if os.path.exists(path):
            with open(path) as f:
                when, phase, tb = f.read().split("\n", 2)
            failures.append((float(when), r, phase, tb.strip().splitlines()[-1]))
    if not failures:
        return "a rank failed without a traceback"
    _, r, phase, last = min(failures)
    return f"rank {r} in {phase}: {last}"


def step_ms(results: list, side: str) -> tuple:
    """(median, first quartile, third quartile) over steps of the step's time on its slowest rank, in ms."""
    slowest = [1e3 * max(ts) for ts in zip(*(r["times"][side] for r in results))]
    if len(slowest) < 2:
        return slowest[0], slowest[0], slowest[0]
    q1, _, q3 = statistics.quantiles(slowest, n=4)
    return statistics.median(slowest), q1, q3


def round_ratios(results: list, steps: int) -> list:
    """autopar / native per round: each round's median step (slowest rank) of one side over the other's in
    the same round. The two sides of a round ran back to back, so a ratio per round cancels the machine's
    drift between rounds, and their spread shows how far one run's ratio can be trusted."""
    def per_round(side):
        slowest = [max(ts) for ts in zip(*(r["times"][side] for r in results))]
        return [statistics.median(slowest[i:i + steps]) for i in range(0, len(slowest), steps)]
    return [a / n for a, n in zip(per_round("autopar"), per_round("native"))]


def rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def mfu(flops_per_step: float, step_ms: float, ranks: int, peak_flops: float) -> float:
    """Model FLOPs utilization: the model's FLOPs over what `ranks` devices at `peak_flops` could do in the step."""
    return flops_per_step / (step_ms / 1e3 * ranks * peak_flops)


def summarize(strategy: str, results: list, steps: int) -> dict:
    """One table row (and its details) from every rank's results."""
    r0, world = results[0], len(results)
    info = r0["autopar"]
    # each rank's loss is the mean over its batch shard (or the whole batch), and every shard is held
    # by the same number of ranks, so the mean over ranks is the global mean loss
    first = {side: sum(r["first_loss"][side] for r in results) / world for side in r0["first_loss"]}
    last = {side: sum(r["last_loss"][side] for r in results) / world for side in r0["last_loss"]}
    native_ms, *native_iqr = step_ms(results, "native")
    row = {"strategy": strategy, "ranks": world, "native_ms": native_ms, "native_iqr": native_iqr,
           "precision": r0["precision"],
           "native_coll": r0["collectives"]["native"], "info": info, "first": first, "last": last,
           "reference": r0["reference"], "num_steps": r0["num_steps"]["native"], "overlap": r0["overlap"],
           "faults": {side: [max(f) for f in zip(*(r["faults"][side] for r in results))] for side in r0["faults"]}}
    diffs = [rel(first["native"], r0["reference"])]
    if "autopar" in first:
        autopar_ms, *autopar_iqr = step_ms(results, "autopar")
        row.update(autopar_ms=autopar_ms, autopar_iqr=autopar_iqr, autopar_coll=r0["collectives"]["autopar"],
                   round_ratios=round_ratios(results, steps),
                   mfu={side: mfu(r0["flops"], ms, world, info["peak_flops"])
                        for side, ms in (("native", native_ms), ("autopar", autopar_ms))})
        diffs += [rel(first["autopar"], first["native"]), rel(first["autopar"], r0["reference"])]
    row["loss_diff"] = max(diffs)
    return row


def _coll(counts) -> str:
    return "-" if counts is None else str(counts["total"])


def _iqr(quartiles) -> str:
    return f"{quartiles[0]:.1f}-{quartiles[1]:.1f}"


def _kinds(counts) -> str:
    kinds = ", ".join(f"{k} {v}" for k, v in sorted(counts.items()) if k != "total")
    return kinds + ("" if sum(v for k, v in counts.items() if k != "total") == counts["total"]
                    else f" (gloo ran {counts['total']})")


def table_cells(row: dict) -> list:
    """The cells of one table row; a failed side says so in its first cell."""
    head = [row["strategy"], str(row["ranks"]), NATIVE_NAMES[row["strategy"]]]
    if "failed" in row:   # the ranks died: neither side measured
        return head + [f"failed: {row['failed']}"] + [""] * 8
    info = row["info"]
    match = ("ok" if row["loss_diff"] <= LOSS_RTOL[row["precision"]] else "WARN") + f" ({row['loss_diff']:.1e})"
    if "autopar_ms" not in row:
        return head + [f"{row['native_ms']:.1f}", f"failed: {info['error']}", "", "", _coll(row["native_coll"]),
                       "", "", "", match]
    return head + [f"{row['native_ms']:.1f}", f"{row['autopar_ms']:.1f}", f"{row['autopar_ms'] / row['native_ms']:.2f}",
                   f"{row['mfu']['native']:.1%} / {row['mfu']['autopar']:.1%}", _coll(row["native_coll"]), _coll(row["autopar_coll"]), f"{info['predicted'] * 1e3:.1f}",
                   f"{info['predicted'] * 1e3 / row['autopar_ms'] - 1:+.0%}", match]


def print_table(rows: list, args):
    print("| strategy | ranks | native | native ms | autopar ms | ratio | MFU native / autopar | native coll/step "
          "| autopar coll/step | predicted ms | prediction error | loss match |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(table_cells(row)) + " |")
    print_details(rows, args)


def _model_size(args) -> str:
    params = sum(p.numel() for p in build_model(args, "meta").parameters())
    return (f"{params / 1e6:.1f}M parameters: {args.layers} layers, n_embd {args.hidden}, {args.heads} heads, "
            f"vocab {args.vocab}, batch {args.batch} x {args.seq}")


def print_details(rows: list, args):
    print()
    hardware = {row["info"]["hardware"] for row in rows if "hardware" in row.get("info", {})}
    how = ("autopar.calibrate(mesh) on the same ranks before the sides ran (--calibrate)" if args.calibrate else
           "given by --hardware" if args.hardware is not None else
           "the planner's default for a CPU mesh" if args.device == "cpu" else "this benchmark's default on GPUs")
    print(f"predicted ms: plan.predicted.step_time for hardware {', '.join(sorted(hardware)) or '-'} ({how}); "
          "prediction error: predicted / autopar ms - 1")
    peaks = {row["info"]["peak_flops"] for row in rows if "peak_flops" in row.get("info", {})}
    print(f"MFU: {gpt_flops_per_step(args):.3g} model FLOPs a step over ranks x step time x that hardware's peak "
          f"at the compute dtype ({', '.join(f'{p:.3g}' for p in sorted(peaks)) or '-'} FLOP/s a device); "
          f"device {args.device}, precision {args.precision}, model {args.model} ({_model_size(args)})")
    for row in rows:
        if "failed" in row:
            continue
        print(f"{row['strategy']}: step ms, quartiles over steps: native {_iqr(row['native_iqr'])}"
              + (f", autopar {_iqr(row['autopar_iqr'])}" if "autopar_iqr" in row else ""))
        if "round_ratios" in row:
            rr = row["round_ratios"]
            print(f"{row['strategy']}: ratio per round (the sides' rounds ran back to back): median "
                  f"{statistics.median(rr):.2f}, range {min(rr):.2f}-{max(rr):.2f} over {len(rr)} rounds")
            faults = {side: statistics.median(row["faults"][side]) for side in ("native", "autopar")}
            print(f"{row['strategy']}: minor page faults per step (median over timed steps, most of any rank): "
                  f"native {faults['native']:.0f}, autopar {faults['autopar']:.0f}")
        print(f"{row['strategy']}: native collectives {_kinds(row['native_coll'])}")
        if "autopar_coll" not in row:
            continue
        info = row["info"]
        print(f"{row['strategy']}: autopar collectives {_kinds(row['autopar_coll'])}; plan.collectives has "
              f"{info['planned_collectives']}; built in {info['build_s']:.1f} s")
        print(f"{row['strategy']}: predicted ms = compute {info['predicted_compute'] * 1e3:.1f} + exposed "
              f"communication {info['predicted_exposed'] * 1e3:.1f}")
        print(f"{row['strategy']}: loss step 1 autopar {row['first']['autopar']:.6f} native "
              f"{row['first']['native']:.6f} one device {row['reference']:.6f}; after "
              f"{row['num_steps']} steps autopar {row['last']['autopar']:.6f} "
              f"native {row['last']['native']:.6f} (rel diff {rel(row['last']['autopar'], row['last']['native']):.1e})")
        for side, o in row["overlap"].items():
            if "error" in o:
                print(f"{row['strategy']}: {side} GPU streams not read: {o['error']}")
            elif o:
                print(f"{row['strategy']}: {side} GPU time of one step: compute stream busy {o['compute_ms']:.1f} ms; "
                      f"other streams (NCCL's, FSDP2's) busy {o['comm_ms']:.1f} ms, "
                      f"{o['overlapped_ms']:.1f} ms of it beside compute "
                      f"({o['streams']} streams)")
        for w in info["warnings"]:
            print(f"{row['strategy']}: autopar warning: {w}")
    print()
    print("command: " + " ".join([os.path.basename(sys.executable)] + sys.argv))
    if args.device == "cuda":
        print(f"GPUs: one per rank, NCCL, {torch.cuda.get_device_name(0)}")
    else:
        print(f"threads: torch.set_num_threads({args.threads}) and OMP_NUM_THREADS={args.threads} in each rank "
              f"({os.cpu_count()} cores here); ranks share the cores, so with more ranks than cores "
              "the times include waiting for a core")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--strategies", default=",".join(STRATEGIES), help=f"comma-separated, of {','.join(STRATEGIES)}")
    p.add_argument("--model", choices=sorted(MODELS), default="small",
                   help="a GPT's sizes; the flags below override each. " + "; ".join(
                       f"{k}: {', '.join(f'{f} {v}' for f, v in d.items())}" for k, d in MODELS.items()))
    p.add_argument("--layers", type=int)
    p.add_argument("--hidden", type=int, help="n_embd")
    p.add_argument("--heads", type=int, help="n_head (the tp degree, 2, must divide it)")
    p.add_argument("--vocab", type=int)
    p.add_argument("--seq", type=int, help="sequence length (also the model's block_size)")
    p.add_argument("--batch", type=int, help="global batch (sequences)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="cuda: a GPU per rank and NCCL; auto: cuda where there are GPUs for every rank, else cpu")
    p.add_argument("--dp", type=int, default=None,
                   help="size of the strategies' data axis (ddp, fsdp, zero1, and fsdp+tp's dp); default 2. "
                        "--dp 1 times the runtime alone, no gradient traffic, e.g. on a machine with one GPU")
    p.add_argument("--precision", choices=sorted(PRECISIONS), default=None,
                   help="both sides' precision; default bf16-mixed on cuda, fp32 on cpu")
    p.add_argument("--steps", type=int, default=5, help="timed steps per side per round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    p.add_argument("--hardware", default=None,
                   help=f"cost-model preset ({', '.join(sorted(cm.PRESETS))}) or a JSON hardware spec, as "
                        "autopar.calibrate(mesh, path) writes; default: the planner's (cpu-gloo for a CPU mesh)")
    p.add_argument("--calibrate", action="store_true",
                   help="plan with autopar.calibrate(mesh), run on each strategy's ranks before they are timed "
                        "(adds ~10 s per mesh axis)")
    p.add_argument("--bucket-mb", type=float, default=None,
                   help="gradient bucket size in MiB for both sides (autopar's bucket_bytes, DDP's bucket_cap_mb); "
                        "default: each side's own (25 MiB; DDP also caps its first bucket at 1 MiB)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=int, default=300,
                   help="seconds a collective may wait before its ranks give up (gloo's timeout)")
    args = p.parse_args(argv)
    for field, value in MODELS[args.model].items():
        if getattr(args, field) is None:
            setattr(args, field, value)
    unknown = [s for s in args.strategies.split(",") if s not in STRATEGIES]
    if unknown:
        p.error(f"unknown strategies {unknown}; choose from {','.join(STRATEGIES)}")
    tp_degrees = [STRATEGIES[s][0][-1] for s in args.strategies.split(",") if "tp" in s]
    if args.hidden % args.heads or any(args.heads % n for n in tp_degrees):
        p.error(f"--heads {args.heads} must divide --hidden {args.hidden}, and the tp degree "
                f"{max(tp_degrees, default=1)} must divide --heads (the native TP splits whole heads)")
    if args.dp is not None and args.dp < 1:
        p.error(f"--dp {args.dp}: the data axis needs at least one rank")
    ranks = max(world_size(s, args.dp) for s in args.strategies.split(","))
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.device_count() >= ranks else "cpu"
    elif args.device == "cuda" and torch.cuda.device_count() < ranks:
        p.error(f"--device cuda: {args.strategies} needs {ranks} GPUs (one per rank), "
                f"this machine has {torch.cuda.device_count()}")
    if args.precision is None:
        args.precision = "bf16-mixed" if args.device == "cuda" else "fp32"
    if args.calibrate and args.hardware is not None:
        p.error("--calibrate measures the hardware; give it or --hardware, not both")
    if args.hardware is not None:
        try:
            resolve_hardware(args.hardware)
        except cm.CostModelError as e:
            p.error(f"--hardware: {e}")
    return args


def main():
    args = parse_args()
    rows = []
    for strategy in args.strategies.split(","):
        t0 = time.perf_counter()
        print(f"{strategy}: running ...", file=sys.stderr, flush=True)
        try:
            rows.append(summarize(strategy, spawn(strategy, args), args.steps))
        except RuntimeError as e:
            rows.append({"strategy": strategy, "ranks": world_size(strategy, args.dp), "failed": str(e)})
        print(f"{strategy}: done in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    print_table(rows, args)


if __name__ == "__main__":
    main()
