"""Pipeline parallelism: the stage cut, the plan's text and JSON, bad requests, and training on 4 gloo
ranks that matches one device (pp x dp, pp x tp, pp alone; 1F1B and GPipe).

Tolerances as in test_equivalence: fp32, atol 1e-5, rtol 0. Every equivalence case trains with AdamW at
lr 1e-4 (a larger rate turns float noise in near-zero gradients into differences above atol;
microbatching sums in another order) and with SGD at lr 0.1: Adam's step is blind to a gradient's scale,
so only SGD shows a gradient averaged wrongly over microbatches or ranks.
"""
from dataclasses import replace

import pytest
import torch

import autopar
from autopar.runtime.lowering.recompute import CheckpointRegion
import cost_models as cm
from autopar import Plan
from autopar.errors import MeshError, PipelineError, PlanError
from autopar.sharding.placement import shard_dim
from autopar.testing import GPT, GPTConfig, gpt_loss, run_gloo, single_device_reference

ATOL = 1e-5
LR = 1e-4
STEPS = 3
OPTIMIZERS = {"AdamW": (torch.optim.AdamW, LR), "SGD": (torch.optim.SGD, 0.1)}


def _gpt(**config):
    torch.manual_seed(0)
    return GPT(GPTConfig(**{"n_layer": 4, **config}))


def _batch():
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 64, (8, 16), generator=g), torch.randint(0, 64, (8, 16), generator=g)


def _mean_square(logits):
    """A loss without targets (module level: spawned ranks unpickle it)."""
    return logits.float().pow(2).mean()


def _loss(model, inputs, loss_fn, targets):
    """train_step's loss on a pipelined module, or the same loss by hand on a plain one."""
    if isinstance(model, autopar.ParallelModule):
        return model.train_step(*inputs, loss_fn=loss_fn, **({} if targets is None else {"targets": targets}))
    out = model(*inputs)
    loss = loss_fn(out) if targets is None else loss_fn(out, targets)
    loss.backward()
    return loss


def _fit(model, inputs, targets, loss_fn=gpt_loss) -> dict:
    """Per optimizer, from the same start: losses, the first step's gradients, the parameters after STEPS."""
    start = {k: v.detach().clone() for k, v in model.state_dict(**_full(model)).items()}
    out = {}
    for name, (cls, lr) in OPTIMIZERS.items():
        model.load_state_dict(start)
        opt = cls(model.parameters(), lr=lr)
        rec = {"losses": []}
        for step in range(STEPS):
            opt.zero_grad(set_to_none=True)
            rec["losses"].append(_loss(model, inputs, loss_fn, targets).item())
            if step == 0:
                rec["grads"] = _grads(model)
            opt.step()
        rec["params"] = {k: v.detach().clone() for k, v in model.state_dict(**_full(model)).items()}
        out[name] = rec
    return out


def _full(model):
    return {"full": True} if isinstance(model, autopar.ParallelModule) else {}


def _grads(model):
    if isinstance(model, autopar.ParallelModule):
        return model.full_grads()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _reference(x, y, loss_fn=gpt_loss, config=None) -> dict:
    """One device, the whole batch every step: what each optimizer's parallel run must reproduce."""
    return _fit(_gpt(**(config or {})), (x,), y, loss_fn)


def _train_cases(rank, mesh_shape, axis_names, cases: dict, x, y, config=None):
    """In each gloo process, on one mesh: _train for each case, {name: (plan kwargs, plan JSON or None)}.
    One launch for several cases: starting 4 processes is most of a case's time."""
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=axis_names)
    out = {}
    for name, (kwargs, plan_json) in cases.items():
        kwargs = dict(kwargs)
        layers = {"n_layer": kwargs.pop("n_layer")} if "n_layer" in kwargs else {}
        out[name] = _train(mesh, kwargs, x, y, {**(config or {}), **layers}, plan_json)
    return out


def _train(mesh, plan_kwargs, x, y, config=None, plan_json=None):
    plan = Plan.from_json(plan_json) if plan_json else None
    plan_kwargs = {"hardware": "cpu", **plan_kwargs}
    pm = autopar.parallelize(_gpt(**(config or {})), mesh, (x,), plan=plan, record_comm=True, **plan_kwargs)
    (local_y,) = pm.plan.local_targets(y)
    out = _fit(pm, pm.plan.local_inputs(x), local_y)
    out["plan"] = pm.plan.to_json()
    # data-axis all-reduces in backward, per training step (_fit runs STEPS per optimizer)
    dp = pm.plan.mesh.axis_names.index("dp") if "dp" in pm.plan.mesh.axis_names else None
    num = sum(1 for kind, axis, _, phase in pm.comm.log.records if kind == "all_reduce" and axis == dp
              and phase == "backward")
    out["dp_reduces_per_step"] = num / (STEPS * len(OPTIMIZERS))
    out["num_buckets"] = pm._grad_buckets.num_buckets()
    out["num_weights"] = sum(1 for _ in pm.parameters())
    stages = pm._pipeline.stage_modules if pm._pipeline is not None else []
    out["regions"] = sum(isinstance(m, CheckpointRegion) for s in stages for m in s.modules())
    return out


def _check(results, ref, plan, case=""):
    """Every rank's parameters and gradients equal one device's, for each optimizer; so do the losses."""
    for opt in OPTIMIZERS:
        for r in results:
            got, want = r[opt], ref[opt]
            for name, p in got["params"].items():
                torch.testing.assert_close(p, want["params"][name], atol=ATOL, rtol=0,
                                           msg=lambda m: f"{case} {opt}, {name}: {m}")
            for name, g in got["grads"].items():
                torch.testing.assert_close(g, want["grads"][name], atol=ATOL, rtol=0,
                                           msg=lambda m: f"{case} {opt}, grad {name}: {m}")
            if not plan.batch_axes:
                assert got["losses"] == pytest.approx(want["losses"], abs=ATOL), (case, opt)
        if plan.batch_axes:   # each rank's loss is the mean over its shard: together they average to one device's
            for step in range(STEPS):
                mean = sum(r[opt]["losses"][step] for r in results) / len(results)
                assert mean == pytest.approx(ref[opt]["losses"][step], abs=ATOL), (case, opt)


# free links but for all-to-alls: no Ulysses, and compute decides between K/V gathered and the ring (cheaper: causal)
RING_LINKS = cm.Link(bandwidth=1e12, latency=1e-12, kinds={cm.ALL_TO_ALL: cm.Link(bandwidth=1e3, latency=1.0)})
# (mesh shape, axis names) -> {case: plan kwargs}: every mesh's cases share one launch of 4 processes
CASES = {
    ((2, 2), ("pp", "dp")): {
        "pp2 x dp2, 1f1b": dict(pipeline_axis="pp", strategy="ddp", schedule="1f1b"),
        "pp2 x dp2, gpipe": dict(pipeline_axis="pp", strategy="ddp", schedule="gpipe"),
        "pp2 x dp2, interleaved 1f1b": dict(pipeline_axis="pp", strategy="ddp", microbatches=4,
                                            schedule="interleaved-1f1b"),
        "pp2 x dp2, zero bubble": dict(pipeline_axis="pp", strategy="ddp", microbatches=4, schedule="zero-bubble"),
        # 3 virtual stages per rank: 6 stages over 6 layers, each rank's 3 stages taking turns in torch's order
        "pp2 x dp2, interleaved 1f1b, 3 stages per device": dict(pipeline_axis="pp", strategy="ddp", microbatches=4,
                                                                 schedule="interleaved-1f1b", stages_per_device=3,
                                                                 n_layer=6),
        # recompute under a pipeline: each stage's blocks (or their attention cores) run as checkpointed regions
        "pp2 x dp2, 1f1b, full recompute": dict(pipeline_axis="pp", strategy="ddp", checkpointing="full"),
        "pp2 x dp2, interleaved 1f1b, selective recompute": dict(pipeline_axis="pp", strategy="ddp", microbatches=4,
                                                                 schedule="interleaved-1f1b",
                                                                 checkpointing="selective")},
    ((2, 2), ("dp", "pp")): {"dp2 x pp2 (fsdp), 1f1b": dict(pipeline_axis="pp", strategy="fsdp")},
    # context parallelism inside each stage: the stage's attention gathers K and V over cp; or, where cp's
    # all-to-alls are dear and its other collectives cheap, runs as a ring
    # (fsdp+cp on pp x cp: no data axis, so the weights split over cp, as torchtitan's 405B cp rows run)
    ((2, 2), ("pp", "cp")): {"pp2 x cp2, 1f1b": dict(pipeline_axis="pp", strategy="cp"),
                             "pp2 x cp2 ring, 1f1b": dict(pipeline_axis="pp", strategy="cp", links={"cp": RING_LINKS}),
                             "pp2 x cp2 (fsdp+cp), 1f1b": dict(pipeline_axis="pp", strategy="fsdp+cp")},
    ((2, 2), ("pp", "tp")): {
        "pp2 x tp2, gpipe": dict(pipeline_axis="pp", strategy="tp", schedule="gpipe"),
        "pp2 x tp2, 1f1b": dict(pipeline_axis="pp", strategy="tp", microbatches=2)},
    ((4,), ("pp",)): {
        "pp4, 1f1b": dict(pipeline_axis="pp", microbatches=4),
        "pp4, gpipe": dict(pipeline_axis="pp", microbatches=8, schedule="gpipe"),
        # 2 virtual stages per rank: 8 stages, so 8 layers (n_layer: the model's, not a planning option)
        "pp4, interleaved 1f1b": dict(pipeline_axis="pp", microbatches=8, schedule="interleaved-1f1b", n_layer=8),
        "pp4, zero bubble": dict(pipeline_axis="pp", microbatches=8, schedule="zero-bubble"),
        # priced on gloo's links the cut moves so that a stage sends a contiguous view (a reshape's output), which
        # the zero-bubble schedule detaches in place: the stage sends a copy (stages._own_storage)
        "pp4, zero bubble, gloo links": dict(pipeline_axis="pp", microbatches=8, schedule="zero-bubble",
                                             hardware="cpu-gloo")},
}


def _four_rank_cases(rank, x, y):
    """Every mesh's CASES, and the loss-inside case on pp2 x tp2, in one gloo launch of 4 processes
    (issue 37: starting 4 processes is ~5 s on 2 cores): {mesh or case name: results}."""
    out = {mesh: _train_cases(rank, *mesh, {name: (kwargs, None) for name, kwargs in cases.items()}, x, y)
           for mesh, cases in CASES.items()}
    out["loss inside, pp2 x tp2"] = _train_loss_inside(rank)
    return out


@pytest.fixture(scope="module")
def four_ranks():
    """{mesh or case name: [rank 0's results, ..., rank 3's]} of _four_rank_cases."""
    by_rank = run_gloo(4, _four_rank_cases, *_batch(), timeout=600)
    return {key: [r[key] for r in by_rank] for key in by_rank[0]}


@pytest.mark.parametrize("mesh", list(CASES), ids=lambda m: " x ".join(f"{n}{s}" for s, n in zip(*m)))
def test_pipelined_training_matches_one_device(mesh, four_ranks):
    x, y = _batch()
    cases = CASES[mesh]
    refs = {n: _reference(x, y, config={"n_layer": n}) for n in {k.get("n_layer", 4) for k in cases.values()}}
    by_case = four_ranks[mesh]
    for case, kwargs in cases.items():
        _check_case(case, kwargs, [r[case] for r in by_case], refs[kwargs.get("n_layer", 4)])
        if kwargs.get("strategy") == "fsdp+cp":   # every weight split over cp, whole on pp (each stage's own)
            plan = Plan.from_json(by_case[0][case]["plan"])
            assert all(pl[0] == "R" and pl[1].startswith("S(") for pl in plan.param_placements.values()), case
        if "ring" in case:   # keys split with the rows on cp: each stage's attention is a ring
            plan = Plan.from_json(by_case[0][case]["plan"])
            attention = [s for n, s in plan.node_strategies.items() if n.startswith("scaled_dot_product_attention")]
            assert attention and all(shard_dim(s.inputs[1][1]) == 2 for s in attention), (case, attention)


def _check_case(case, kwargs, results, ref):
    plan = Plan.from_json(results[0]["plan"])
    pipe = plan.pipeline
    assert pipe is not None and pipe.axis == "pp", case
    assert pipe.schedule == kwargs.get("schedule", "1f1b"), case
    if "microbatches" in kwargs:
        assert pipe.microbatches == kwargs["microbatches"], case
    if "stages_per_device" in kwargs:
        assert pipe.stages_per_device == kwargs["stages_per_device"], case
        assert pipe.num_stages == 2 * kwargs["stages_per_device"] and pipe.bubble == pytest.approx(1 / (4 * 3)), case
    _check(results, ref, plan, case)
    if kwargs.get("checkpointing") in ("full", "selective"):
        assert plan.checkpointed == {"h": kwargs["checkpointing"]}, case
        # every block of the model recomputes on some device: 4 regions over the pipeline
        assert all(r["regions"] >= 1 for r in results) and sum(r["regions"] for r in results) == 2 * 4, case
    if kwargs.get("strategy") == "ddp":
        # the data axis reduces each weight's gradient once per step, in buckets, not once per microbatch
        # (the position embedding's gradient too: it flows on to wpe's bucket, cost/buckets.partial_gradients)
        for r in results:
            assert r["num_buckets"] >= 1, case
            assert r["dp_reduces_per_step"] == r["num_buckets"], case
            assert r["dp_reduces_per_step"] < r["num_weights"], case
    # every parameter lives on some stage, and a device holds only its own stages' parameters
    per_device = [set(r["AdamW"]["params"]) for r in results]
    everything = set(ref["AdamW"]["params"])
    assert set().union(*per_device) == everything, case
    assert all(s < everything for s in per_device), f"{case}: a device holds every parameter with {pipe.num_stages} stages"


def _cut_after(plan, op):
    """The plan with its first cut moved to just after `op`: the ops between go to the other stage."""
    pipe = plan.pipeline
    s0, s1 = pipe.stages[:2]
    ops = s0.nodes + s1.nodes
    k = ops.index(op) + 1
    stages = (replace(s0, nodes=ops[:k]), replace(s1, nodes=ops[k:])) + pipe.stages[2:]
    return replace(plan, pipeline=replace(pipe, stages=stages))


def test_stages_send_a_view_contiguous():
    """pp4 on a GPT of n_embd 64, cut right after the first attention: what crosses is the attention's
    output, a transposed view, and its gradient comes back through a transpose. gloo (and NCCL) send
    and receive only contiguous tensors, and torch makes the receive buffers with the strides it saw."""
    from autopar.capture.export import capture
    config = dict(n_embd=64, n_head=4)
    x, y = _batch()
    op = "scaled_dot_product_attention"
    assert not capture(_gpt(**config), (x[:2],)).node(op).meta["val"].is_contiguous()   # the case this is for
    plans = {s: _cut_after(autopar.plan(_gpt(**config), x, {"pp": 4}, hardware="cpu", pipeline_axis="pp",
                                        microbatches=4, schedule=s), op) for s in ("1f1b", "gpipe")}
    by_case = run_gloo(4, _train_cases, (4,), ("pp",), {s: ({}, p.to_json()) for s, p in plans.items()}, x, y, config)
    ref = _reference(x, y, config=config)
    for s, plan in plans.items():
        _check([r[s] for r in by_case], ref, plan, s)


def _two_rank_cases(rank, x, y):
    """Every 2-rank case of this file in one gloo launch (issue 37: a launch is ~5 s of process start and
    imports, the cases a few seconds each): each case's own results, by name."""
    return {"targets free": _train_targets_free(rank, x, y),
            "a new lambda each step": _train_with_a_new_lambda_each_step(rank, x, y),
            "loss inside, pp2": _train_loss_inside(rank, (2,), ("pp",), "ddp"),
            "bare forward": _refuse_forward(rank)}


@pytest.fixture(scope="module")
def two_ranks():
    """{case: [rank 0's results, rank 1's]} of _two_rank_cases."""
    by_rank = run_gloo(2, _two_rank_cases, *_batch())
    return {case: [r[case] for r in by_rank] for case in by_rank[0]}


def _train_targets_free(rank, x, y):
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("pp",))
    pm = autopar.parallelize(_gpt(), mesh, (x,), hardware="cpu", pipeline_axis="pp")
    out = _fit(pm, pm.plan.local_inputs(x), None, _mean_square)
    # then a loss with targets on the same module: a schedule is kept per whether targets came
    (local_y,) = pm.plan.local_targets(y)
    out["then_with_targets"] = pm.train_step(*pm.plan.local_inputs(x), loss_fn=gpt_loss, targets=local_y).item()
    out["plan"] = pm.plan.to_json()
    return out


def test_a_loss_without_targets_matches_one_device(two_ranks):
    x, y = _batch()
    ref = _reference(x, None, _mean_square)
    results = two_ranks["targets free"]
    plan = Plan.from_json(results[0]["plan"])
    assert plan.pipeline is not None
    _check(results, ref, plan)
    model = _gpt()
    model.load_state_dict(ref["SGD"]["params"])
    then = gpt_loss(model(x), y).item()
    assert [r["then_with_targets"] for r in results] == pytest.approx([then] * 2, abs=ATOL)


def _train_with_a_new_lambda_each_step(rank, x, y):
    import gc
    import weakref

    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("pp",))
    pm = autopar.parallelize(_gpt(), mesh, (x,), hardware="cpu", pipeline_axis="pp")
    (local_x,), (local_y,) = pm.plan.local_inputs(x), pm.plan.local_targets(y)
    start = {k: v.clone() for k, v in pm.state_dict(full=True).items()}
    out, passed = {}, []
    for name, (cls, lr) in OPTIMIZERS.items():
        pm.load_state_dict(start)
        opt = cls(pm.parameters(), lr=lr)
        losses = []
        for _ in range(STEPS):
            opt.zero_grad(set_to_none=True)
            loss_fn = lambda logits, targets: gpt_loss(logits, targets)   # noqa: E731 (a new object each step)
            passed.append(weakref.ref(loss_fn))
            losses.append(pm.train_step(local_x, loss_fn=loss_fn, targets=local_y).item())
            del loss_fn
            opt.step()
        out[name] = {"losses": losses, "params": {k: v.clone() for k, v in pm.state_dict(full=True).items()}}
    gc.collect()
    out["loss_fns_kept"] = sum(r() is not None for r in passed)
    out["num_schedules"] = len(pm._pipeline.schedules)   # (runtime/pipeline/runner.PipelineRunner)
    return out


def test_a_new_loss_fn_each_step_reuses_the_schedule_and_keeps_no_old_one(two_ranks):
    """A lambda made each step: one schedule serves every step (none kept per loss function), and training
    still equals one device's."""
    x, y = _batch()
    results = two_ranks["a new lambda each step"]
    ref = _reference(x, y)
    for r in results:
        assert r["num_schedules"] == 1 and r["loss_fns_kept"] == 0, (r["num_schedules"], r["loss_fns_kept"])
        for opt in OPTIMIZERS:
            assert r[opt]["losses"] == pytest.approx(ref[opt]["losses"], abs=ATOL), opt
            for name, p in r[opt]["params"].items():
                torch.testing.assert_close(p, ref[opt]["params"][name], atol=ATOL, rtol=0,
                                           msg=lambda m: f"{opt}, {name}: {m}")


def _returned_loss(out):
    """nanoGPT's (logits, loss): the loss the model computed (module level: spawned ranks unpickle it)."""
    return out[1]


def _gpt_with_loss():
    from autopar.testing import GPTWithLoss
    torch.manual_seed(0)
    # a vocabulary large next to the hidden size, as in real models: the loss splits it over tp
    model = GPTWithLoss(GPTConfig(vocab_size=1536, block_size=24, n_layer=4, n_head=6, n_embd=48))
    g = torch.Generator().manual_seed(1)
    return model, torch.randint(0, 1536, (8, 24), generator=g), torch.randint(0, 1536, (8, 24), generator=g)


def _train_loss_inside(rank, shape=(2, 2), names=("pp", "tp"), strategy="tp"):
    import copy

    from torch.distributed.device_mesh import init_device_mesh
    model, x, y = _gpt_with_loss()
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    out = {}
    for name, (opt_cls, lr) in OPTIMIZERS.items():
        pm = autopar.parallelize(copy.deepcopy(model), mesh, (x, y), strategy=strategy, pipeline_axis="pp",
                                 microbatches=2, hardware="cpu")
        opt = autopar.ShardedOptimizer(pm, opt_cls, lr=lr)
        losses = []
        for _ in range(STEPS):
            opt.zero_grad(set_to_none=True)
            losses.append(pm.train_step(*pm.plan.local_inputs(x, y), loss_fn=_returned_loss).item())
            opt.step()
        out[name] = {"losses": losses, "params": {k: v.clone() for k, v in pm.state_dict(full=True).items()}}
        out["plan"] = pm.plan.to_json()
    return out


def test_a_loss_inside_forward_trains_pipelined_with_the_vocabulary_split(four_ranks):
    """nanoGPT's forward(idx, targets) on pp2 x tp2: the last stage returns the model's own loss (a 0-dim
    tensor, which torch's merge of the microbatches' outputs cannot concatenate: the module does not merge
    them) and computes it on each tp rank's slice of the vocabulary; SGD and AdamW train like one device."""
    results = four_ranks["loss inside, pp2 x tp2"]
    plan = Plan.from_json(results[0]["plan"])
    loss_op = next(n for n in plan.node_strategies if n.startswith("cross_entropy_loss_default"))
    assert plan.pipeline is not None and "S(1)" in plan.node_strategies[loss_op].inputs[0]
    _check_loss_inside(results)


def test_a_loss_inside_forward_trains_pipelined_with_whole_targets_crossing_the_stages(two_ranks):
    """The same model on pp2 alone: the targets cross to the last stage as they are, and its cross-entropy
    reads them whole. Before its first step torch runs each stage on tensors made from the previous one's
    shapes, uninitialised: targets made so were out of range and the cross-entropy raised IndexError
    (_compat.pipeline_stage gives integer ones zeros)."""
    results = two_ranks["loss inside, pp2"]
    plan = Plan.from_json(results[0]["plan"])
    loss_op = next(n for n in plan.node_strategies if n.startswith("cross_entropy_loss_default"))
    assert plan.pipeline is not None and plan.node_strategies[loss_op].inputs[1] == ("R",)
    _check_loss_inside(results)


def _check_loss_inside(results):
    import copy
    model, x, y = _gpt_with_loss()
    for name, (opt_cls, lr) in OPTIMIZERS.items():
        ref = copy.deepcopy(model)
        opt = opt_cls(ref.parameters(), lr=lr)
        losses = []
        for _ in range(STEPS):
            opt.zero_grad(set_to_none=True)
            loss = ref(x, y)[1]
            loss.backward()
            opt.step()
            losses.append(loss.item())
        held = set()
        for r in results:
            assert r[name]["losses"] == pytest.approx(losses, abs=ATOL), name
            for n, p in r[name]["params"].items():   # each stage's own weights
                torch.testing.assert_close(p, dict(ref.named_parameters())[n].detach(), atol=ATOL, rtol=0, msg=n)
            held |= set(r[name]["params"])
        assert held == {n for n, _ in ref.named_parameters()}


def test_pipelined_module_refuses_a_bare_forward_and_gives_its_stages_state(two_ranks):
    names = two_ranks["bare forward"]
    everything = set(_gpt().state_dict())
    assert set(names[0]) | set(names[1]) == everything
    assert all(set(n) < everything for n in names), "a stage's module gave the whole model"


def _refuse_forward(rank):
    from torch.distributed.device_mesh import init_device_mesh
    x, _ = _batch()
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("pp",))
    pm = autopar.parallelize(_gpt(), mesh, (x,), hardware="cpu", pipeline_axis="pp")
    with pytest.raises(PlanError, match="train_step"):
        pm(*pm.plan.local_inputs(x))
    # state_dict() works: this device's stages' tensors (whole: pp is the mesh's only axis)
    return sorted(pm.state_dict())


def test_train_step_without_a_pipeline_is_forward_and_backward():
    from autopar.testing import run_threaded
    x, y = _batch()
    ref = single_device_reference(_gpt, x, y, gpt_loss, steps=1, lr=LR)
    model = _gpt()   # seeded once: threads share torch's random generator

    def fn(rank):
        import copy
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
        pm = autopar.parallelize(copy.deepcopy(model), mesh, (x,), hardware="cpu", strategy="ddp")
        loss = pm.train_step(*pm.plan.local_inputs(x), loss_fn=gpt_loss, targets=pm.plan.local_targets(y)[0])
        return loss.item(), pm.full_grads()
    results = run_threaded(2, fn)
    assert sum(r[0] for r in results) / 2 == pytest.approx(ref["losses"][0], abs=ATOL)
    for name, g in results[0][1].items():
        torch.testing.assert_close(g, ref["grads"][name], atol=ATOL, rtol=0)


# ---------------------------------------------------------------- the cut


def test_partitioner_balances_a_model_with_a_big_embedding_and_head():
    """Vocabulary 32768 on a hidden size of 256: the embedding and the output head weigh like blocks,
    so an even split of the 8 blocks over 4 stages would make the first and last stages the slowest."""
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=32768, n_layer=8, n_embd=256, block_size=64))
    x = torch.zeros((32, 64), dtype=torch.long, device="meta")
    plan = autopar.plan(model, x, {"pp": 4}, hardware="h100", pipeline_axis="pp")
    stages = plan.pipeline.stages
    times = [s.time for s in stages]
    assert max(times) <= 1.15 * min(times), [f"{t:.3g}" for t in times]

    def blocks(stage):
        paths = (plan.module_paths.get(n, "") for n in stage.nodes)   # shape reads have no module
        return {p.split(".")[1] for p in paths if p.startswith("h.")}
    assert "wte" in stages[0].modules and "lm_head" in stages[-1].modules
    # the stages holding the embedding and the head take fewer blocks than those in between
    assert len(blocks(stages[0])) < len(blocks(stages[1])) and len(blocks(stages[-1])) < len(blocks(stages[2]))
    # every op runs in exactly one stage, in graph order
    ops = [n for s in stages for n in s.nodes]
    assert len(ops) == len(set(ops))


def test_plan_text_and_json_show_the_stages():
    x, _ = _batch()
    plan = autopar.plan(_gpt(), x, {"pp": 2, "dp": 2}, hardware="cpu", pipeline_axis="pp", strategy="ddp",
                        microbatches=4)
    text = str(plan)
    assert "pipeline over pp (2 devices, 2 stages): 1f1b, 4 microbatches" in text
    assert "bubble (p-1)/m = 0.250" in text
    for s in plan.pipeline.stages:
        assert s.modules in text
    assert plan.pipeline.bubble == pytest.approx(1 / 4)
    # the step: (m + p - 1) slots of the slowest stage, the gradient all-reduce once (the microbatches' gradients
    # are summed and reduced once), then the optimizer step of the busiest device
    slowest = max(s.time for s in plan.pipeline.stages)
    once = plan.predicted.step_time - (4 + 1) * slowest - plan.predicted.optimizer_time
    # (the slowest device may be another than the one whose memory is shown: the bound is loose)
    assert 0 < plan.predicted.optimizer_time and 0 < once < 2 * plan.predicted.comm_time["dp"]
    # the dp bytes: one all-reduce of the device's weights (2 (n-1)/n = 1 of their bytes on 2 ranks), not one
    # per microbatch
    assert plan.predicted.comm_bytes["dp"] < 1.01 * 4 * sum(p.numel() for p in _gpt().parameters())
    assert Plan.from_json(plan.to_json()).pipeline == plan.pipeline
    # 1F1B: stage s keeps at most p - s microbatches in flight; GPipe keeps all
    assert [s.in_flight for s in plan.pipeline.stages] == [2, 1]
    gpipe = autopar.plan(_gpt(), x, {"pp": 2, "dp": 2}, hardware="cpu", pipeline_axis="pp", strategy="ddp",
                         microbatches=4, schedule="gpipe")
    assert [s.in_flight for s in gpipe.pipeline.stages] == [4, 4]
    assert gpipe.predicted.memory.total > plan.predicted.memory.total


def test_memory_limit_moves_the_cut():
    """Under a limit the first stage (two microbatches in flight under 1F1B, the last stage one)
    sheds ops to the second, though that makes the stages less even."""
    x = torch.randint(0, 64, (64, 16))   # activations outweigh the weights
    # no recompute: under "auto" the search may meet the limit by recomputing instead of moving the cut
    kwargs = dict(hardware="cpu", pipeline_axis="pp", microbatches=2, checkpointing="none")
    free = autopar.plan(_gpt(), x, {"pp": 2}, **kwargs)
    limit = int(max(s.memory for s in free.pipeline.stages)) - 1   # the unlimited cut no longer fits
    tight = autopar.plan(_gpt(), x, {"pp": 2}, memory_limit=limit, **kwargs)
    assert max(s.memory for s in tight.pipeline.stages) <= limit
    assert len(tight.pipeline.stages[0].nodes) < len(free.pipeline.stages[0].nodes)
    assert tight.predicted.step_time >= free.predicted.step_time
    with pytest.raises(PipelineError, match="fits memory_limit"):
        autopar.plan(_gpt(), x, {"pp": 2}, memory_limit=limit * 2 // 3, **kwargs)


# ---------------------------------------------------------------- bad requests


def test_more_stages_than_layers():
    x, _ = _batch()
    with pytest.raises(PipelineError, match="asks for 8 stages but the model has 4 layer"):
        autopar.plan(_gpt(), x, {"pp": 8}, hardware="cpu", pipeline_axis="pp")
    with pytest.raises(PipelineError, match="asks for 8 stages"):
        autopar.plan(_gpt(), x, {"pp": 4}, hardware="cpu", pipeline_axis="pp", schedule="interleaved-1f1b")


def test_microbatches_must_divide_the_batch():
    x, _ = _batch()
    with pytest.raises(PipelineError, match="microbatches=3 does not divide the batch of 8"):
        autopar.plan(_gpt(), x, {"pp": 2}, hardware="cpu", pipeline_axis="pp", microbatches=3)
    with pytest.raises(PipelineError, match="positive integer"):
        autopar.plan(_gpt(), x, {"pp": 2}, hardware="cpu", pipeline_axis="pp", microbatches=0)


def test_1f1b_needs_a_microbatch_per_stage():
    """torch's 1F1B refuses fewer microbatches than stages at the first step; planning says so first."""
    x, _ = _batch()
    with pytest.raises(PipelineError, match="microbatches=2 on axis 'pp': schedule '1f1b' needs at least 4"):
        autopar.plan(_gpt(), x, {"pp": 4}, hardware="cpu", pipeline_axis="pp", microbatches=2)
    plan = autopar.plan(_gpt(), x, {"pp": 4}, hardware="cpu", pipeline_axis="pp", microbatches=2, schedule="gpipe")
    assert plan.pipeline.microbatches == 2


def test_pipeline_axis_must_exist():
    x, _ = _batch()
    with pytest.raises(PipelineError, match="'pipe' is not an axis of mesh dp=2 x tp=2"):
        autopar.plan(_gpt(), x, {"dp": 2, "tp": 2}, hardware="cpu", pipeline_axis="pipe")
    with pytest.raises(PipelineError, match="schedule="):
        autopar.plan(_gpt(), x, {"pp": 2}, hardware="cpu", pipeline_axis="pp", schedule="no-bubble")
    with pytest.raises(PipelineError, match="pipeline_axis=None"):
        autopar.plan(_gpt(), x, {"pp": 2}, hardware="cpu", microbatches=2)
    assert issubclass(PipelineError, autopar.AutoparError) and not issubclass(PipelineError, MeshError)


def test_schedule_auto_prices_each_schedule_and_keeps_the_fastest():
    """Zero bubble idles a third of 1F1B's bubble (the weights' gradients fill the rest): priced so,
    "auto" keeps it, and the plan says which it chose."""
    x, _ = _batch()
    plans = {s: autopar.plan(_gpt(), x, {"pp": 2}, hardware="cpu", pipeline_axis="pp", microbatches=4, schedule=s)
             for s in ("1f1b", "zero-bubble", "auto")}
    one_f, zb = plans["1f1b"].pipeline, plans["zero-bubble"].pipeline
    assert zb.bubble == pytest.approx(one_f.bubble / 3)
    assert plans["zero-bubble"].predicted.step_time < plans["1f1b"].predicted.step_time
    assert plans["auto"].pipeline.schedule == "zero-bubble"
    assert plans["auto"].predicted.step_time == pytest.approx(plans["zero-bubble"].predicted.step_time)
    assert "zero-bubble" in str(plans["auto"])
    ten = torch.cat([x, x[:2]])   # torch's ZB1P runs microbatches in m // p rounds: 5 do not split in 2
    with pytest.raises(PipelineError, match=r"multiple of microbatches // 2 \(2\)"):
        autopar.plan(_gpt(), ten, {"pp": 2}, hardware="cpu", pipeline_axis="pp", microbatches=5, schedule="zero-bubble")


def test_auto_picks_the_fastest_of_flat_and_pipelined_plans():
    """pipeline_axis='auto' compares the flat plan with a pipeline over each axis (and microbatch count)
    by predicted step time, and keeps the fastest."""
    x, _ = _batch()
    mesh = {"a": 2, "b": 2}
    auto = autopar.plan(_gpt(), x, mesh, hardware="cpu", pipeline_axis="auto")
    options = [autopar.plan(_gpt(), x, mesh, hardware="cpu")]
    options += [autopar.plan(_gpt(), x, mesh, hardware="cpu", pipeline_axis=a, microbatches=m)
                for a in mesh for m in (2, 4, 8)]
    best = min(p.predicted.step_time for p in options)
    assert auto.predicted.step_time == pytest.approx(best)
    assert auto.pipeline is not None   # on this toy model a pipeline is predicted faster (no gradient all-reduce)
