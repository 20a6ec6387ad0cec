"""torchtitan's selective activation checkpointing: per op (checkpointing="per-op") and per layer ("per-layer").

Each block of a stack is one checkpointed region whose fused attention kernels and every second matmul
(the 1st, 3rd, ... aten.mm/addmm of the block) are cached in forward; every other op is recomputed in
backward. Checked: which ops the plan caches (q, v, gate, down in a Llama block), the bytes the run
keeps against the prediction (autopar.audit: autograd's saved tensors, what each checkpoint holds and what
its policy caches), training against one device (SGD and AdamW, ddp and fsdp, gloo ranks, and compiled),
and the requests that cannot be met. Per layer (ac_freq 2): every second block of a stack (the 2nd, 4th, ...)
is recomputed whole, the others keep their activations; checked the same way.
"""
from __future__ import annotations

import copy

import pytest
import torch

import autopar
from autopar.testing import gpt_loss, run_gloo, run_threaded, single_device_reference, tiny_llama
from autopar.testing.harness import audit_each
from autopar.testing.models import seeded_gpt, seeded_llama

REL = 0.03   # activations, as in test_recompute


def test_a_llama_block_caches_q_v_gate_and_down():
    """torchtitan's policy on a Llama block: of q, k, v, o, gate, up, down, the 1st, 3rd, 5th and 7th."""
    from autopar.capture.export import capture
    from autopar.cost.checkpointing import PER_OP, checkpointable_stacks
    model, x, _ = seeded_llama()
    cap = capture(model, (x,))
    (stack,) = [st for st in checkpointable_stacks(cap, "cpu") if st.kind == PER_OP]
    for i, policy in enumerate(stack.policies):
        assert policy.matmuls == (True, False, True, False, True, False, True)
        assert policy.attentions == (True,)   # the CPU's fused kernel
        where = [cap.node(n).meta["nn_module_stack"] for n in policy.cached]
        leaf = [list(w.values())[-1][0].rsplit(".", 1)[-1] if w else "" for w in where]
        assert leaf == ["q_proj", "v_proj", "self_attn", "gate_proj", "down_proj"], leaf
        assert all(f"layers.{i}." in list(w.values())[-1][0] for w in where)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
@pytest.mark.parametrize("make", [seeded_gpt, seeded_llama], ids=["gpt", "llama"])
def test_plans_predict_what_the_run_keeps(make, strategy):
    model, x, _ = make()
    modes = ("none", "per-op", "per-layer", "full")
    kept = {}
    requests = [{"strategy": strategy, "checkpointing": mode} for mode in modes]
    for rank, audits in enumerate(run_threaded(2, audit_each, model, x, (2,), ("dp",), requests)):
        for mode, (rows, plan) in zip(modes, audits):
            predicted, measured = rows["activations saved for backward"]
            assert measured == pytest.approx(predicted, rel=REL), \
                f"{strategy} checkpointing={mode} rank {rank}: predicted {predicted:.0f} B, kept {measured:.0f} B"
            assert rows["comm bytes on dp"][0] == rows["comm bytes on dp"][1]
            kept[mode] = measured
    # each keeps some of what checkpointing every whole block drops
    assert kept["full"] < kept["per-op"] < kept["none"] and kept["full"] < kept["per-layer"] < kept["none"]


def _train(rank, model, x, y, strategy, optimizers, compile_backend=None, steps=3, lr=1e-2, mode="per-op"):
    """parallel_record's steps (compiled with `compile_backend` where given), once per optimizer class, each
    from the same start (one parallelize serves them all: its capture is what takes the time)."""
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    pm = autopar.parallelize(copy.deepcopy(model), mesh, (x,), hardware="cpu", strategy=strategy,
                             checkpointing=mode)
    run = pm if compile_backend is None else torch.compile(pm, backend=compile_backend)
    (local_x,), (local_y,) = pm.plan.local_inputs(x), pm.plan.local_targets(y)
    start = {k: v.clone() for k, v in pm.state_dict(full=True).items()}
    out = {"plan": pm.plan}
    for optimizer in optimizers:
        pm.load_state_dict(start)
        opt = autopar.ShardedOptimizer(pm, optimizer, lr=lr)
        for _ in range(steps):
            opt.zero_grad(set_to_none=True)
            gpt_loss(run(local_x), local_y).backward()
            opt.step()
        out[optimizer] = {k: v.clone() for k, v in pm.state_dict(full=True).items()}
    return out


def _check_training(records, model, x, y, atol=1e-5, mode="per-op"):
    for optimizer in (torch.optim.SGD, torch.optim.AdamW):
        ref = single_device_reference(lambda: copy.deepcopy(model), x, y, gpt_loss, steps=3, lr=1e-2,
                                      optimizer=optimizer)
        for rank, rec in enumerate(records):
            assert rec["plan"].checkpointed == {"h": mode}
            for name, p in ref["params"].items():
                torch.testing.assert_close(rec[optimizer][name], p, atol=atol, rtol=0,
                                           msg=f"{optimizer.__name__} rank {rank} {name}")


GLOO_CASES = [(strategy, mode) for strategy in ("ddp", "fsdp") for mode in ("per-op", "per-layer")]


def _train_cases(rank, model, x, y, cases):
    """_train for every (strategy, mode) of `cases` in one gloo launch: each process traces the model once."""
    return {(strategy, mode): _train(rank, model, x, y, strategy, (torch.optim.SGD, torch.optim.AdamW), None, 3,
                                     1e-2, mode) for strategy, mode in cases}


@pytest.fixture(scope="module")
def gloo_trained():
    model, x, y = seeded_gpt()
    return model, x, y, run_gloo(2, _train_cases, model, x, y, GLOO_CASES)


@pytest.mark.parametrize("strategy, mode", GLOO_CASES, ids=[f"{s}-{m}" for s, m in GLOO_CASES])
def test_training_matches_one_device_on_gloo(gloo_trained, strategy, mode):
    model, x, y, per_rank = gloo_trained
    _check_training([r[(strategy, mode)] for r in per_rank], model, x, y, mode=mode)


def test_per_op_training_compiled_matches_one_device():
    """Compiled, the partitioner runs the policy's tags (aot_eager: the partitioner without inductor's kernels)."""
    model, x, y = seeded_gpt()
    records = run_threaded(2, _train, model, x, y, "fsdp", (torch.optim.SGD, torch.optim.AdamW), "aot_eager",
                           timeout=300)
    _check_training(records, model, x, y, atol=2e-5)


def test_per_op_training_of_a_llama_matches_one_device():
    from autopar.testing.harness import check_keyword_training
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = tiny_llama(num_layers=2).model   # the Hugging Face model, called with input_ids= and labels=
    x = torch.randint(0, 64, (4, 16))
    batch = {"input_ids": x, "labels": x}
    check_keyword_training(model, batch, "fsdp", {"sgd": (torch.optim.SGD, 1e-2), "adamw": (torch.optim.AdamW, 1e-3)},
                           {"sgd": 1e-5, "adamw": 1e-5}, mesh_shape=(2,),
                           plan_kwargs={"checkpointing": "per-op", "hardware": "cpu"})


def test_every_second_block_is_checkpointed_per_layer():
    """torchtitan counts blocks from 1 and checkpoints those ac_freq divides: h.1 and h.3 of 4."""
    from autopar.capture.export import capture
    from autopar.cost.checkpointing import PER_LAYER, checkpointable_stacks
    model, x, _ = seeded_gpt(n_layer=4)
    cap = capture(model, (x,))
    (stack,) = [st for st in checkpointable_stacks(cap, "cpu") if st.kind == PER_LAYER]
    assert [{cap.info[n].module_path.split(".")[1] for n in block} for block in stack.blocks] == [{"1"}, {"3"}]
    text = str(autopar.plan(model, (x,), {"dp": 2}, hardware="cpu", checkpointing="per-layer"))
    assert "activation checkpointing (per-layer): every second block (the 2nd, 4th, ...) of h" in text


@pytest.mark.parametrize("mode", ["per-op", "per-layer"])
def test_requests_are_checked(mode):
    with pytest.raises(autopar.PlanError, match=f"checkpointing='{mode}' found no stack of repeated blocks"):
        autopar.plan(torch.nn.Linear(8, 8), (torch.randn(4, 8),), {"dp": 2}, checkpointing=mode)
    model, x, _ = seeded_gpt()
    plan = autopar.plan(model, (x,), {"dp": 2}, hardware="cpu", checkpointing=mode)
    assert autopar.Plan.from_json(plan.to_json()).checkpointed == {"h": mode}


def test_per_op_plan_text():
    model, x, _ = seeded_gpt()
    text = str(autopar.plan(model, (x,), {"dp": 2}, hardware="cpu", checkpointing="per-op"))
    assert "activation checkpointing (per-op): every block of h is recomputed in backward, but for its fused " \
           "attention and every second matmul" in text


def test_a_region_that_runs_other_kernels_than_priced_raises():
    """Caching by position in a region is only right where the region runs the kernels the plan priced."""
    from autopar.cost.checkpointing import SavePolicy
    from autopar.runtime.lowering.per_op import CheckpointPolicyError, per_op_eager
    w = torch.randn(4, 4, requires_grad=True)
    fn = lambda a: (a @ w) @ w   # noqa: E731 -- two matmuls, the plan priced one
    ctx = per_op_eager(SavePolicy((True,), (), ()), "h.0")
    with pytest.raises(CheckpointPolicyError, match="priced 1 matmuls"):
        torch.utils.checkpoint.checkpoint(fn, torch.randn(2, 4), use_reentrant=False, context_fn=ctx)


def test_auto_picks_per_op_where_it_is_the_fastest_that_fits():
    """Per-op keeps more than recomputing whole blocks and reruns less: under a limit that its fastest layout
    meets and that no faster kind meets, auto takes it over full."""
    model, x, _ = seeded_gpt(n_layer=4)
    free = {mode: autopar.plan(model, (x,), {"dp": 2}, hardware="cpu", checkpointing=mode).predicted
            for mode in ("none", "selective", "per-op", "per-layer")}
    faster = [p.memory.total for mode, p in free.items() if p.step_time < free["per-op"].step_time]
    assert faster and min(faster) > free["per-op"].memory.total   # they keep more (none, selective, per-layer)
    limit = int((free["per-op"].memory.total + min(faster)) / 2)
    plan = autopar.plan(model, (x,), {"dp": 2}, hardware="cpu", memory_limit=limit)
    assert plan.checkpointed == {"h": "per-op"} and plan.predicted.memory.total <= limit
    assert plan.predicted.step_time == pytest.approx(free["per-op"].step_time)
    full = autopar.plan(model, (x,), {"dp": 2}, hardware="cpu", memory_limit=limit, checkpointing="full")
    assert plan.predicted.step_time < full.predicted.step_time
