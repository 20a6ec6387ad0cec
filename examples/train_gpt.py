"""Train a small GPT on 4 CPU processes with a plan autopar chose, and check it against one device.

    torchrun --nproc-per-node 4 examples/train_gpt.py
    torchrun --nproc-per-node 4 examples/train_gpt.py --strategy fsdp+tp --steps 5

Every rank builds the same seeded GPT. autopar plans how to split it over a
2 x 2 mesh (axes "x" and "y"), and each rank trains its own shard of the model
on its own share of every batch, which it reads itself: `plan.data_shard()`
says which share, a `DistributedSampler` reads it. Rank 0 also trains an
unsharded copy of the model on the whole batches, in the same process, and
prints both losses step by step: they agree to float32 rounding.
"""
import argparse
import copy
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import autopar
import cost_models as cm
from autopar.testing import GPT, GPTConfig, gpt_loss

WORLD_SIZE = 4
# neutral names: under "auto" the search decides what each axis does (and prints it), and a reader
# must not find data parallelism on an axis called "tp"
MESH_SHAPE, AXIS_NAMES = (2, 2), ("x", "y")
BATCH = 32  # global batch (sequences); each rank reads its share of it (plan.data_shard)

# Why a memory limit: the cost model ("cpu" hardware: loopback TCP, ~20 us per
# collective step) sees a model this small as latency-bound, so with no limit
# the cheapest plan splits little: it keeps the whole batch on every rank
# (every rank computes every sequence) and splits only a few matmuls. That is
# correct but shows little. For this model and batch (float32, AdamW) the
# planner predicts per rank:
#   "auto" with no limit (batch not split)          ~1.39 MiB
#   "ddp" (weights whole, batch split 4 ways)       ~1.02 MiB
#   the smallest any plan can reach                 ~0.68 MiB
# (from autopar.plan(...).predicted.memory.total and, for the smallest,
# autopar.InfeasiblePlanError.min_memory_bytes). A limit of 1 MiB rules out
# the first two, so "auto" has to split the batch and shard weights: it mixes
# tensor parallelism on one axis with a batch split on the other. The search
# does not read axis names, only their cost, and both axes of this mesh cost
# the same: the plan's first line says which axis splits the batch.
DEFAULT_AUTO_MEMORY_LIMIT = "1MiB"


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--strategy", default="auto", choices=autopar.STRATEGIES,
                   help="auto (the search), or a named classic (default: auto)")
    p.add_argument("--steps", type=int, default=10, help="optimizer steps (default: 10)")
    p.add_argument("--memory-limit", default=None,
                   help=f"per-rank memory limit for the plan, e.g. 1MiB or 1048576, or 'none' "
                        f"(default: {DEFAULT_AUTO_MEMORY_LIMIT} for --strategy auto, none for the classics)")
    p.add_argument("--hardware", default="cpu", choices=sorted(cm.PRESETS),
                   help="cost-model preset (default: cpu)")
    p.add_argument("--lr", type=float, default=1e-2, help="AdamW learning rate (default: 1e-2)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    if args.memory_limit is None:
        args.memory_limit = DEFAULT_AUTO_MEMORY_LIMIT if args.strategy == "auto" else None
    elif args.memory_limit.lower() == "none":
        args.memory_limit = None
    return args


def check_launched_by_torchrun():
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        sys.exit("examples/train_gpt.py runs one process per rank and must be started by torchrun:\n"
                 f"    torchrun --nproc-per-node {WORLD_SIZE} examples/train_gpt.py")
    if int(os.environ["WORLD_SIZE"]) != WORLD_SIZE:
        sys.exit(f"examples/train_gpt.py needs exactly {WORLD_SIZE} ranks (a 2 x 2 mesh), got "
                 f"WORLD_SIZE={os.environ['WORLD_SIZE']}:\n"
                 f"    torchrun --nproc-per-node {WORLD_SIZE} examples/train_gpt.py")


def main():
    args = parse_args()
    check_launched_by_torchrun()
    torch.set_num_threads(1)  # 4 processes share the machine's cores
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", MESH_SHAPE, mesh_dim_names=AXIS_NAMES)
    t_start = time.perf_counter()

    # the same model on every rank, and a dataset every rank can read (token sequences,
    # each target the next token); a real job reads files here
    config = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32)
    torch.manual_seed(args.seed)
    model = GPT(config)
    data = torch.Generator().manual_seed(args.seed + 1)
    text = torch.randint(0, config.vocab_size, (BATCH * args.steps, config.block_size + 1), generator=data)
    dataset = TensorDataset(text[:, :-1], text[:, 1:])

    reference = copy.deepcopy(model) if rank == 0 else None  # the single-device run, on rank 0 only

    # plan (on rank 0, sent to the others) for the global batch's shape; keep only this rank's shards
    example = (dataset.tensors[0][:BATCH],)
    pm = autopar.parallelize(copy.deepcopy(model), mesh, example, strategy=args.strategy,
                             memory_limit=args.memory_limit, hardware=args.hardware)
    if rank == 0:
        print(pm.plan)
        limit = args.memory_limit if args.memory_limit is not None else "none"
        print(f"\nplanned in {time.perf_counter() - t_start:.1f} s; memory limit {limit}, "
              f"predicted {pm.plan.predicted.memory.total / 2**20:.3f} MiB per rank\n")

    # this rank reads share `index` of `count` of every batch (ranks that split the model, not
    # the batch, read the same share); the module takes that local batch as it is
    index, count = pm.plan.data_shard()
    sampler = DistributedSampler(dataset, num_replicas=count, rank=index, shuffle=False)
    loader = DataLoader(dataset, batch_size=BATCH // count, sampler=sampler)
    whole = DataLoader(dataset, batch_size=BATCH) if rank == 0 else None   # the reference's batches
    if rank == 0:
        print(f"each rank reads {BATCH // count} of every {BATCH} sequences (share index of {count})\n")
    # the wrapper steps parameters the plan splits ZeRO-style on their slice; others as AdamW would
    opt = autopar.ShardedOptimizer(pm, torch.optim.AdamW, lr=args.lr)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=args.lr) if rank == 0 else None

    if rank == 0:
        print(f"{'step':>4}  {'parallel loss':>14}  {'1-device loss':>14}  {'abs diff':>9}")
    max_diff = 0.0
    whole_batches = iter(whole) if rank == 0 else None
    for step, (tokens, targets) in enumerate(loader, start=1):
        opt.zero_grad(set_to_none=True)
        loss = gpt_loss(pm(tokens), targets)  # mean over this rank's share of the batch
        loss.backward()   # gradients come back averaged over the shares: those of the global mean
        opt.step()

        # The global loss is the mean over the distinct shares. Every share is read by the
        # same number of ranks (world / count), so the mean over all ranks is the same.
        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss)
        global_loss /= dist.get_world_size()

        if rank == 0:
            # the union of the ranks' shares of batch `step` (the sampler strides through it)
            all_tokens, all_targets = next(whole_batches)
            ref_opt.zero_grad(set_to_none=True)
            ref_loss = gpt_loss(reference(all_tokens), all_targets)
            ref_loss.backward()
            ref_opt.step()
            diff = abs(global_loss.item() - ref_loss.item())
            max_diff = max(max_diff, diff)
            print(f"{step:>4}  {global_loss.item():>14.6f}  {ref_loss.item():>14.6f}  {diff:>9.2e}")

    # whole parameters (an all-gather per split axis, so every rank takes part)
    trained = pm.state_dict(full=True)
    if rank == 0:
        ref_params = dict(reference.named_parameters())
        param_diff = max((trained[n] - ref_params[n].detach()).abs().max().item() for n in ref_params)
        print(f"\nmax abs loss difference over {args.steps} steps: {max_diff:.3e}")
        print(f"max abs parameter difference after training: {param_diff:.3e}")
        print(f"total {time.perf_counter() - t_start:.1f} s")
    # every rank reaches this point before any tears gloo down: a rank that destroys its group
    # while a peer still talks to it can abort the peer ("terminate called ...")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
