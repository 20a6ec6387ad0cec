"""FSDP under a pipeline, both ways (runtime/pipeline/held_weights.py): with reshard_after_forward False each
stage's FSDP weights are gathered once per step and held whole across the microbatches, their gradients summed
whole and reduce-scattered once after the last microbatch (torchtitan's way); with True each microbatch gathers
(and, in backward, gathers again and reduce-scatters) its own.

On 4 gloo ranks as pp2 x dp2 with FSDP on dp, under 1F1B, GPipe, interleaved 1F1B and zero bubble: parameters
and gradients equal to one device's, SGD beside AdamW (tolerances as test_pipeline.py's); and the collectives
the runtime logged in one step: held, one all-gather per FSDP weight of the device and the reduce-scatters of
one microbatch, for any number of microbatches; resharded, those per microbatch, as before.
"""
import gc
import weakref
from collections import Counter
from dataclasses import replace

import pytest
import torch

import autopar
from autopar import Plan
from autopar.runtime.pipeline import held_weights
from autopar.sharding.placement import is_shard
from autopar.testing import GPT, GPTConfig, gpt_loss, run_gloo

ATOL = 1e-5
STEPS = 3
OPTIMIZERS = {"AdamW": (torch.optim.AdamW, 1e-4), "SGD": (torch.optim.SGD, 0.1)}
MESH = ((2, 2), ("pp", "dp"))
# case -> (plan options, reshard_after_forward); every case shares one launch of 4 processes
CASES = {
    "1f1b, 2 microbatches, held": (dict(schedule="1f1b", microbatches=2), False),
    "1f1b, 4 microbatches, held": (dict(schedule="1f1b", microbatches=4), False),
    "gpipe, 2 microbatches, held": (dict(schedule="gpipe", microbatches=2), False),
    "interleaved 1f1b, 4 microbatches, held": (dict(schedule="interleaved-1f1b", microbatches=4), False),
    "zero bubble, 4 microbatches, held": (dict(schedule="zero-bubble", microbatches=4), False),
    "1f1b, 2 microbatches, resharded": (dict(schedule="1f1b", microbatches=2), True),
    "1f1b, 4 microbatches, resharded": (dict(schedule="1f1b", microbatches=4), True),
}


def _gpt():
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=4))


def _batch():
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 64, (8, 16), generator=g), torch.randint(0, 64, (8, 16), generator=g)


def _step(model, x, y):
    if isinstance(model, autopar.ParallelModule):
        return model.train_step(x, loss_fn=gpt_loss, targets=y)
    loss = gpt_loss(model(x), y)
    loss.backward()
    return loss


def _fit(model, x, y) -> dict:
    """Per optimizer, from the same start: the first step's gradients and the parameters after STEPS."""
    full = {"full": True} if isinstance(model, autopar.ParallelModule) else {}
    start = {k: v.detach().clone() for k, v in model.state_dict(**full).items()}
    out = {}
    for name, (cls, lr) in OPTIMIZERS.items():
        model.load_state_dict(start)
        opt = cls(model.parameters(), lr=lr)
        rec = {"losses": []}
        for step in range(STEPS):
            opt.zero_grad(set_to_none=True)
            rec["losses"].append(float(_step(model, x, y).detach()))
            if step == 0:
                rec["grads"] = (model.full_grads() if full else
                                {n: p.grad.detach().clone() for n, p in model.named_parameters()})
            opt.step()
        rec["params"] = {k: v.detach().clone() for k, v in model.state_dict(**full).items()}
        out[name] = rec
    return out


def _one_step(pm, x, y) -> tuple:
    """One train_step: ({(kind, phase): launches on dp} from the module's log, the number of whole weights it
    held, how many of those are still alive once it returned). The GC is off through it, so a whole weight
    kept by a reference cycle counts as alive."""
    refs, gather = [], held_weights._gather

    def recording(module, read):
        held = gather(module, read)
        refs.append(weakref.ref(held.leaf))
        return held
    held_weights._gather = recording
    pm.comm.log.records.clear()
    gc.disable()
    try:
        pm.train_step(x, loss_fn=gpt_loss, targets=y)
    finally:
        gc.enable()
        held_weights._gather = gather
    dp = pm.plan.mesh.axis_names.index("dp")
    counts = dict(Counter((kind, phase) for kind, axis, _, phase in pm.comm.log.records if axis == dp))
    return counts, len(refs), sum(1 for r in refs if r() is not None)


def _fsdp_weights(pm) -> int:
    """This device's weights the plan stores split over dp (the pipelined module holds only its stages')."""
    dp = pm.plan.mesh.axis_names.index("dp")
    return sum(1 for name, _ in pm.named_parameters() if is_shard(pm.plan.param_placements[name][dp]))


def _train(mesh, options: dict, reshard: bool, x, y) -> dict:
    plan = autopar.plan(_gpt(), (x,), mesh, hardware="cpu", strategy="fsdp", pipeline_axis="pp", **options)
    plan = replace(plan, reshard_after_forward=reshard)
    pm = autopar.parallelize(_gpt(), mesh, (x,), plan=plan, record_comm=True)
    (lx,), (ly,) = pm.plan.local_inputs(x), pm.plan.local_targets(y)
    out = _fit(pm, lx, ly)
    out["plan"] = pm.plan.to_json()
    out["collectives"], out["held"], out["alive"] = _one_step(pm, lx, ly)
    out["fsdp_weights"] = _fsdp_weights(pm)
    return out


def _all_cases(rank, x, y):
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", *MESH[:1], mesh_dim_names=MESH[1])
    return {case: _train(mesh, options, reshard, x, y) for case, (options, reshard) in CASES.items()}


@pytest.fixture(scope="module")
def four_ranks():
    """{case: [rank 0's results, ..., rank 3's]}."""
    by_rank = run_gloo(4, _all_cases, *_batch(), timeout=900)
    return {case: [r[case] for r in by_rank] for case in CASES}


@pytest.fixture(scope="module")
def reference():
    return _fit(_gpt(), *_batch())


@pytest.mark.parametrize("case", list(CASES))
def test_fsdp_under_a_pipeline_trains_as_one_device(case, four_ranks, reference):
    options, reshard = CASES[case]
    plan = Plan.from_json(four_ranks[case][0]["plan"])
    assert plan.pipeline.schedule == options["schedule"] and plan.pipeline.microbatches == options["microbatches"]
    assert plan.reshard_after_forward is reshard
    for opt in OPTIMIZERS:
        for r in four_ranks[case]:
            got, want = r[opt], reference[opt]
            for name, p in got["params"].items():
                torch.testing.assert_close(p, want["params"][name], atol=ATOL, rtol=0,
                                           msg=lambda m: f"{case} {opt}, {name}: {m}")
            for name, g in got["grads"].items():
                torch.testing.assert_close(g, want["grads"][name], atol=ATOL, rtol=0,
                                           msg=lambda m: f"{case} {opt}, grad {name}: {m}")
        for step in range(STEPS):   # each dp rank's loss is its shard's mean: the two average to one device's
            mean = sum(r[opt]["losses"][step] for r in four_ranks[case]) / len(four_ranks[case])
            assert mean == pytest.approx(reference[opt]["losses"][step], abs=ATOL), (case, opt)


def _dp(four_ranks, case, rank):
    return four_ranks[case][rank]["collectives"], four_ranks[case][rank]["fsdp_weights"]


@pytest.mark.parametrize("rank", range(4))
def test_held_weights_are_gathered_and_reduced_once_per_step(four_ranks, rank):
    """Held: one forward all-gather per FSDP weight per step, none in backward, and the reduce-scatters
    of one microbatch of the resharded run; resharded: all of those per microbatch. The whole weights a
    step held are freed when it returns."""
    resharded = {m: _dp(four_ranks, f"1f1b, {m} microbatches, resharded", rank)[0] for m in (2, 4)}
    per_microbatch = resharded[2][("reduce_scatter", "backward")] / 2
    assert per_microbatch > 0
    for case, (options, reshard) in CASES.items():
        got, fsdp = _dp(four_ranks, case, rank)
        m = options["microbatches"]
        assert fsdp > 0, case
        held, alive = four_ranks[case][rank]["held"], four_ranks[case][rank]["alive"]
        assert alive == 0, (case, held, alive)
        if reshard:
            assert held == 0, case
            assert got.get(("all_gather", "forward"), 0) == m * fsdp, (case, got)
            assert got.get(("all_gather", "backward"), 0) > 0, (case, got)   # gathered again for backward
            assert got.get(("reduce_scatter", "backward"), 0) == m * per_microbatch, (case, got)
        else:
            assert held == fsdp, case
            assert got.get(("all_gather", "forward"), 0) == fsdp, (case, got)
            assert got.get(("all_gather", "backward"), 0) == 0, (case, got)
            assert got.get(("reduce_scatter", "backward"), 0) == per_microbatch, (case, got)
