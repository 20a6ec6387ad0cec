"""One training step on one GPU: autopar's module against eager PyTorch and FSDP2, eager and compiled.

    python benchmarks/gpu_step.py                                  # the 0.886B Llama below, every side (a GPU)
    python benchmarks/gpu_step.py --sides eager,autopar-fsdp --no-compile
    python benchmarks/gpu_step.py --tiny --device cpu --steps 2    # a smoke run on CPU (~1 min on 2 cores)

The model is Hugging Face's LlamaForCausalLM as it ships (SDPA attention), from a config that
describes a 0.886B model: hidden 2048, 16 layers, 16 query heads sharing 8 key/value heads,
intermediate 5632, vocabulary 32000. It is called as its authors call it, with `input_ids=` and
`labels=`, and trained on `out.loss` with AdamW. Every side computes in bf16 and keeps float32 weights:
    eager          the model itself, forward and loss under torch.autocast(bf16)
    fsdp2          fully_shard on each decoder layer, then on the root, MixedPrecisionPolicy(bf16, fp32)
    autopar-ddp    autopar.parallelize(..., strategy="ddp", precision="bf16-mixed") on a mesh of this GPU
    autopar-fsdp   the same, strategy="fsdp"
    autopar-auto   the same, the plan autopar chooses
and, in float8 (issue 55; not in the default --sides), the linear layers' matmuls too:
    torchao-fp8        fsdp2, its decoder layers' linears first converted by torchao's
                       convert_to_float8_training (tensorwise; lm_head left out), as torchtitan trains float8
    autopar-fsdp-fp8   autopar.parallelize(..., strategy="fsdp", precision="fp8-mixed")
    autopar-auto-fp8   the same, the plan autopar chooses
With one rank no collective moves a byte, so the difference from eager is each module's own overhead.
With --compile (the default), every side also runs under torch.compile (inductor), as a second row.

Rounds alternate the sides (each side `--steps` timed steps a round, after `--warmup` untimed ones), so
a slow minute of the machine falls on every side alike. Printed per side: the median step time, tokens
per second, MFU (6N + 12*L*h*s FLOPs per token, N the parameters, against --peak-tflops, 989 for an H100's
dense bf16), autopar's predicted step on the plan's hardware (--hardware: h200 on an H200, else h100;
`plan.predicted.step_time`, and its `compiled_step_time` for a compiled side) and its error, the optimizer
step alone (synchronized before and after),
peak memory (torch.cuda.max_memory_allocated, reset before each side's steps), and the ratio to eager.
The first loss of each side is printed beside eager's: every side trains the same model on the same batch.
With --profile, one more step of each side runs under torch.profiler (step_profile.py): its kernel time by
class (matmul, attention, optimizer, copies, the rest), the ops that differ most from eager's, and autopar's
predicted compute and optimizer terms beside the profiled ones.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import os
import statistics
import time

import torch
import torch.distributed as dist

import autopar

LLAMA_0_9B = dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=8,
                  intermediate_size=5632, vocab_size=32000, max_position_embeddings=4096)
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=128, vocab_size=256, max_position_embeddings=64)
SIDES = ("eager", "fsdp2", "autopar-ddp", "autopar-fsdp", "autopar-auto")
FLOAT8_SIDES = ("torchao-fp8", "autopar-fsdp-fp8", "autopar-auto-fp8")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sides", default=",".join(SIDES), help=f"comma-separated, of {SIDES + FLOAT8_SIDES}")
    p.add_argument("--tiny", action="store_true", help="a 2-layer Llama of width 64 (a smoke run)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--steps", type=int, default=5, help="timed steps per side per round")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per side (compiled: the compile)")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                   help="also run sides under torch.compile (inductor)")
    p.add_argument("--compile-sides", default=None,
                   help="the sides run compiled (default: every side; each costs a compile of the model)")
    p.add_argument("--profile", action="store_true",
                   help="after timing, profile one step of each side: time by kernel class, ops against eager")
    p.add_argument("--hardware", default=None,
                   help="the hardware autopar plans and predicts for (default: h200 on an H200, else h100)")
    p.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak, for MFU (H100 SXM: 989)")
    args = p.parse_args(argv)
    if args.hardware is None:
        on_h200 = torch.cuda.is_available() and "H200" in torch.cuda.get_device_name(0)
        args.hardware = "h200" if on_h200 else "h100"
    if args.tiny:
        args.seq = min(args.seq, 32)
    return args


def build_model(args):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(**(TINY if args.tiny else LLAMA_0_9B), attn_implementation="sdpa", use_cache=False)
    return LlamaForCausalLM(cfg).to(args.device).train(), cfg


def make_batch(args, cfg) -> dict:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), generator=g)
    return {"input_ids": ids.to(args.device), "labels": ids.clone().to(args.device)}


def flops_per_token(model, cfg, seq: int) -> float:
    """Model FLOPs of one token's forward and backward: 6 per weight (embedding lookups excluded) and
    12 * layers * hidden * seq for the attention's two matmuls (no causal discount, as MFU is reported)."""
    n = sum(p.numel() for p in model.parameters()) - model.get_input_embeddings().weight.numel()
    return 6 * n + 12 * cfg.num_hidden_layers * cfg.hidden_size * seq


class Side:
    """One way of training the model: its module, optimizer, the context its forward runs in, and its times."""

    def __init__(self, name, module, opt, context=contextlib.nullcontext, predicted=None):
        self.name, self.module, self.opt, self.context = name, module, opt, context
        self.predicted = predicted   # autopar's plan.predicted: the step, and its compute and optimizer terms
        self.run = module
        self.times, self.optimizer_times, self.first_loss, self.peak = [], [], None, 0
        self.warmup_seconds = 0.0   # the untimed steps; compiled, mostly the compile

    def step(self, batch, sync=None) -> torch.Tensor:
        """One step; with `sync` (a device synchronize), also times the optimizer step alone."""
        self.opt.zero_grad(set_to_none=True)
        with self.context():
            loss = self.run(**batch).loss
        loss.backward()
        if sync is not None:
            sync()
            t0 = time.perf_counter()
        self.opt.step()
        if sync is not None:
            sync()
            self.optimizer_times.append(time.perf_counter() - t0)
        return loss.detach()


def build_side(name: str, model, mesh, batch, args) -> Side:
    m = copy.deepcopy(model)
    if name == "eager":
        autocast = lambda: torch.autocast(args.device, dtype=torch.bfloat16)   # noqa: E731
        return Side(name, m, torch.optim.AdamW(m.parameters(), lr=1e-5), autocast)
    if name in ("fsdp2", "torchao-fp8"):
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        if name == "torchao-fp8":
            from torchao.float8 import convert_to_float8_training
            convert_to_float8_training(m, module_filter_fn=lambda mod, fqn: "lm_head" not in fqn)
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for layer in m.model.layers:
            fully_shard(layer, mesh=mesh, mp_policy=policy)
        fully_shard(m, mesh=mesh, mp_policy=policy)
        return Side(name, m, torch.optim.AdamW(m.parameters(), lr=1e-5))
    strategy = name.removeprefix("autopar-").removesuffix("-fp8")
    precision = "fp8-mixed" if name.endswith("-fp8") else "bf16-mixed"
    pm = autopar.parallelize(m, mesh, example_kwargs=batch, precision=precision, hardware=args.hardware,
                             **({} if strategy == "auto" else {"strategy": strategy}))
    opt = autopar.ShardedOptimizer(pm, torch.optim.AdamW, lr=1e-5)
    return Side(name, pm, opt, predicted=pm.plan.predicted)


def timed(side: Side, batch, steps: int, sync) -> None:
    for _ in range(steps):
        sync()
        t0 = time.perf_counter()
        side.step(batch, sync)
        side.times.append(time.perf_counter() - t0)


def run(args) -> tuple:
    """The sides' rows (eager, then compiled) and their one-step profiles; prints the table as each row ends."""
    on_gpu = args.device.startswith("cuda")
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29531")
        dist.init_process_group("nccl" if on_gpu else "gloo", rank=0, world_size=1)
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh(args.device.split(":")[0], (1,), mesh_dim_names=("dp",))
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    model, cfg = build_model(args)
    batch = make_batch(args, cfg)
    names = [s for s in args.sides.split(",") if s]
    compiled_names = names if args.compile_sides is None else [s for s in args.compile_sides.split(",") if s]
    unknown = set(names + compiled_names) - set(SIDES + FLOAT8_SIDES)
    if unknown:
        raise SystemExit(f"unknown sides {sorted(unknown)}: choose from {SIDES + FLOAT8_SIDES}")
    rows, profiles = [], {}
    for compiled in ([False, True] if args.compile and compiled_names else [False]):
        if compiled:
            torch.compiler.reset()   # the public reset: a benchmark keeps off torch._ APIs
        sides = [build_side(n, model, mesh, batch, args) for n in (compiled_names if compiled else names)]
        for s in sides:
            if compiled:
                s.name += " compiled"
                s.run = torch.compile(s.module)
            t0 = time.perf_counter()   # warm-up: the allocator's pools, cuBLAS's choices, the compile
            losses = [s.step(batch) for _ in range(args.warmup)]
            s.first_loss, s.warmup_seconds = float(losses[0]), time.perf_counter() - t0
        for r in range(args.rounds):
            for s in (sides if r % 2 == 0 else sides[::-1]):
                if on_gpu:
                    torch.cuda.reset_peak_memory_stats()
                timed(s, batch, args.steps, sync)
                if on_gpu:
                    s.peak = max(s.peak, torch.cuda.max_memory_allocated())
        if args.profile:
            from step_profile import print_profiles, profile_step
            row = {s.name: profile_step(lambda: s.step(batch), on_gpu) for s in sides}
            print_profiles(row, baseline="eager compiled" if compiled else "eager")
            print_predicted_terms(sides, row)
            profiles.update(row)
        for s in sides:   # the next row's sides need the memory: keep the figures only
            s.module = s.run = s.opt = None
        rows += sides
        # printed as each row ends: a compile that outlasts the caller's timeout keeps the eager row's table
        print_table(rows, flops_per_token(model, cfg, args.seq), args)
    return rows, profiles


def print_table(rows, per_token: float, args) -> None:
    tokens = args.batch * args.seq
    eager = {("compiled" in s.name): statistics.median(s.times) for s in rows if s.name.startswith("eager")}
    print(f"\n{args.batch} x {args.seq} tokens a step, {args.steps} x {args.rounds} timed steps a side "
          f"(median), device {torch.cuda.get_device_name(0) if args.device.startswith('cuda') else args.device}, "
          f"torch {torch.__version__}")
    print("| side | step ms | vs eager | tokens/s | MFU | predicted ms | prediction error | optimizer ms | peak GiB "
          "| first loss | warm-up s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for s in rows:
        ms = statistics.median(s.times) * 1e3
        base = eager.get("compiled" in s.name)
        ratio = f"{ms / (base * 1e3):.3f}" if base else ""
        mfu = per_token * tokens / (ms / 1e3) / (args.peak_tflops * 1e12)
        predicted = s.predicted and (s.predicted.compiled_step_time if "compiled" in s.name else s.predicted.step_time)
        pred = f"{predicted * 1e3:.1f}" if predicted else ""
        err = f"{(predicted * 1e3 - ms) / ms:+.1%}" if predicted else ""
        print(f"| {s.name} | {ms:.1f} | {ratio} | {tokens / (ms / 1e3):,.0f} | {mfu:.1%} | {pred} | {err} | "
              f"{statistics.median(s.optimizer_times) * 1e3:.1f} | {s.peak / 2**30:.1f} | {s.first_loss:.4f} | "
              f"{s.warmup_seconds:.0f} |")
    torchao = {("compiled" in s.name): statistics.median(s.times) for s in rows if s.name.startswith("torchao-fp8")}
    against = [f"{s.name} {statistics.median(s.times) / torchao[('compiled' in s.name)]:.3f}" for s in rows
               if s.name.startswith("autopar-") and "-fp8" in s.name and ("compiled" in s.name) in torchao]
    if against:   # issue 55's goal: autopar's float8 step at or below torchao's own float8 training's
        print("float8 step time over torchao-fp8's (same mode): " + ", ".join(against))


def print_predicted_terms(rows, profiles) -> None:
    """autopar's predicted compute and optimizer terms beside the profile's kernel times (issue 38 item 3)."""
    print("\n| side | predicted compute ms | predicted optimizer ms | profiled kernels but the optimizer's ms "
          "| profiled optimizer ms |")
    print("|---|---|---|---|---|")
    for s in rows:
        if s.predicted is None or s.name not in profiles:
            continue
        c = profiles[s.name]["classes"]
        print(f"| {s.name} | {s.predicted.compute_time * 1e3:.1f} | {s.predicted.optimizer_time * 1e3:.1f} | "
              f"{sum(c.values()) - c.get('optimizer', 0):.1f} | {c.get('optimizer', 0):.1f} |")


def main(argv=None):
    args = parse_args(argv)
    run(args)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
