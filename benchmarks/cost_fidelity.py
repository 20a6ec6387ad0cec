"""How close the planner's predictions come to one measured training step (autopar.audit).

    python benchmarks/cost_fidelity.py                                  # all models and strategies
    python benchmarks/cost_fidelity.py --models gpt,llama --strategies tp,tp+sp

For each example model (MLP, GPT, a small random HF Llama) under each
strategy (ddp, zero1, zero2, fsdp, tp, tp+sp on 2 ranks; fsdp+tp on 2 x 2),
every rank runs one forward, backward and AdamW step (autopar.ShardedOptimizer)
on the threaded process group (no torchrun) and prints, as predicted / measured: bytes each device sends per
mesh axis, parameter, gradient and optimizer-state bytes, and the activation
bytes autograd keeps for backward with measured / predicted. Values are rank
0's; the ratio column is the one farthest from 1 over all ranks. Sizes are
tiny, so this checks the model's bookkeeping, not timings.
"""
import argparse
import copy
import warnings

import torch

import autopar
import cost_models as cm
from autopar.testing import GPT, MLP, GPTConfig, run_threaded, tiny_llama

STRATEGY_MESHES = {"ddp": ((2,), ("dp",)), "zero1": ((2,), ("dp",)), "zero2": ((2,), ("dp",)), "fsdp": ((2,), ("dp",)), "tp": ((2,), ("tp",)),
                   "tp+sp": ((2,), ("tp",)), "fsdp+tp": ((2, 2), ("dp", "tp"))}


def mlp():
    return MLP([16, 32, 16]), torch.randn(8, 16)


def gpt():
    return GPT(GPTConfig(n_layer=2, dropout=0.1)).train(), torch.randint(0, 64, (4, 16))


def llama():
    return tiny_llama(), torch.randint(0, 64, (4, 16))


MODELS = {"mlp": mlp, "gpt": gpt, "llama": llama}


def _audit(rank, model, x, mesh_shape, names, strategy):
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")    # ops without rules, divisibility: not what is measured here
        pm = autopar.parallelize(copy.deepcopy(model), mesh, (x,), strategy=strategy)
    opt = autopar.ShardedOptimizer(pm, torch.optim.AdamW, lr=1e-3)
    return autopar.audit(pm, *pm.plan.local_inputs(x), optimizer=opt)


def _pair(report, quantity) -> str:
    try:
        row = report.row(quantity)
    except StopIteration:
        return "-"
    return f"{cm.format_bytes(row.predicted)} / {cm.format_bytes(row.measured)}"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {','.join(MODELS)}")
    p.add_argument("--strategies", default=",".join(STRATEGY_MESHES),
                   help=f"comma-separated, of {','.join(STRATEGY_MESHES)}")
    args = p.parse_args()

    columns = ["comm dp", "comm tp", "parameters", "gradients", "optimizer", "activations"]
    header = f"{'model':<6} {'strategy':<8} {'mesh':<9} " + " ".join(f"{c:>23}" for c in columns) + \
             f" {'act meas/pred':>14}"
    print("predicted / measured, per device")
    print(header)
    print("-" * len(header))
    for name in args.models.split(","):
        for strategy in args.strategies.split(","):
            mesh_shape, names = STRATEGY_MESHES[strategy]
            torch.manual_seed(0)
            model, x = MODELS[name]()
            world = 1
            for n in mesh_shape:
                world *= n
            reports = run_threaded(world, _audit, model, x, mesh_shape, names, strategy)
            r0 = reports[0]
            cells = [_pair(r0, "comm bytes on dp"), _pair(r0, "comm bytes on tp"), _pair(r0, "parameters"),
                     _pair(r0, "gradients"), _pair(r0, "optimizer state"),
                     _pair(r0, "activations saved for backward")]
            ratio = max((r.row("activations saved for backward").ratio for r in reports), key=lambda v: abs(v - 1))
            mesh = ",".join(f"{a}={n}" for a, n in zip(names, mesh_shape))
            print(f"{name:<6} {strategy:<8} {mesh:<9} " + " ".join(f"{c:>23}" for c in cells) + f" {ratio:>14.4f}",
                  flush=True)


if __name__ == "__main__":
    main()
