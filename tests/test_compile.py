"""torch.compile(pm): a compiled ParallelModule trains as one device does, and launches the collectives the
eager module launches.

For ddp, fsdp and tp on 2 ranks (threads of this process, run_threaded), `torch.compile(pm)` trains a small
GPT 3 SGD steps; its losses and final parameters equal single-device eager training (atol 1e-5), and the
collectives it logs each step (record_comm=True) are those the same module logs run eagerly -- as a
multiset: the compiler may reorder them (inductor moves fsdp's first all-gathers), that is what it is for.

For ddp and tp the compiler sees the collectives: the local graph compiles as one graph, in which each
collective the plan issues inside it is a functional collective (`_c10d_functional.*`, which inductor may
reorder) logged by the `autopar::logged_send` op; only ddp's gradient buckets run outside it, in autograd's
engine, as DDP's do (test_ddp_and_tp_compile_to_one_graph_with_their_collectives_in_it). fsdp compiles to one
graph too, gathering each weight alone and gathering it again in backward from the shard it keeps (see
test_compile_deep.py, which also covers depth, tp+sp and checkpointing); its log moves the eager module's
bytes, less the re-gathers a compiled backward does not log.

Backend: inductor (C++ code generation on CPU), on a one-layer GPT for ddp and a two-layer one for fsdp
and tp (so the FSDP layer groups prefetch the next layer). Inductor's C++ compile is most of this file's
time: about a minute cold on 2 cores, half that with its cache warm.
"""
from __future__ import annotations

import collections
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
            if strategy == "fsdp":
                # compiled, each weight is gathered and its gradient reduce-scattered alone (the layer groups'
                # flat collectives are eager machinery; inductor may bucket them), and the gathers backward
                # repeats are not logged (test_compile_deep checks they run): the same bytes, otherwise
                assert _bytes_by_kind(got) == _bytes_by_kind(want, but=("all_gather", "backward")), (step, got, want)
                continue
            assert sorted(got) == sorted(want), f"step {step}: the compiled module launched {got}, eager {want}"
        for n, p in ref_params.items():
            torch.testing.assert_close(c["params"][n], p, atol=ATOL, rtol=0, msg=lambda m: f"param {n}: {m}")
        assert all(abs(a - b) <= ATOL for a, b in zip(c["losses"], e["losses"])), (c["losses"], e["losses"])
    # the loss of the whole batch: the ranks' means averaged where the batch is split, the same number where not
    global_losses = ([sum(r["compiled"]["losses"][s] for r in res) / 2 for s in range(STEPS)]
                     if res[0]["batch_axes"] else res[0]["compiled"]["losses"])
    assert all(abs(a - b) <= ATOL for a, b in zip(global_losses, ref_losses)), (global_losses, ref_losses)


def _bytes_by_kind(records, but=None) -> dict:
    """{(kind, axis, phase): bytes launched}, leaving out the (kind, phase) `but`."""
    out = collections.Counter()
    for kind, axis, nbytes, phase in records:
        if (kind, phase) != but:
            out[kind, axis, phase] += nbytes
    return dict(out)


def _graphs_rank(rank, model, x, y, strategy):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp" if strategy == "tp" else "dp",))
    pm = autopar.parallelize(copy.deepcopy(model), mesh, (x,), strategy=strategy, record_comm=True)
    dist.barrier()
    graphs = []

    def backend(gm, example_inputs):   # keeps what dynamo hands the compiler, runs it as it is
        graphs.append(gm)
        return gm.forward
    (xi,), (yi,) = pm.plan.local_inputs(x), pm.plan.local_targets(y)
    gpt_loss(torch.compile(pm, backend=backend)(xi), yi).backward()
    # every op of every graph, the forward and backward bodies of the autograd functions' included
    ops = collections.Counter(str(n.target) for gm in graphs for m in gm.modules() if isinstance(m, torch.fx.GraphModule)
                              for n in m.graph.nodes if n.op == "call_function")
    return {"graphs": len(graphs), "ops": ops, "logged": len(pm.comm.log.records),
            "planned": len(pm.plan.collectives),
            "bucketed": sum(1 for c in pm.plan.collectives if c.where.startswith("gradient bucket"))}


@pytest.mark.parametrize("strategy", ["ddp", "tp"])
def test_ddp_and_tp_compile_to_one_graph_with_their_collectives_in_it(strategy):
    """Nothing breaks the graph (record_comm=True included), and every collective the plan issues inside the
    local graph is in it as a functional collective, next to the op that logs it."""
    torch._dynamo.reset()
    model, x, y = _gpt(2)
    for r in run_threaded(2, _graphs_rank, model, x, y, strategy, timeout=300):
        assert r["graphs"] == 1, f"dynamo broke the local graph into {r['graphs']} graphs"
        ops = r["ops"]
        functional = sum(k for op, k in ops.items() if op.startswith("_c10d_functional.") and "wait" not in op)
        in_graph = r["planned"] - r["bucketed"]   # the buckets reduce in autograd's engine, as DDP's do
        if strategy == "tp":
            assert in_graph > 0
        else:   # ddp: every gradient reduction is a bucket's, and there is one
            assert in_graph == 0 and r["bucketed"] > 0
        assert functional == in_graph, (dict(ops), r["planned"], r["bucketed"])
        assert sum(k for op, k in ops.items() if op.startswith("autopar.logged_send")) == in_graph, dict(ops)
        assert r["logged"] == r["planned"]   # the ones in the graph and the buckets, each logged once


class _SendsTwice(torch.autograd.Function):
    """Logs two identical launches in forward and two in backward, as two collectives sending the same
    tensor along the same axis would (autopar's Redistribute logs from inside such a function)."""

    @staticmethod
    def forward(ctx, x, comm):
        from autopar.runtime.collectives import logged
        ctx.comm = comm
        return logged(x, comm, "all_reduce", 0, 16, "forward") + logged(x, comm, "all_reduce", 0, 16, "forward")

    @staticmethod
    def backward(ctx, grad):
        from autopar.runtime.collectives import logged
        comm = ctx.comm
        return (logged(grad, comm, "all_reduce", 0, 16, "backward")
                + logged(grad, comm, "all_reduce", 0, 16, "backward")), None


def test_a_compiled_graph_keeps_every_logged_launch():
    """The logging op has a side effect (an append to the CommLog): the compiler must neither merge two
    identical calls (common-subexpression elimination treats a pure op's equal calls as one) nor drop one."""
    from autopar.runtime.collectives import Comm, CommLog
    torch._dynamo.reset()
    comm = Comm(axes=[], log=CommLog())
    step = torch.compile(lambda x: _SendsTwice.apply(x, comm).sum(), backend="aot_eager", fullgraph=True)
    step(torch.randn(4, requires_grad=True)).backward()
    assert sorted(comm.log.records) == [("all_reduce", 0, 16, "backward")] * 2 + [("all_reduce", 0, 16, "forward")] * 2
