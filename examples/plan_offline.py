"""Plan a 64-GPU training job on a laptop: no GPU, no process group, no real weights.

    python examples/plan_offline.py
    python examples/plan_offline.py --memory-limit 2GiB --json plan.json

The model is built on the meta device (shapes and dtypes only, no storage),
so its size does not matter to the machine planning it. autopar captures it
with torch.export, searches DP / FSDP / TP layouts over an 8 x 8 mesh of
H100s under a per-device memory limit, and reports the plan with its
predicted memory, both as numbers and as a formula in the batch size.
"""
import argparse
import time

import sympy
import torch

import autopar
from autopar.testing import GPT, GPTConfig

MESH = {"dp": 8, "tp": 8}   # axis name -> size; the last axis is the one inside a node (8 GPUs)
BATCH = 64                  # global batch of the example input (sequences of block_size tokens)

# A 0.41B-parameter GPT (4 layers, 2048 wide, GPT-2 vocabulary). Trained in
# float32 with AdamW (16 bytes per parameter), the plan "auto" picks with no
# limit needs about 1.19 GiB per device at batch 64; a limit of 1.15 GiB makes
# the search shard more of the weights (FSDP-style on "dp") on top of the
# tensor-parallel split on "tp". Tiny by H100 standards, but the search works
# the same at any scale, and this size plans in seconds.
DEFAULT_MEMORY_LIMIT = "1.15GiB"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--memory-limit", default=DEFAULT_MEMORY_LIMIT,
                   help=f"per-device memory limit (default: {DEFAULT_MEMORY_LIMIT})")
    p.add_argument("--hardware", default="h100", help="cost-model preset: h100, a100, cpu (default: h100)")
    p.add_argument("--strategy", default="auto", help="auto, ddp, fsdp, tp, fsdp+tp (default: auto)")
    p.add_argument("--json", default=None, help="also write the plan as JSON to this file")
    args = p.parse_args()

    config = GPTConfig(vocab_size=50304, block_size=1024, n_layer=4, n_head=16, n_embd=2048, bias=False)
    with torch.device("meta"):
        model = GPT(config)
    idx = torch.randint(0, config.vocab_size, (BATCH, config.block_size), device="meta")
    n_params = sum(q.numel() for q in model.parameters())
    print(f"GPT with {n_params / 1e9:.2f}B parameters on the meta device; mesh {MESH}, "
          f"hardware {args.hardware}, memory limit {args.memory_limit}\n")

    # The batch dim is dynamic: the plan is searched at the example's batch (64), and its
    # symbolic predictions are formulas in a sympy symbol named after the Dim, "batch".
    dynamic_shapes = {"idx": {0: torch.export.Dim("batch")}}
    t0 = time.perf_counter()
    plan = autopar.plan(model, (idx,), MESH, hardware=args.hardware, memory_limit=args.memory_limit,
                        strategy=args.strategy, dynamic_shapes=dynamic_shapes)
    seconds = time.perf_counter() - t0

    print(plan)
    print(f"\nplanned in {seconds:.1f} s "
          f"({plan.stats['num_nodes']} graph nodes, ILP solved in {plan.stats['solve_seconds']:.1f} s)")

    m = plan.predicted.memory   # bytes per device, at the example's batch size
    print("\nplan.predicted.memory (bytes per device, batch 64):")
    for k in ("params", "grads", "optimizer", "activations", "transient", "total"):
        print(f"  {k:<12} {getattr(m, k):>14,.0f}  ({getattr(m, k) / 2**30:.3f} GiB)")

    total = plan.symbolic.memory.total   # the same total as a sympy expression
    print(f"\nplan.symbolic.memory.total = {total}")
    batch = next(s for s in total.free_symbols if s.name == "batch")
    print("the same plan (layouts as chosen for batch 64) at other global batch sizes:")
    for b in (64, 128, 256, 512):
        print(f"  batch {b:>4}: {float(total.subs(batch, b)) / 2**30:7.3f} GiB per device")
    step_ms = sympy.N(plan.symbolic.step_time * 1000, 4)
    print(f"\nplan.symbolic.step_time = {step_ms} ms  (predicted: compute + optimizer step + the "
          "communication not hidden behind compute)")

    # a plan is data: save it, load it on the cluster, pass it to autopar.parallelize(..., plan=plan)
    text = plan.to_json()
    assert autopar.Plan.from_json(text).param_placements == plan.param_placements
    if args.json:
        with open(args.json, "w") as f:
            f.write(text)
        print(f"\nwrote {args.json} ({len(text)} bytes); load it with autopar.Plan.from_json")


if __name__ == "__main__":
    main()
