"""Gradient buckets (runtime/reduction/grad_buckets.py): data-parallel gradients reduced in a few asynchronous
all-reduces per step, and gradient accumulation (no_sync) that reduces once per optimizer step.

Every check compares with one device under SGD, whose step shows a gradient of the wrong scale
(Adam's would hide it), and counts the collectives the module logged.
"""
from __future__ import annotations

import copy

import pytest
import torch

import autopar
from autopar.testing import GPT, MLP, GPTConfig, gpt_loss, run_threaded

# pipelined plans reduce their data axis once per step too: tests/test_pipeline.py counts it

ATOL = 1e-5
LR = 0.5


def _gpt(batch=8):
    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=2, n_head=2, n_embd=16, vocab_size=32, block_size=8)
    x = torch.randint(0, cfg.vocab_size, (batch, 8))
    return GPT(cfg), x, torch.randint(0, cfg.vocab_size, (batch, 8))


def _reference(model, x, y, num_micro: int = 1):
    """One SGD step on one device over the whole batch (the mean over it), and the step's gradients."""
    m = copy.deepcopy(model)
    gpt_loss(m(x), y).backward()
    grads = {n: p.grad.clone() for n, p in m.named_parameters()}
    with torch.no_grad():
        for p in m.parameters():
            p -= LR * p.grad
    return grads, {n: p.detach().clone() for n, p in m.named_parameters()}


def _parallel(rank, model, x, y, mesh_shape, names, strategy, num_micro, bucket_bytes, use_no_sync):
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    pm = autopar.parallelize(copy.deepcopy(model), mesh, (x[: len(x) // num_micro],), strategy=strategy,
                             record_comm=True, bucket_bytes=bucket_bytes)
    opt = torch.optim.SGD(pm.parameters(), lr=LR)
    opt.zero_grad()
    pm.comm.log.records.clear()
    xs, ys = x.chunk(num_micro), y.chunk(num_micro)
    for k in range(num_micro):
        (xi,) = pm.plan.local_inputs(xs[k])
        (yi,) = pm.plan.local_targets(ys[k])
        last = k == num_micro - 1
        with (pm.no_sync() if use_no_sync and not last else _nothing()):
            loss = gpt_loss(pm(xi), yi) / num_micro
        loss.backward()   # outside: as with DDP, the forward decides (it ran inside no_sync or not)
    records = list(pm.comm.log.records)
    grads = pm.full_grads()
    opt.step()
    return {"records": records, "grads": grads, "params": pm.state_dict(full=True),
            "num_buckets": pm._grad_buckets.num_buckets()}


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _check(res, grads, params):
    for r in res:
        for n, g in grads.items():
            torch.testing.assert_close(r["grads"][n], g, atol=ATOL, rtol=0, msg=lambda m: f"grad {n}: {m}")
        for n, p in params.items():
            torch.testing.assert_close(r["params"][n], p, atol=ATOL, rtol=0, msg=lambda m: f"param {n}: {m}")


@pytest.mark.parametrize("bucket_bytes", [25 * 2**20, 4096])
def test_ddp_reduces_in_buckets(bucket_bytes):
    """ddp on 2 ranks: one all-reduce per bucket (not per weight), each bucket's bytes at most
    bucket_bytes unless one weight is bigger, and the gradients are those of one device."""
    model, x, y = _gpt()
    grads, params = _reference(model, x, y)
    res = run_threaded(2, _parallel, model, x, y, (2,), ("dp",), "ddp", 1, bucket_bytes, False)
    _check(res, grads, params)
    biggest = max(p.numel() * 4 for p in model.parameters())
    for r in res:
        reduces = [rec for rec in r["records"] if rec[0] == "all_reduce"]
        assert len(reduces) == len(r["records"])
        # no more: the position embedding's output is whole on dp and read by the batch-split add, and its
        # partial gradient flows on to wpe.weight, reduced in its bucket (cost/buckets.partial_gradients)
        assert len(reduces) == r["num_buckets"]
        assert all(rec[2] <= max(bucket_bytes, biggest) for rec in reduces)
    if bucket_bytes == 4096:
        assert res[0]["num_buckets"] > 1
    else:
        assert res[0]["num_buckets"] == 1


@pytest.mark.parametrize("use_no_sync", [True, False])
def test_accumulation_over_microbatches(use_no_sync):
    """4 microbatches, each loss / 4, then one SGD step, equals one step on the whole batch. Under no_sync
    the data axis is reduced once per bucket for the step; without it once per microbatch, and still right
    (the gradient held between microbatches is reduced already, and only the new part is reduced)."""
    model, x, y = _gpt(batch=16)
    grads, params = _reference(model, x, y)
    res = run_threaded(2, _parallel, model, x, y, (2,), ("dp",), "ddp", 4, 4096, use_no_sync)
    _check(res, grads, params)
    for r in res:
        reduces = [rec for rec in r["records"] if rec[0] == "all_reduce"]
        assert len(reduces) == r["num_buckets"] * (1 if use_no_sync else 4)


def test_hybrid_mesh_buckets_the_data_axis():
    """fsdp+tp on 2 x 2: weights tp splits are replicated on no data axis...; those whole on tp (norms,
    biases of row-parallel linears) get their tp-axis gradient sum from a bucket; gradients match."""
    model, x, y = _gpt()
    grads, params = _reference(model, x, y)
    res = run_threaded(4, _parallel, model, x, y, (2, 2), ("dp", "tp"), "fsdp+tp", 1, 25 * 2**20, False)
    _check(res, grads, params)


def test_a_weight_gathered_with_its_layer_is_never_bucketed():
    """fsdp+tp on 2 x 2 at a size where the plan splits the norms' inputs along the sequence on tp: a norm
    weight is FSDP-gathered on dp (its layer group reduce-scatters the gradient, and owns it) and its
    gradient is also partial on tp. Bucketing the tp sum as well would lose it (the group's backward gives
    autograd nothing to pass on); the tp sum must stay in the graph. Planned on the meta device: no ranks."""
    from autopar.api import _at_compute_dtype
    from autopar.capture.export import AUTO, capture
    from autopar.cost.buckets import deferred_axes
    from autopar.cost.terms import needs_grad
    from autopar.sharding.op_spec import tensor_args
    with torch.device("meta"):
        model = GPT(GPTConfig(n_layer=2, n_head=8, n_embd=256, vocab_size=2048, block_size=128))
    x = torch.zeros(8, 128, dtype=torch.long, device="meta")
    plan = autopar.plan(model, (x,), {"dp": 2, "tp": 2}, strategy="fsdp+tp", hardware="cpu")
    cap = _at_compute_dtype(capture, model, None)(model, (x,), AUTO)
    strategies = plan.node_strategies
    both = []   # weights gathered on dp for a use whose gradient is partial on tp
    for node in cap.graph.nodes:
        s = strategies.get(node.name)
        if s is None or node.op != "call_function":
            continue
        for i, a in enumerate(tensor_args(node)):   # the strategy's input order
            if a.name.startswith("p_") and a.name in strategies:
                src, dst = strategies[a.name].output, s.inputs[i]
                if src[0].startswith("S") and dst[0] == "R" and 1 in s.grad_partial(i):
                    both.append(a.name)
    assert both, "the plan no longer makes the case this test is about: pick another size"
    assert not set(both) & set(deferred_axes(cap, strategies, needs_grad(cap)))


# AdamW at 1e-4 (test_equivalence's): its first steps move every element by about lr whatever the
# gradient's size, so an element whose gradient is near zero turns rounding noise into a step
# (lr 0.1 moved such elements 1e-4 apart, 1e-3 1.5e-5)
@pytest.mark.parametrize("optimizer, lr", [(torch.optim.SGD, 0.1), (torch.optim.AdamW, 1e-4)])
def test_a_layer_group_sums_its_gradient_over_tp_after_the_reduce_scatter(optimizer, lr):
    """fsdp+tp on 2 x 2 under a memory limit that splits the norms' inputs along the sequence on tp: the
    norm weights gather with their layer on dp and their gradients are partial on tp. Their layer group
    reduce-scatters on dp, then all-reduces its shard on tp (one collective per layer, as the plan lists);
    training equals one device, SGD (a wrong sum shows) beside AdamW."""
    from autopar.testing import parallel_record, single_device_reference
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=4, n_embd=64, vocab_size=256, block_size=32))
    x, y = torch.randint(0, 256, (8, 32)), torch.randint(0, 256, (8, 32))
    kwargs = {"strategy": "fsdp+tp", "hardware": "cpu", "memory_limit": 1_470_000, "checkpointing": "none"}
    ref = single_device_reference(lambda: copy.deepcopy(model), x, y, gpt_loss, 3, lr, optimizer)
    res = run_threaded(4, parallel_record, model, (2, 2), ("dp", "tp"), x, y, gpt_loss, 3, lr, kwargs, optimizer)
    plan = res[0]["plan"]
    sums = [c for c in plan.collectives if c.where.startswith("layer ") and c.kind == "all_reduce"]
    assert sums and all(c.axis == "tp" for c in sums), "the plan no longer makes the case: pick another limit"
    for rank, r in enumerate(res):
        logged = [rec for rec in r["comm"] if rec[0] == "all_reduce" and rec[1] == 1 and rec[3] == "backward"]
        assert len(logged) >= len(sums), (rank, logged)
        for name, p in ref["params"].items():
            torch.testing.assert_close(r["params"][name], p, atol=1e-5, rtol=0, msg=lambda m: f"rank {rank} {name}: {m}")
    for step in range(3):
        assert sum(r["losses"][step] for r in res) / 4 == pytest.approx(ref["losses"][step], abs=1e-5)


class _TwoHeads(torch.nn.Module):
    """Two outputs; a loss that reads only the first leaves the second head's weight without a gradient."""
    def __init__(self):
        super().__init__()
        self.body, self.a, self.b = torch.nn.Linear(8, 16), torch.nn.Linear(16, 4), torch.nn.Linear(16, 4)

    def forward(self, x):
        h = torch.relu(self.body(x))
        return self.a(h), self.b(h)


def _two_heads(rank, model, x):
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    pm = autopar.parallelize(copy.deepcopy(model), mesh, (x,), strategy="ddp")
    opt = torch.optim.SGD(pm.parameters(), lr=LR)
    (xl,) = pm.plan.local_inputs(x)
    for _ in range(3):   # the bucket's buffer is made anew each step: its unreached pieces must read zero
        opt.zero_grad()
        pm(xl)[0].square().mean().backward()
        opt.step()
    return pm.state_dict(full=True), pm._grad_buckets.num_buckets(), _route_groups(pm)


def _route_groups(pm) -> list:
    """The weights' names each BucketedUse of the training graph routes, in graph order."""
    slots = pm._grad_buckets.slots
    return [[slots[i].name for i in node.args[0]] for node in pm.graph_module.graph.nodes
            if node.op == "call_module" and node.target == "bucketed_use"]


def test_a_weight_whose_gradient_never_arrives_adds_nothing_to_its_bucket():
    torch.manual_seed(0)
    model, x = _TwoHeads(), torch.randn(8, 8)
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(ref.parameters(), lr=LR)
    for _ in range(3):
        opt.zero_grad()
        ref(x)[0].square().mean().backward()
        opt.step()
    for params, num_buckets, groups in run_threaded(2, _two_heads, model, x):
        assert num_buckets == 1   # head b shares the bucket of the weights whose gradients come
        # and its autograd node: the node gets None for b's gradients beside a's
        assert any("b.weight" in g and "a.weight" in g for g in groups), groups
        for n, p in ref.named_parameters():
            torch.testing.assert_close(params[n], p.detach(), atol=ATOL, rtol=0, msg=lambda m: f"{n}: {m}")


def _steps_keeping_grads(rank, model, x, y, steps, zero_grad_each_step):
    """`steps` SGD steps of ddp on 2 ranks: where each bucketed gradient lives each step, and the weights."""
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    pm = autopar.parallelize(copy.deepcopy(model), mesh, (x,), strategy="ddp")
    opt = torch.optim.SGD(pm.parameters(), lr=LR)
    (xi,), (yi,) = pm.plan.local_inputs(x), pm.plan.local_targets(y)
    where = []
    for _ in range(steps):
        if zero_grad_each_step:
            opt.zero_grad(set_to_none=True)
        gpt_loss(pm(xi), yi).backward()
        opt.step()
        where.append({n: p.grad.untyped_storage().data_ptr() for n, p in pm.named_parameters() if p.grad is not None})
    return where, pm.state_dict(full=True)


@pytest.mark.parametrize("zero_grad_each_step", [True, False])
def test_bucket_buffers_are_kept_from_step_to_step_and_never_overwrite_a_kept_gradient(zero_grad_each_step):
    """As DDP, a bucket's buffer is made once: after zero_grad the next backward reduces into the same
    memory (no allocation of tens of MB each step). Without zero_grad, the .grad of
    the last step still views that buffer and sums in the new gradient where it is: the bucket takes a new
    buffer (reducing into the old one would overwrite the kept gradient), and three steps of summed
    gradients equal one device's."""
    model, x, y = _gpt()
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(ref.parameters(), lr=LR)
    for _ in range(3):
        if zero_grad_each_step:
            opt.zero_grad(set_to_none=True)
        gpt_loss(ref(x), y).backward()
        opt.step()
    for where, params in run_threaded(2, _steps_keeping_grads, model, x, y, 3, zero_grad_each_step):
        for n, p in ref.named_parameters():
            torch.testing.assert_close(params[n], p.detach(), atol=ATOL, rtol=0, msg=n)
        bucketed = "h.0.mlp.c_fc.weight" if "h.0.mlp.c_fc.weight" in where[0] else next(iter(where[0]))
        assert all(w[bucketed] == where[0][bucketed] for w in where[1:])


class _Positions(torch.nn.Module):
    """Learned positions through a norm (two replicated ops: wpe, then ln), added to a batch-split input;
    `return_positions` also returns them, so their gradient comes whole from the caller."""

    def __init__(self, return_positions: bool):
        super().__init__()
        self.wpe = torch.nn.Embedding(8, 16)
        self.ln = torch.nn.LayerNorm(16)
        self.lin = torch.nn.Linear(16, 16)
        self.return_positions = return_positions

    def forward(self, x):
        pos = self.ln(self.wpe(torch.arange(x.shape[1], device=x.device)))
        h = self.lin(x + pos)
        return (h, pos) if self.return_positions else h


def _positions_rank(rank, model, x):
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    pm = autopar.parallelize(copy.deepcopy(model), mesh, (x,), strategy="ddp", record_comm=True)
    opt = torch.optim.SGD(pm.parameters(), lr=LR)
    (xi,) = pm.plan.local_inputs(x)
    out = pm(xi)
    # the means of this rank's halves (outputs are split along dim 0): the module scales them to the whole's
    sum(o.pow(2).mean() for o in (out if isinstance(out, tuple) else (out,))).backward()
    grads = pm.full_grads()
    opt.step()
    return {"records": list(pm.comm.log.records), "planned": [(c.kind, c.where, c.tensor) for c in pm.plan.collectives],
            "grads": grads, "params": pm.state_dict(full=True)}


@pytest.mark.parametrize("return_positions", [False, True])
def test_a_partial_gradient_flows_through_replicated_ops_to_the_bucket(return_positions):
    """ddp: positions computed alike on every rank (an embedding, then a layer norm) and added to the
    batch-split input get a partial gradient over dp. It flows on, partial, through both ops to wpe and
    ln's weights, reduced in their bucket: one all-reduce a step, none in the middle of backward. When the
    positions are also returned, their gradient may come whole from the caller and must not be summed
    again: they are all-reduced where backward meets them, as before. Gradients and SGD step equal one
    device either way (the loss reads every output)."""
    torch.manual_seed(0)
    model, x = _Positions(return_positions), torch.randn(4, 8, 16)
    m = copy.deepcopy(model)
    out = m(x)
    sum(o.pow(2).mean() for o in (out if return_positions else (out,))).backward()
    grads = {n: p.grad.clone() for n, p in m.named_parameters()}
    with torch.no_grad():
        for p in m.parameters():
            p -= LR * p.grad
    params = {n: p.detach().clone() for n, p in m.named_parameters()}
    res = run_threaded(2, _positions_rank, model, x)
    _check(res, grads, params)
    for r in res:
        assert r["records"] == [(k, 0, b, "backward") for k, _, b, _ in r["records"]]   # all backward, on dp
        buckets = [c for c in r["planned"] if c[1].startswith("gradient bucket")]
        positions = {"p_wpe_weight", "p_ln_weight", "p_ln_bias"}
        assert len(buckets) == 1 and bool(positions & set(buckets[0][2].split(","))) != return_positions
        edge = [c for c in r["planned"] if not c[1].startswith("gradient bucket")]
        reduced_in_backward = [c for c in edge if c[0] == "all_reduce"]
        assert len(reduced_in_backward) == (1 if return_positions else 0), r["planned"]
        assert len(r["records"]) == len(r["planned"])


def _scaled_where(rank, model, x, y, n, strategy, loss_fn, x_needs_grad, checkpointing):
    """One SGD step of `model` on n ranks: where the outputs' 1/n went (the buckets' factor, ScaleGrad in
    the graph or not), this rank's input gradient, and the full gradients and parameters."""
    from torch.distributed.device_mesh import init_device_mesh
    from autopar.runtime.collectives import scale_grad
    mesh = init_device_mesh("cpu", (n,), mesh_dim_names=("dp",))
    pm = autopar.parallelize(copy.deepcopy(model), mesh, (x,), strategy=strategy, checkpointing=checkpointing)
    assert bool(pm.plan.checkpointed) == (checkpointing == "full")
    opt = torch.optim.SGD(pm.parameters(), lr=LR)
    (xi,) = pm.plan.local_inputs(x)
    (yi,) = pm.plan.local_targets(y)
    xi = xi.clone().requires_grad_(x_needs_grad)
    loss_fn(pm(xi), yi).backward()
    grads = pm.full_grads()
    opt.step()
    return {"bucket_scale": pm._grad_buckets.grad_scale, "x_grad": xi.grad,
            "scale_grad_nodes": sum(nd.target is scale_grad for nd in pm.graph_module.graph.nodes),
            "grads": grads, "params": pm.state_dict(full=True)}


def _mse(out, y):
    return torch.nn.functional.mse_loss(out, y)


@pytest.mark.parametrize("case", ["gpt-ddp", "gpt-ddp-checkpointed", "gpt-fsdp", "mlp-ddp"])
def test_the_buckets_take_the_outputs_gradient_scale_only_where_no_other_gradient_shows(case):
    """On 3 ranks (a factor 1/3 no float hits exactly): a GPT under ddp (integer tokens in, every weight
    bucketed) scales its gradients in the buckets, with no ScaleGrad on the logits; under fsdp its weights
    are gathered, not bucketed, and a float-input MLP's input gradient is the user's to read, so both keep
    the ScaleGrad. Every way, the SGD step and the input gradient equal one device's. Checkpointed blocks
    (their graph outlined into regions) must not lose the factor on the way to the buckets."""
    n = 3
    if case.startswith("gpt"):
        model, x, y = _gpt(batch=6)
        loss_fn, x_needs_grad = gpt_loss, False
    else:
        torch.manual_seed(0)
        model, x, y = MLP([8, 16, 4]), torch.randn(6, 8), torch.randn(6, 4)
        loss_fn, x_needs_grad = _mse, True
    ref, xr = copy.deepcopy(model), x.clone().requires_grad_(x_needs_grad)
    loss_fn(ref(xr), y).backward()
    grads = {k: p.grad.clone() for k, p in ref.named_parameters()}
    with torch.no_grad():
        params = {k: p - LR * p.grad for k, p in ref.named_parameters()}
    checkpointing = "full" if case.endswith("checkpointed") else "none"
    res = run_threaded(n, _scaled_where, model, x, y, n, case.split("-")[1], loss_fn, x_needs_grad, checkpointing)
    _check(res, grads, params)
    folded = case.startswith("gpt-ddp")
    for rank, r in enumerate(res):
        if x_needs_grad:   # this rank's rows of the whole batch's input gradient
            torch.testing.assert_close(r["x_grad"], xr.grad.chunk(n)[rank], atol=ATOL, rtol=0)
        assert r["bucket_scale"] == pytest.approx(1 / n if folded else 1.0)
        assert r["scale_grad_nodes"] == (0 if folded else 1)


def _launch_order(rank, model, x, y, strategy, names):
    """The autograd nodes backward runs, in order, with "LAUNCH" where a gradient bucket is all-reduced."""
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (2,) * len(names), mesh_dim_names=names)
    pm = autopar.parallelize(copy.deepcopy(model), mesh, (x,), strategy=strategy, bucket_bytes=4096)
    (xi,), (yi,) = pm.plan.local_inputs(x), pm.plan.local_targets(y)
    loss = gpt_loss(pm(xi), yi)
    order, seen, todo = [], set(), [loss.grad_fn]
    while todo:   # every node of the graph, a hook each that notes when backward runs it
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        node.register_prehook(lambda grads, node=node: order.append(node.name()))
        todo += [f for f, _ in node.next_functions]
    buckets = pm._grad_buckets
    launch = buckets._launch

    def noted(b):
        order.append("LAUNCH")
        return launch(b)
    buckets._launch = noted
    loss.backward()
    return order


@pytest.mark.parametrize("strategy, names", [("ddp", ("dp",)), ("tp+sp", ("tp",))])
def test_buckets_launch_while_backward_computes_where_nothing_else_communicates(strategy, names):
    """A DeferredReduce applied before the graph runs is the oldest node there, and autograd, running the
    newest ready node first, would run it last: every bucket would wait for the end of backward, and every
    weight's gradient with it. ddp's weights go through the buckets where they are first used
    (grad_buckets.BucketedUse), so its first bucket launches while most of backward is still to run. Under
    tp+sp the norm weights' buckets reduce over the tensor-parallel axis, which backward's own
    collectives use too: those launch after all of backward, where every rank launches them in the same order."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=32, block_size=8, n_layer=4, n_head=2, n_embd=16))
    x, y = torch.randint(0, 32, (4, 8)), torch.randint(0, 32, (4, 8))
    for order in run_threaded(2, _launch_order, model, x, y, strategy, names):
        assert "LAUNCH" in order
        first = order.index("LAUNCH")
        # what runs after the first launch, but the buckets' own nodes and the accumulation of gradients
        def compute(nodes):
            return [n for n in nodes if n != "LAUNCH" and "DeferredReduce" not in n and "AccumulateGrad" not in n]
        rest = compute(order[first:])
        if strategy == "ddp":
            total = len(compute(order))
            assert len(rest) > total / 2, f"the first bucket launched with {len(rest)} of {total} nodes to run"
        else:
            assert not rest, f"a tp-axis bucket launched with {len(rest)} nodes of backward still to run"


def test_another_threads_export_does_not_route_a_weight_through_the_buckets_twice(monkeypatch):
    """torch.compiler.is_compiling() is true in every thread while one exports (threaded ranks: one rank
    captures while another trains). The module asked it twice a forward -- routing the weights through the
    buckets before the graph when compiled, at their first use otherwise -- so a flip between the two asks
    routed them twice, and .grad went to a non-leaf: a gradient silently lost. It asks whether dynamo traces
    this code instead; here is_compiling() says True at the first ask of each forward and False after."""
    model, x, y = _gpt()
    grads, params = _reference(model, x, y)
    calls = {"n": 0}

    def flipping():
        calls["n"] += 1
        return calls["n"] % 40 == 1
    monkeypatch.setattr(torch.compiler, "is_compiling", flipping)
    res = run_threaded(2, _parallel, model, x, y, (2,), ("dp",), "ddp", 1, 25 * 2**20, False)
    _check(res, grads, params)


def _routing(rank, model, x, y, group_bytes):
    from torch.distributed.device_mesh import init_device_mesh
    from autopar.runtime.reduction import grad_buckets
    grad_buckets.ROUTE_GROUP_BYTES = group_bytes   # read when the module is built; threads share it
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    pm = autopar.parallelize(copy.deepcopy(model), mesh, (x,), strategy="ddp", bucket_bytes=8192)
    opt = torch.optim.SGD(pm.parameters(), lr=LR)
    (xi,), (yi,) = pm.plan.local_inputs(x), pm.plan.local_targets(y)
    gpt_loss(pm(xi), yi).backward()
    grads = pm.full_grads()
    opt.step()
    b = pm._grad_buckets
    sizes = {s.name: (s.param.numel() * s.param.element_size(), s.bucket) for s in b.slots}
    return {"grads": grads, "params": pm.state_dict(full=True), "groups": _route_groups(pm), "sizes": sizes}


@pytest.mark.parametrize("group_bytes", [0, 2048, 2**20])
def test_weights_go_through_the_buckets_in_groups_of_one_bucket_up_to_the_group_size(monkeypatch, group_bytes):
    """One autograd node routes a group of weights (grad_buckets.ROUTE_GROUP_BYTES): consecutive in the order
    of first use, of one bucket, no more bytes than the group size unless a weight alone is larger. Every
    bucketed weight goes through exactly one, and training matches one device whatever the grouping."""
    from autopar.runtime.reduction import grad_buckets
    monkeypatch.setattr(grad_buckets, "ROUTE_GROUP_BYTES", grad_buckets.ROUTE_GROUP_BYTES)   # restored after
    model, x, y = _gpt()
    grads, params = _reference(model, x, y)
    res = run_threaded(2, _routing, model, x, y, group_bytes)
    _check(res, grads, params)
    for r in res:
        groups, sizes = r["groups"], r["sizes"]
        assert sorted(n for g in groups for n in g) == sorted(sizes)   # each bucketed weight once
        for g in groups:
            assert len({sizes[n][1] for n in g}) == 1, f"{g} straddles buckets"
            assert len(g) == 1 or sum(sizes[n][0] for n in g) <= group_bytes, g
        if group_bytes == 0:
            assert all(len(g) == 1 for g in groups)
        else:   # the case is made: some group holds several weights (a matrix with its bias at least)
            assert max(len(g) for g in groups) > 1 and len(groups) < len(sizes)


def _frozen_first(rank, model, x):
    """ddp on 2 ranks, the first weight of the bucketed group frozen after parallelize: 3 SGD steps."""
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    pm = autopar.parallelize(copy.deepcopy(model), mesh, (x,), strategy="ddp")
    groups = _route_groups(pm)
    dict(pm.named_parameters())[groups[0][0]].requires_grad_(False)
    opt = torch.optim.SGD([p for p in pm.parameters() if p.requires_grad], lr=LR)
    (xl,) = pm.plan.local_inputs(x)
    for _ in range(3):
        opt.zero_grad()
        pm(xl)[0].square().mean().backward()
        opt.step()
    return pm.state_dict(full=True), groups


def test_a_weight_frozen_after_parallelize_leaves_the_rest_of_its_group_reduced():
    """A weight frozen after parallelize gets no gradient, so its group's node is applied to the others
    alone: their gradients are still reduced (else each rank would step on its own shard's gradient)."""
    torch.manual_seed(0)
    model, x = _TwoHeads(), torch.randn(8, 8)
    ref = copy.deepcopy(model)
    ref.body.weight.requires_grad_(False)
    opt = torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], lr=LR)
    for _ in range(3):
        opt.zero_grad()
        ref(x)[0].square().mean().backward()
        opt.step()
    for params, groups in run_threaded(2, _frozen_first, model, x):
        assert groups[0][0] == "body.weight" and len(groups[0]) > 1, groups   # the case is made
        for n, p in ref.named_parameters():
            torch.testing.assert_close(params[n], p.detach(), atol=ATOL, rtol=0, msg=lambda m: f"{n}: {m}")
