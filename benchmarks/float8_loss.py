"""Float8 against bf16 over a training run: the loss curve of precision="fp8-mixed" beside "bf16-mixed".

    python benchmarks/float8_loss.py                          # the 0.886B Llama of gpu_step.py, 200 steps (a GPU)
    python benchmarks/float8_loss.py --tiny --device cpu --steps 20     # a smoke run on CPU

Both runs train the same model from the same weights on the same batches: `--num-batches` fixed batches of
random tokens, cycled, so the model has something to learn (it memorizes them) and the loss falls far
below the uniform guess's ln(vocabulary). autopar plans each run on a mesh of this device (strategy "auto"),
compiled unless --no-compile, AdamW at --lr with a linear warm-up of 20 steps. Printed: the loss every 20 steps
of both runs, and the final loss (the mean of the last 10 steps) of each with their relative difference;
issue 55's goal is float8 within 1% of bf16.
"""
from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

import autopar
from gpu_step import LLAMA_0_9B, TINY


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="gpu_step.py's 2-layer Llama of width 64")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--num-batches", type=int, default=8, help="distinct batches, cycled")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True)
    args = p.parse_args(argv)
    if args.tiny:
        args.seq = min(args.seq, 32)
    return args


def train(precision: str, args, mesh) -> list:
    """The loss of every step of one run."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(**(TINY if args.tiny else LLAMA_0_9B), attn_implementation="sdpa", use_cache=False)
    model = LlamaForCausalLM(cfg).to(args.device).train()
    g = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(args.num_batches):
        ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), generator=g).to(args.device)
        batches.append({"input_ids": ids, "labels": ids.clone()})
    pm = autopar.parallelize(model, mesh, example_kwargs=batches[0], precision=precision)
    run = torch.compile(pm) if args.compile else pm
    opt = autopar.ShardedOptimizer(pm, torch.optim.AdamW, lr=args.lr)
    # (a scheduler takes the torch optimizer ShardedOptimizer steps: it is not one itself)
    warmup = torch.optim.lr_scheduler.LambdaLR(opt.optimizer, lambda step: min(1.0, (step + 1) / 20))
    losses = []
    for step in range(args.steps):
        opt.zero_grad(set_to_none=True)
        loss = run(**batches[step % len(batches)]).loss
        loss.backward()
        opt.step()
        warmup.step()
        losses.append(loss.item())
    return losses


def main(argv=None):
    args = parse_args(argv)
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29532")
        dist.init_process_group("nccl" if args.device.startswith("cuda") else "gloo", rank=0, world_size=1)
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh(args.device.split(":")[0], (1,), mesh_dim_names=("dp",))
    curves = {p: train(p, args, mesh) for p in ("bf16-mixed", "fp8-mixed")}
    device = torch.cuda.get_device_name(0) if args.device.startswith("cuda") else args.device
    print(f"\n{args.steps} steps of {args.batch} x {args.seq} tokens, {args.num_batches} batches cycled, "
          f"device {device}, torch {torch.__version__}, {'compiled' if args.compile else 'eager'}")
    print("| step | bf16-mixed loss | fp8-mixed loss |")
    print("|---|---|---|")
    for step in list(range(0, args.steps, 20)) + [args.steps - 1]:
        print(f"| {step + 1} | {curves['bf16-mixed'][step]:.4f} | {curves['fp8-mixed'][step]:.4f} |")
    final = {p: sum(c[-10:]) / len(c[-10:]) for p, c in curves.items()}
    diff = (final["fp8-mixed"] - final["bf16-mixed"]) / final["bf16-mixed"]
    print(f"final loss (mean of the last 10 steps): bf16-mixed {final['bf16-mixed']:.4f}, "
          f"fp8-mixed {final['fp8-mixed']:.4f}, float8 {diff:+.2%} of bf16 (goal: within 1%)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
