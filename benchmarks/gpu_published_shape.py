"""torchtitan's published Llama 3 8B step on one GPU, reduced in depth: measured against autopar's prediction.

    python benchmarks/gpu_published_shape.py                 # 4 layers, 2 x 8192 tokens, every side (a GPU)
    python benchmarks/gpu_published_shape.py --layers 2 --sides per-op,per-op-compiled
    python benchmarks/gpu_published_shape.py --predict-only  # autopar's figures alone (no GPU needed)
    python benchmarks/gpu_published_shape.py --cpu-smoke     # the whole script at a tiny shape on CPU (tests)

What it settles (docs/published-runs.md): autopar predicts torchtitan's Llama 3 8B FSDP 8 rows (Dec 2024,
local batch 2 x 8192, per-op selective AC, bf16 mixed precision) (a) ~9% fast eager, (b) with too much gain
from torch.compile (published 16%, predicted ~23%), and (c) with memory under the published figure, which is
torch.cuda.max_memory_reserved where autopar predicts tensors (allocated). On 8 H100s over NVLink FSDP's
traffic is hidden, so one GPU running the same per-GPU work shows the compute: this runs the 8B layer shape
at torchtitan's per-GPU batch, with fewer layers (--layers, default 4: 8B's 32 do not fit one GPU unsharded).

The model is Hugging Face's LlamaForCausalLM at Llama 3 8B's shape (hidden 4096, intermediate 14336, 32 query
heads sharing 8 key/value heads, vocabulary 128256, rope theta 500000, SDPA attention), the loss outside it as
torchtitan computes it (and benchmarks/published.py plans it): cross-entropy of the logits cast to float32.
AdamW (lr 1e-4, foreach, as torchtitan) and torchtitan's gradient clipping (max norm 1, foreach) each step.

Precision, by default (--mixed fsdp): FSDP2 on a one-rank mesh, each decoder layer and then the root
fully_shard-ed with MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32), the last layer not resharded
after forward, as torchtitan's apply_fsdp. That is torchtitan's mixed precision (float32 master weights and
optimizer state; every op, norms and the residual stream included, sees bf16 weights and activations) and
it is what autopar's precision="bf16-mixed" models (autopar/capture/compute_dtype.py: the graph traced with
bf16 weights, FSDP2's policy). torch.autocast(bf16) is not the same computation: the embedding's output and
with it the residual stream stay float32 (only matmuls and attention cast), so activations and elementwise
time differ from torchtitan's; it is kept as --mixed autocast (no FSDP; planned with strategy "ddp") for
comparison. On one rank FSDP2's gathers and reduce-scatters move nothing between GPUs; their copy-in/out and
bf16 casts run, as they did in torchtitan's job.

Sides (one model and optimizer: the sides switch how each decoder layer runs, so the compile is paid once
and the memory is one model's; rounds alternate the order, as gpu_step.py):
    per-op            torchtitan's per-op selective AC on every decoder layer, eager: checkpoint(layer,
                      use_reentrant=False, context_fn=...) with create_selective_checkpoint_contexts and
                      torchtitan's policy (sac_policy: save mm, flash/efficient attention, reduce_scatter,
                      max, but every second mm of a block, forward and recompute counted apart)
    per-op-compiled   the same, each decoder layer's checkpointed call compiled alone
                      (torch.compile(..., fullgraph=True), as torchtitan's apply_compile at 9dec370; fullgraph=False
                      if that fails, printed); embedding, final norm, output and loss eager
    full              every decoder layer checkpointed whole, eager
Per side: the median step (synchronized; after --warmup untimed steps in the first round, the compile among
them), torch.cuda.max_memory_allocated and max_memory_reserved over its steps (before each side's steps in
each round: gc, empty_cache, the peaks reset, then one untimed step refills the pool), and autopar's
prediction for the same job, at the same depth: autopar.plan(the model on meta, (tokens, labels), {"dp": 1},
strategy="fsdp", precision="bf16-mixed", checkpointing="per-op" or "full", hardware h100 or h200 as the GPU's
name says). The compiled side's
prediction is step_time - fused_time["blocks"] (the saving in the compiled region alone, as published.py
prices torchtitan's compiled rows), or compiled_step_time where this autopar has no fused_time.
A second table sets the optimizer (clip and AdamW, timed synchronized in one more untimed step per side and
round) beside autopar's optimizer term, so the compute's error reads apart from the optimizer's.
Where the `kernels` package is installed, transformers wraps the attention's forward in a context-variable set
that torch.compile refuses inside a checkpoint under fullgraph; it is taken off (unwrap_hub_kernel_forwards:
no hub kernel is loaded, the computation is the layer's own). The per-op policy's decisions for the first
block are printed (which attention kernel ran, which mms it saved), with a warning where attention ran as a
kernel the policy does not save (cuDNN's, or the math fallback).
PYTORCH_CUDA_ALLOC_CONF defaults to expandable_segments:True, as torchtitan's run_llama_train.sh launched its
runs (set it to something else, e.g. "expandable_segments:False", to measure the other allocator).
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import math
import os
import statistics
import sys
import time
import warnings
from collections import defaultdict

import torch
import torch.distributed as dist
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

GiB = 2**30
LLAMA3_8B = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                 vocab_size=128256, max_position_embeddings=8192)
TINY = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
            max_position_embeddings=64)
SIDES = ("per-op", "per-op-compiled", "full")
CHECKPOINTING = {"per-op": "per-op", "per-op-compiled": "per-op", "full": "full"}


# --- torchtitan's per-op selective AC policy (parallelize_llama.py at 9dec370), written here -------------------

def sac_save_ops() -> frozenset:
    """The ops whose outputs torchtitan's per-op SAC saves (its _save_list), those this torch has."""
    ops = [torch.ops.aten.mm.default, torch.ops.aten._scaled_dot_product_efficient_attention.default,
           torch.ops.aten._scaled_dot_product_flash_attention.default, torch.ops.aten.max.default]
    with contextlib.suppress(AttributeError, RuntimeError):   # registered once torch.distributed is imported
        ops.append(torch.ops._c10d_functional.reduce_scatter_tensor.default)
    return frozenset(ops)


def sac_policy(meta: dict, log: list | None = None):
    """torchtitan's policy over `meta` (a defaultdict(int), fresh per checkpointed call): every op in
    sac_save_ops() is MUST_SAVE except every second aten.mm of the block (the 2nd, 4th, ...; forward and
    recompute counted apart, as torchtitan's: torch 2.13 asks the policy in forward only and the rerun replays
    its decisions by index), everything else PREFER_RECOMPUTE. `log` collects (mode, op, saved)."""
    save_ops, mm = sac_save_ops(), torch.ops.aten.mm.default

    def policy(ctx, func, *args, **kwargs):
        mode = "recompute" if ctx.is_recompute else "forward"
        if func == mm:
            meta[f"{mode}_mm_count"] += 1
        save = func in save_ops and not (func == mm and meta[f"{mode}_mm_count"] % 2 == 0)
        if log is not None:
            log.append((mode, func, save))
        return CheckpointPolicy.MUST_SAVE if save else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def sac_context_fn():
    """context_fn for one checkpointed call: a fresh count per block (module level, no closure: the kind
    torch.compile takes, as torchtitan's selective_checkpointing_context_fn)."""
    return create_selective_checkpoint_contexts(sac_policy(defaultdict(int)))


def logging_sac_context_fn(log: list):
    return create_selective_checkpoint_contexts(sac_policy(defaultdict(int), log))


class Checkpointed(torch.nn.Module):
    """A decoder layer under non-reentrant activation checkpointing: whole (context_fn None) or per-op."""

    def __init__(self, layer, context_fn=None):
        super().__init__()
        self.layer, self.context_fn = layer, context_fn

    def forward(self, *args, **kwargs):
        extra = {} if self.context_fn is None else {"context_fn": self.context_fn}
        return checkpoint(self.layer, *args, use_reentrant=False, **extra, **kwargs)


class Block(torch.nn.Module):
    """One decoder layer, run as `mode` says (a side of SIDES). The checkpoint wrappers and the compiled
    wrapper hold the same layer but are kept out of the module tree (a plain dict), so FSDP2 and the optimizer
    see each parameter once, and FSDP2's hooks sit outside the compiled region, as in torchtitan
    (fully_shard(torch.compile(checkpoint_wrapper(block))))."""

    def __init__(self, layer, policy_log: list):
        super().__init__()
        self.layer, self.mode = layer, "per-op"
        self.runners = {"per-op": Checkpointed(layer, functools.partial(logging_sac_context_fn, policy_log)),
                        "full": Checkpointed(layer)}

    def compile_layer(self, fullgraph: bool = True, backend: str = "inductor"):
        self.runners["per-op-compiled"] = torch.compile(Checkpointed(self.layer, sac_context_fn),
                                                        fullgraph=fullgraph, backend=backend)

    def forward(self, *args, **kwargs):
        return self.runners[self.mode](*args, **kwargs)


class WithLoss(torch.nn.Module):
    """The model and torchtitan's loss (as benchmarks/published.py's WithLoss)."""

    def __init__(self, hf):
        super().__init__()
        self.model = hf

    def forward(self, input_ids, labels):
        logits = self.model(input_ids=input_ids, use_cache=False).logits
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1))


def config(args):
    from transformers import LlamaConfig
    return LlamaConfig(**(TINY if args.cpu_smoke else LLAMA3_8B), num_hidden_layers=args.layers,
                       rope_theta=500000.0, use_cache=False, attn_implementation="sdpa", tie_word_embeddings=False)


def build(cfg, device) -> WithLoss:
    from transformers import LlamaForCausalLM
    torch.manual_seed(0)
    with torch.device(device):
        hf = LlamaForCausalLM(cfg)
    unwrapped = unwrap_hub_kernel_forwards(hf)
    if unwrapped:
        print(f"the kernels package's forward wrapper taken off {', '.join(unwrapped)} (unwrap_hub_kernel_forwards)")
    return WithLoss(hf.to(device=device, dtype=torch.float32).train())


def unwrap_hub_kernel_forwards(model) -> list:
    """Where the `kernels` package is installed, transformers wraps LlamaAttention.forward
    (use_kernelized_func) in a forward that sets a context variable around the layer's own code. Inside a
    checkpoint that is a side effect torch.compile refuses under fullgraph ("HOP: Unsafe side effect"); without
    fullgraph the whole checkpointed layer would run eager. No hub kernel is loaded here (nothing calls
    kernelize), so the wrapped forward computes what the layer's own forward computes: each such module gets
    its own forward back. Returns the classes unwrapped."""
    import types
    done = set()
    for m in model.modules():
        f = type(m).forward
        if hasattr(f, "__wrapped__") and "kernels" in f.__code__.co_filename.replace("\\", "/").split("/"):
            m.forward = types.MethodType(f.__wrapped__, m)
            done.add(type(m).__name__)
    return sorted(done)


def make_batch(args, cfg, device):
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), generator=g)
    return tokens.to(device), torch.roll(tokens, -1, dims=1).to(device)


# --- autopar's prediction ---------------------------------------------------------------------------------------

def predict(args, cfg) -> dict:
    """checkpointing mode -> autopar's figures for the job, planned on the meta device."""
    import autopar
    from transformers import LlamaForCausalLM
    with torch.device("meta"):
        model = WithLoss(LlamaForCausalLM(cfg).train())
    tokens = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), device="meta")
    strategy = "fsdp" if args.mixed == "fsdp" else "ddp"
    out = {}
    for mode in sorted({CHECKPOINTING[s] for s in args.sides}):
        start = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", autopar.UnsupportedOpWarning)
            plan = autopar.plan(model, (tokens, tokens.clone()), {"dp": 1}, strategy=strategy,
                                precision="bf16-mixed", checkpointing=mode, hardware=args.hardware)
        p = plan.predicted
        fused = getattr(p, "fused_time", None) or {}
        out[mode] = {"step": float(p.step_time), "compute": float(p.compute_time),
                     "optimizer": float(p.optimizer_time),
                     "compiled_blocks": (float(p.step_time) - float(fused["blocks"]) if "blocks" in fused
                                         else float(p.compiled_step_time)),
                     "compiled_how": "step_time - fused_time['blocks']" if "blocks" in fused
                     else "compiled_step_time (whole model: this autopar has no fused_time)",
                     "fused": {k: float(v) for k, v in fused.items()},
                     "memory": {k: float(getattr(p.memory, k)) for k in
                                ("total", "params", "master", "grads", "optimizer", "activations", "transient")},
                     "checkpointed": sorted(set(plan.checkpointed.values())), "seconds": time.perf_counter() - start}
    return out


def predicted_step(side: str, pred: dict) -> float:
    p = pred[CHECKPOINTING[side]]
    return p["compiled_blocks"] if side.endswith("compiled") else p["step"]


# --- running ----------------------------------------------------------------------------------------------------

class Runner:
    """The one model and optimizer every side trains; `side` picks how the decoder layers run."""

    def __init__(self, args, cfg, device):
        self.args, self.device = args, device
        self.policy_log: list = []
        self.model = build(cfg, device)
        layers = self.model.model.model.layers
        self.blocks = [Block(layer, self.policy_log) for layer in layers]
        for i, b in enumerate(self.blocks):
            layers[i] = b
        self.autocast = contextlib.nullcontext
        if args.mixed == "fsdp":
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
            mesh = init_device_mesh(device.type, (1,), mesh_dim_names=("dp",))
            mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            for i, b in enumerate(self.blocks):   # torchtitan: the last block stays gathered for backward
                fully_shard(b, mesh=mesh, mp_policy=mp, reshard_after_forward=i < len(self.blocks) - 1)
            fully_shard(self.model.model, mesh=mesh, mp_policy=mp, reshard_after_forward=True)
        else:
            self.autocast = functools.partial(torch.autocast, device.type, dtype=torch.bfloat16)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4, foreach=True)
        self.fullgraph = True

    def compile(self, fullgraph: bool):
        self.fullgraph = fullgraph
        for b in self.blocks:
            b.compile_layer(fullgraph, self.args.compile_backend)

    def stop_policy_log(self):
        """The eager per-op side without the policy's log from here (the log has what it shows)."""
        for b in self.blocks:
            b.runners["per-op"] = Checkpointed(b.layer, sac_context_fn)
        self.policy_log.clear()

    def use(self, side: str):
        for b in self.blocks:
            b.mode = side

    def step(self, batch, sync=None) -> torch.Tensor:
        """One training step; with `sync` (an untimed step), self.optimizer_seconds is the clip and AdamW alone."""
        self.opt.zero_grad(set_to_none=True)
        with self.autocast():
            loss = self.model(*batch)
        loss.backward()
        if sync is not None:
            sync()
            t0 = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0, foreach=True)
        self.opt.step()
        if sync is not None:
            sync()
            self.optimizer_seconds = time.perf_counter() - t0
        return loss.detach()


def policy_summary(log: list) -> str:
    """What the per-op policy decided in the first block's forward: the logged forward ops before the 8th mm."""
    mm = torch.ops.aten.mm.default
    first, mms = [], 0
    for mode, func, saved in log:
        if mode == "forward":
            mms += func == mm
            if mms > 7:
                break
            first.append((func, saved))
    saved_mm = [i + 1 for i, (_, s) in enumerate(x for x in first if x[0] == mm) if s]
    attention = sorted({str(f) for f, _ in first if "attention" in str(f)})
    kept = sorted({str(f) for f, s in first if s and f != mm})
    unsaved = [a for a in attention if a not in {str(f) for f, s in first if s}]
    warn = (f"\nWARNING: attention ran as {', '.join(unsaved)}, which torchtitan's policy does not save (it saves "
            f"flash and efficient attention): the per-op sides recompute attention, where autopar keeps a fused "
            f"attention's output on a GPU preset"
            if unsaved else "")
    return (f"per-op policy, first block's forward: {min(mms, 7)} mm, saved mm #{', #'.join(map(str, saved_mm))}; "
            f"attention op {', '.join(attention) or 'none seen (math fallback?)'}; other ops saved: "
            f"{', '.join(kept) or 'none'}{warn}")


def run(args) -> dict:
    device = torch.device("cuda" if torch.cuda.is_available() and not args.cpu_smoke else "cpu")
    on_gpu = device.type == "cuda"
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    if args.mixed == "fsdp" and not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29533")
        dist.init_process_group("nccl" if on_gpu else "gloo", rank=0, world_size=1)
    cfg = config(args)
    name = torch.cuda.get_device_name(0) if on_gpu else "cpu"
    print(f"device {name}, torch {torch.__version__}, {args.layers} layers of Llama 3 8B's shape"
          f"{' (tiny: --cpu-smoke)' if args.cpu_smoke else ''}, {args.batch} x {args.seq} tokens, "
          f"mixed precision {args.mixed}, PYTORCH_CUDA_ALLOC_CONF={os.environ.get('PYTORCH_CUDA_ALLOC_CONF')}, "
          f"autopar hardware {args.hardware}", flush=True)

    pred = predict(args, cfg)
    for mode, p in pred.items():
        print(f"autopar, checkpointing {mode!r} (planned in {p['seconds']:.1f} s): step {p['step'] * 1e3:.1f} ms "
              f"= compute {p['compute'] * 1e3:.1f} + optimizer {p['optimizer'] * 1e3:.1f} (+ exposed comm); "
              f"compiled blocks {p['compiled_blocks'] * 1e3:.1f} ms ({p['compiled_how']}); fused_time "
              f"{ {k: round(v * 1e3, 1) for k, v in p['fused'].items()} } ms; memory GiB "
              + ", ".join(f"{k} {v / GiB:.3g}" for k, v in p["memory"].items()), flush=True)
    if args.predict_only:
        return {"pred": pred}

    runner = Runner(args, cfg, device)
    batch = make_batch(args, cfg, device)
    n_params = sum(p.numel() for p in runner.model.parameters())
    print(f"model: {n_params:,} parameters", flush=True)
    sides = list(args.sides)
    results = {s: {"times": [], "optimizer": [], "allocated": 0, "reserved": 0, "losses": [], "warmup_s": 0.0}
               for s in sides}
    for r in range(args.rounds):
        for side in (sides if r % 2 == 0 else sides[::-1]):
            res = results[side]
            runner.use(side)
            t0 = time.perf_counter()
            for i in range(args.warmup if r == 0 else 0):   # the compile, cuBLAS's choices, AdamW's state
                if side == "per-op-compiled" and "per-op-compiled" not in runner.blocks[0].runners:
                    runner.compile(fullgraph=True)
                try:
                    res["losses"].append(float(runner.step(batch)))
                except Exception as e:   # noqa: BLE001 - fullgraph's failure is dynamo's, of any kind
                    if side != "per-op-compiled" or not runner.fullgraph or i:
                        raise
                    print(f"torch.compile(fullgraph=True) failed on the decoder layer ({type(e).__name__}: "
                          f"{str(e).splitlines()[0][:300]}); compiling with fullgraph=False", flush=True)
                    torch.compiler.reset()
                    runner.compile(fullgraph=False)
                    res["losses"].append(float(runner.step(batch)))
                if side == "per-op" and i == 0:
                    print(policy_summary(runner.policy_log), flush=True)
                    runner.stop_policy_log()
            if on_gpu:   # the memory of this side's steps alone: the pool emptied, refilled by one step
                gc.collect()
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            runner.step(batch)
            sync()
            res["warmup_s"] += time.perf_counter() - t0
            for _ in range(args.steps):
                sync()
                t0 = time.perf_counter()
                loss = runner.step(batch)
                sync()
                res["times"].append(time.perf_counter() - t0)
            runner.step(batch, sync)   # untimed: the optimizer's share, synchronized before and after
            res["optimizer"].append(runner.optimizer_seconds)
            res["losses"].append(float(loss))
            if on_gpu:
                res["allocated"] = max(res["allocated"], torch.cuda.max_memory_allocated())
                res["reserved"] = max(res["reserved"], torch.cuda.max_memory_reserved())
            print(f"round {r + 1} {side}: median {statistics.median(res['times'][-args.steps:]) * 1e3:.1f} ms "
                  f"(warm-up {res['warmup_s']:.0f} s so far), loss {res['losses'][-1]:.4f}", flush=True)
        if r < args.rounds - 1:   # a table now too: a run its caller stops later keeps this one
            print_table(results, pred, args, on_gpu, f"after round {r + 1} of {args.rounds}")
    if "per-op-compiled" in sides:
        print(f"per-op-compiled ran with fullgraph={runner.fullgraph}, backend {args.compile_backend}")
    print_table(results, pred, args, on_gpu)
    return {"pred": pred, "results": results, "fullgraph": runner.fullgraph}


def fmt(x, spec=".2f") -> str:
    return "-" if x is None or not math.isfinite(x) else format(x, spec)


def print_table(results: dict, pred: dict, args, on_gpu: bool, when: str = "") -> None:
    print(f"\n{when + ': ' if when else ''}{args.batch} x {args.seq} tokens a step, {args.layers} layers, "
          f"{args.steps} x {args.rounds} timed steps a side (median); ratio = measured / predicted step (above 1: "
          f"predicted fast, as published.py's tokens/s ratio); memory over each side's steps")
    print("| side | measured ms | predicted ms | ratio | max allocated GiB | max reserved GiB | predicted GiB "
          "| reserved/allocated | allocated/predicted |")
    print("|---|---|---|---|---|---|---|---|---|")
    for side, res in results.items():
        ms = statistics.median(res["times"]) * 1e3
        p_ms = predicted_step(side, pred) * 1e3
        p_gib = pred[CHECKPOINTING[side]]["memory"]["total"] / GiB
        alloc = res["allocated"] / GiB if on_gpu else None
        reserved = res["reserved"] / GiB if on_gpu else None
        print(f"| {side} | {ms:.1f} | {p_ms:.1f} | {ms / p_ms:.3f} | {fmt(alloc)} | {fmt(reserved)} | {p_gib:.2f} | "
              f"{fmt(reserved / alloc if on_gpu else None, '.3f')} | {fmt(alloc / p_gib if on_gpu else None, '.3f')} |")
    if "per-op" in results and "per-op-compiled" in results:
        eager = statistics.median(results["per-op"]["times"])
        compiled = statistics.median(results["per-op-compiled"]["times"])
        p = pred["per-op"]
        print(f"\ncompile gain (1 - compiled / eager step): measured {1 - compiled / eager:.1%}, predicted "
              f"{1 - p['compiled_blocks'] / p['step']:.1%} (torchtitan's published 8B FSDP 8 rows: 14-16%: "
              f"2.84 -> 2.46 s, 2.92 -> 2.52 s)")
    print("\n| side | measured optimizer ms (clip + AdamW) | predicted optimizer ms | measured step but the optimizer "
          "| predicted compute + exposed comm |")
    print("|---|---|---|---|---|")
    for side, res in results.items():
        opt, step = statistics.median(res["optimizer"]), statistics.median(res["times"])
        p = pred[CHECKPOINTING[side]]
        print(f"| {side} | {opt * 1e3:.1f} | {p['optimizer'] * 1e3:.1f} | {(step - opt) * 1e3:.1f} | "
              f"{(predicted_step(side, pred) - p['optimizer']) * 1e3:.1f} |")
    for mode, p in pred.items():
        print(f"predicted memory, {mode}: " + ", ".join(f"{k} {v / GiB:.3g}" for k, v in p["memory"].items())
              + " GiB")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--sides", default=",".join(SIDES), help=f"comma-separated, of {SIDES}")
    p.add_argument("--steps", type=int, default=5, help="timed steps per side per round")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per side in the first round")
    p.add_argument("--mixed", choices=("fsdp", "autocast"), default="fsdp",
                   help="fsdp: FSDP2 MixedPrecisionPolicy on one rank (torchtitan's; default); autocast: no FSDP")
    p.add_argument("--compile-backend", default=None, help="torch.compile backend (inductor; the CPU smoke: aot_eager)")
    p.add_argument("--hardware", default=None, help="autopar's preset (default: h200 on an H200, h100 on another GPU)")
    p.add_argument("--predict-only", action="store_true", help="print autopar's figures and stop (no GPU needed)")
    p.add_argument("--cpu-smoke", action="store_true",
                   help="on CPU at a tiny shape: 2 layers, hidden 64, 2 x 32 tokens, 2 steps, 1 round")
    args = p.parse_args(argv)
    args.sides = [s for s in args.sides.split(",") if s]
    if set(args.sides) - set(SIDES):
        p.error(f"unknown sides {sorted(set(args.sides) - set(SIDES))}: choose from {SIDES}")
    if args.cpu_smoke:
        args.layers, args.batch, args.seq, args.steps, args.rounds, args.warmup = 2, 2, 32, 2, 1, 1
        args.compile_backend = args.compile_backend or "aot_eager"   # dynamo and the SAC partition, no C++ build
        args.hardware = args.hardware or "cpu"
    args.compile_backend = args.compile_backend or "inductor"
    if args.hardware is None:
        on_h200 = torch.cuda.is_available() and "H200" in torch.cuda.get_device_name(0)
        args.hardware = "h200" if on_h200 else "h100"
    return args


def main(argv=None):
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")   # before torch touches CUDA
    args = parse_args(argv)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # autopar from this checkout
    out = run(args)
    if dist.is_initialized():
        dist.destroy_process_group()
    return out


if __name__ == "__main__":
    main()
