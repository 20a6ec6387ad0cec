"""torch.compile(pm): a compiled ParallelModule trains as one device does, and launches the collectives the
eager module launches.

For ddp, fsdp and tp on 2 ranks (threads of this process, run_threaded), `torch.compile(pm)` trains a small
GPT 3 SGD steps; its losses and final parameters equal single-device eager training (atol 1e-5), and the
collectives it logs each step (record_comm=True) are those the same module logs run eagerly -- as a
multiset: the compiler may reorder them (inductor moves fsdp's first all-gathers), that is what it is for.

What this does not hold yet: that the compiler sees the collectives. Dynamo breaks the graph at each
redistribution while the CommLog records it, at the gradient buckets' and FSDP layer groups' autograd-engine
callback and at the saved-tensor hooks (installed only where a plan gathers again: fsdp, tp+sp), so the
collectives run eagerly between compiled pieces
(ARCHITECTURE.md section 10 lists what it takes: logging as an op, the gathers as functional collectives).

Backend: inductor (C++ code generation on CPU), on a one-layer GPT for ddp and a two-layer one for fsdp
and tp (so the FSDP layer groups prefetch the next layer). Inductor's C++ compile is most of this file's
time: about a minute cold on 2 cores, half that with its cache warm.
"""
from __future__ import annotations

import copy

import pytest
import torch

import autopar
from autopar.testing import GPT, GPTConfig, gpt_loss, run_threaded

ATOL = 1e-5
LR = 0.5
STEPS = 3


def _gpt(n_layer: int):
    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=n_layer, n_head=2, n_embd=16, vocab_size=32, block_size=8)
    x = torch.randint(0, cfg.vocab_size, (8, 8))
    y = torch.randint(0, cfg.vocab_size, (8, 8))
    return GPT(cfg), x, y


def _one_device(model, x, y):
    m = copy.deepcopy(model)
    opt = torch.optim.SGD(m.parameters(), lr=LR)
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        loss = gpt_loss(m(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in m.named_parameters()}


def _train(pm, run, x, y) -> dict:
    """STEPS SGD steps of `run` (pm or its compiled form): this rank's losses and each step's collectives."""
    opt = torch.optim.SGD(pm.parameters(), lr=LR)
    (xi,), (yi,) = pm.plan.local_inputs(x), pm.plan.local_targets(y)
    losses, comm = [], []
    for _ in range(STEPS):
        opt.zero_grad()
        pm.comm.log.records.clear()
        loss = gpt_loss(run(xi), yi)
        loss.backward()
        comm.append(list(pm.comm.log.records))
        opt.step()
        losses.append(loss.item())
    return {"losses": losses, "comm": comm, "params": pm.state_dict(full=True)}


def _rank(rank, model, x, y, strategy, backend):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp" if strategy == "tp" else "dp",))
    eager = autopar.parallelize(copy.deepcopy(model), mesh, (x,), strategy=strategy, record_comm=True)
    pm = autopar.parallelize(copy.deepcopy(model), mesh, (x,), plan=eager.plan, record_comm=True)
    dist.barrier()   # no rank traces (export) while another runs: torch's tracing state is process-wide
    return {"eager": _train(eager, eager, x, y), "compiled": _train(pm, torch.compile(pm, backend=backend), x, y),
            "batch_axes": eager.plan.batch_axes}


@pytest.mark.parametrize("strategy, backend, n_layer", [("ddp", "inductor", 1), ("fsdp", "inductor", 2),
                                                        ("tp", "inductor", 2)])
def test_compiled_module_trains_as_one_device(strategy, backend, n_layer):
    torch._dynamo.reset()   # the ranks' modules are entries under the same code: start from no cache
    model, x, y = _gpt(n_layer)
    ref_losses, ref_params = _one_device(model, x, y)
    res = run_threaded(2, _rank, model, x, y, strategy, backend, timeout=300)
    for r in res:
        c, e = r["compiled"], r["eager"]
        for step, (got, want) in enumerate(zip(c["comm"], e["comm"])):   # the compiler may reorder them
            assert sorted(got) == sorted(want), f"step {step}: the compiled module launched {got}, eager {want}"
        for n, p in ref_params.items():
            torch.testing.assert_close(c["params"][n], p, atol=ATOL, rtol=0, msg=lambda m: f"param {n}: {m}")
        assert all(abs(a - b) <= ATOL for a, b in zip(c["losses"], e["losses"])), (c["losses"], e["losses"])
    # the loss of the whole batch: the ranks' means averaged where the batch is split, the same number where not
    global_losses = ([sum(r["compiled"]["losses"][s] for r in res) / 2 for s in range(STEPS)]
                     if res[0]["batch_axes"] else res[0]["compiled"]["losses"])
    assert all(abs(a - b) <= ATOL for a, b in zip(global_losses, ref_losses)), (global_losses, ref_losses)
