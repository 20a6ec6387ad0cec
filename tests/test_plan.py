"""The Plan: text, JSON, symbolic predictions, and reuse of an offline plan on every rank."""
import copy

import pytest
import sympy
import torch

import autopar
import cost_models as cm
from autopar.testing import GPT, MLP, GPTConfig, run_threaded

BATCH = torch.export.Dim("batch")


def _mlp_plan(strategy="ddp", mesh=None):
    torch.manual_seed(0)
    return autopar.plan(MLP([8, 16, 8]), (torch.randn(4, 8),), mesh or {"dp": 2}, strategy=strategy,
                        dynamic_shapes={"x": {0: BATCH}})


def test_symbolic_terms_match_hand_derivation_for_ddp_mlp():
    plan = _mlp_plan("ddp")
    b = sympy.Symbol("batch", integer=True, positive=True)
    params = (8 * 16 + 16 + 16 * 8 + 8) * 4          # fp32 bytes
    assert plan.symbolic.memory.params == params
    assert plan.symbolic.memory.grads == params
    assert plan.symbolic.memory.optimizer == 2 * params   # AdamW's two moments
    # saved for backward, fp32 on each of the 2 ranks: the first linear keeps its input x
    # [batch / 2, 8] (for its weight's gradient), gelu its input and the second linear gelu's
    # output, both [batch / 2, 16]
    assert sympy.simplify(plan.symbolic.memory.activations - (b / 2) * (8 + 2 * 16) * 4) == 0
    # DDP all-reduces every gradient once: a ring all-reduce on 2 ranks sends 2(n-1)/n = 1x the bytes
    assert plan.symbolic.comm_bytes["dp"] == params
    assert plan.predicted.comm_bytes["dp"] == params
    # the numbers are the symbolic terms at the example batch (4)
    assert float(plan.symbolic.memory.total.subs(b, 4)) == plan.predicted.memory.total
    assert plan.symbols == {"batch": 4}


def test_symbolic_comm_of_tensor_parallel_grows_with_batch():
    torch.manual_seed(0)
    plan = autopar.plan(GPT(GPTConfig()), (torch.randint(0, 64, (4, 16)),), {"tp": 2}, strategy="tp",
                        dynamic_shapes={"idx": {0: BATCH}})
    b = sympy.Symbol("batch", integer=True, positive=True)
    expr = plan.symbolic.comm_bytes["tp"]
    assert expr.free_symbols == {b}
    assert float(expr.subs(b, 8)) == 2 * float(expr.subs(b, 4))  # activations only: linear in batch
    assert float(expr.subs(b, 4)) == plan.predicted.comm_bytes["tp"]


def test_json_round_trip_keeps_everything():
    torch.manual_seed(0)
    plan = autopar.plan(GPT(GPTConfig()), (torch.randint(0, 64, (4, 16)),), {"dp": 2, "tp": 2},
                        strategy="fsdp+tp", dynamic_shapes={"idx": {0: BATCH}})
    back = autopar.Plan.from_json(plan.to_json())
    assert back.node_strategies == plan.node_strategies
    assert back.param_placements == plan.param_placements
    assert back.predicted == plan.predicted
    assert back.symbolic.memory.total == plan.symbolic.memory.total
    assert back.collectives == plan.collectives
    assert str(back) == str(plan)


def test_text_table_shows_layout_collectives_and_predictions():
    text = str(_mlp_plan("fsdp"))
    assert "strategy=fsdp" in text and "batch split over: dp" in text
    assert "layers.0" in text and "weight S(" in text
    assert "all_gather@dp" in text and "reduce_scatter@dp" in text
    assert "predicted per device: params" in text and "communication per step: dp" in text


def test_text_table_rows_follow_forward_order():
    """Modules without parameters (dropout, the attention wrapper) sit where forward runs them."""
    plan = autopar.plan(GPT(GPTConfig(n_layer=1, dropout=0.1)), (torch.randint(0, 64, (4, 16)),), {"tp": 2},
                        hardware="cpu", strategy="tp")
    rows = [line.split()[0] for line in str(plan).splitlines()[3:] if line.strip()]
    assert rows.index("wte") < rows.index("drop") < rows.index("h.0.ln_1") < rows.index("h.0.attn.resid_dropout") \
        < rows.index("h.0.ln_2") < rows.index("h.0.dropout") < rows.index("ln_f") < rows.index("lm_head")


def test_local_inputs_and_targets_cut_the_batch_over_batch_axes():
    plan = _mlp_plan("ddp", {"dp": 2, "tp": 2})
    assert set(plan.batch_axes) == {"dp", "tp"}
    x = torch.arange(8.0).reshape(8, 1).expand(8, 8)
    shards = [plan.local_inputs(x, rank=r)[0] for r in range(4)]
    assert torch.equal(torch.cat(shards), x)           # row-major over (dp, tp)
    assert torch.equal(plan.local_targets(x, rank=3)[0], x[6:])


@pytest.mark.parametrize("mesh", [{"dp": 2, "tp": 2}, {"a": 2, "b": 2, "c": 2}], ids=["2x2", "2x2x2"])
def test_data_shard_is_the_share_local_inputs_cuts(mesh):
    """For every named strategy that applies: rank r's local batch is x.chunk(count)[index], and ranks
    that split the weights rather than the batch (tensor parallelism) read the same share."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2))
    x = torch.arange(16 * 16).reshape(16, 16) % 64
    planned = 0
    for strategy in ("ddp", "zero1", "zero2", "fsdp", "tp", "tp+sp", "fsdp+tp"):
        try:
            plan = autopar.plan(model, (x,), mesh, hardware="cpu", strategy=strategy)
        except autopar.AutoparError:
            continue   # a strategy that cannot use this mesh (it says why elsewhere)
        planned += 1
        world = 1
        for n in mesh.values():
            world *= n
        shares = [plan.data_shard(rank=r) for r in range(world)]
        count = shares[0][1]
        assert all(c == count for _, c in shares) and {i for i, _ in shares} == set(range(count)), (strategy, shares)
        assert count == world // (2 ** sum(a not in plan.batch_axes for a in mesh)), strategy
        for r, (index, _) in enumerate(shares):
            assert torch.equal(plan.local_inputs(x, rank=r)[0], x.chunk(count)[index]), (strategy, r)
    assert planned >= 4


def _train_with_given_plan(rank, model, plan_json, x):
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    plan = autopar.Plan.from_json(plan_json)
    pm = autopar.parallelize(copy.deepcopy(model), mesh, (x,), plan=plan)
    out = pm(*pm.plan.local_inputs(x))
    out.square().mean().backward()
    return pm.plan.param_placements, out.detach(), pm.full_grads()


def test_offline_plan_is_applied_by_parallelize():
    torch.manual_seed(0)
    model, x = MLP([8, 16, 8]), torch.randn(4, 8)
    plan = autopar.plan(model, (x,), {"dp": 2}, strategy="fsdp")
    results = run_threaded(2, _train_with_given_plan, model, plan.to_json(), x)
    ref = copy.deepcopy(model)
    out = ref(x)
    out.square().mean().backward()
    for rank, (placements, local_out, grads) in enumerate(results):
        assert placements == plan.param_placements
        torch.testing.assert_close(local_out, out.detach()[rank * 2:(rank + 1) * 2], atol=1e-6, rtol=0)
        for name, p in ref.named_parameters():
            torch.testing.assert_close(grads[name], p.grad, atol=1e-6, rtol=0)


def test_hardware_and_links_change_predicted_time_not_bytes():
    torch.manual_seed(0)
    model, x = MLP([64, 256, 64]), torch.randn(8, 64)
    fast = autopar.plan(model, (x,), {"dp": 2}, strategy="ddp", hardware="h100")
    slow = autopar.plan(model, (x,), {"dp": 2}, strategy="ddp", hardware="h100",
                        links={"dp": cm.Link(bandwidth=1e9, latency=1e-3)})
    assert fast.predicted.comm_bytes == slow.predicted.comm_bytes
    assert slow.predicted.comm_time["dp"] > 10 * fast.predicted.comm_time["dp"]


def test_collective_records_name_the_tensor_they_move():
    torch.manual_seed(0)
    model, idx = GPT(GPTConfig()), torch.randint(0, 64, (4, 16))
    tp = autopar.plan(model, (idx,), {"tp": 2}, strategy="tp")
    params = {n for n in tp.node_strategies if n.startswith("p_")}
    # Megatron TP never gathers a weight: everything it moves is an activation (or its gradient)
    assert tp.collectives and not [c for c in tp.collectives if c.tensor in params and c.kind == "all_gather"]
    fsdp = autopar.plan(model, (idx,), {"dp": 2}, strategy="fsdp")
    # an FSDP layer's gather names every weight it moves, comma-separated (cost/layer_groups.py)
    gathered = {n for c in fsdp.collectives if c.kind == "all_gather" and c.phase == "forward"
                for n in c.tensor.split(",")}
    assert "p_lm_head_weight" in gathered and gathered <= params | {n for n in fsdp.node_strategies}


def test_stats_time_every_stage():
    torch.manual_seed(0)
    plan = autopar.plan(MLP([8, 16, 8]), (torch.randn(4, 8),), {"dp": 2}, hardware="cpu")
    for stage in ("capture_seconds", "rules_seconds", "build_seconds", "solve_seconds", "predict_seconds"):
        assert isinstance(plan.stats[stage], float) and plan.stats[stage] >= 0, stage
    assert plan.stats["searches"] == 1 and plan.stats["axis_roles"] == "dp=any"
