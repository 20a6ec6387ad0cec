"""End to end on real processes: 4 ranks joined by gloo, a small GPT, 3 AdamW steps.

One run_gloo call trains every strategy in turn (each plan takes about a second
per rank): ddp, fsdp, tp, fsdp+tp, auto (under a memory limit that forces
sharding, planned by every rank for itself) and cp.
The parent computes the single-device reference and compares each rank's
outputs (its shard), whole gradients, whole parameters after 3 steps and
losses; and the bytes the ranks actually sent with the plan's prediction.
"""
from __future__ import annotations

import copy
import math

import pytest
import torch

import autopar
import cost_models as cm
from autopar.testing import GPT, GPTConfig, gpt_loss, parallel_record, run_gloo, single_device_reference

pytestmark = pytest.mark.gloo

WORLD = 4
STEPS = 3
LR = 1e-4     # see test_equivalence.py: AdamW turns fp32 noise on ~eps-sized gradients into ~lr-sized steps
ATOL = 1e-5
CFG = dict(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16)
BATCH = 4
NAMES = {(4,): ("a",), (2, 2): ("a", "b")}


def _train_all(rank, model, x, y, cases):
    """Runs in each gloo process: one parallel training per case, on a fresh DeviceMesh each."""
    out = {}
    for label, shape, kwargs in cases:
        r = parallel_record(rank, model, shape, NAMES[shape], x, y, gpt_loss, STEPS, LR, kwargs)
        out[label] = r
    return out


def _build():
    torch.manual_seed(0)
    cfg = GPTConfig(dropout=0.0, **CFG)
    model = GPT(cfg)
    x = torch.randint(0, cfg.vocab_size, (BATCH, cfg.block_size))
    y = torch.randint(0, cfg.vocab_size, (BATCH, cfg.block_size))
    return model, x, y


def _auto_limit(model, x):
    mesh = {"a": 2, "b": 2}
    total = autopar.plan(model, (x,), mesh, strategy="auto", hardware="cpu").predicted.memory.total
    limit = 0.6 * total
    try:
        autopar.plan(model, (x,), mesh, strategy="auto", hardware="cpu", memory_limit=limit)
    except autopar.InfeasiblePlanError as e:
        limit = (e.min_memory_bytes + total) / 2
    return limit, total


@pytest.fixture(scope="module")
def gloo_runs():
    model, x, y = _build()
    limit, replicated = _auto_limit(model, x)
    cases = [
        ("ddp", (2, 2), {"strategy": "ddp"}),
        ("fsdp", (4,), {"strategy": "fsdp"}),
        ("tp", (2, 2), {"strategy": "tp"}),
        ("fsdp+tp", (2, 2), {"strategy": "fsdp+tp"}),
        ("auto", (2, 2), {"strategy": "auto", "memory_limit": limit}),
        ("cp", (4,), {"strategy": "cp"}),   # the sequence of 8 in chunks of 2, keys and values gathered
        # on free links (compute decides) and 2 heads (no Ulysses on 4): a ring, its causal rows balanced
        ("cp ring", (4,), {"strategy": "cp", "links": {"a": cm.Link(bandwidth=1e12, latency=1e-12)}}),
    ]
    per_rank = run_gloo(WORLD, _train_all, model, x, y, cases, timeout=300)
    ref = single_device_reference(lambda: copy.deepcopy(model), x, y, gpt_loss, STEPS, LR)
    return {"cases": {label: (shape, kw) for label, shape, kw in cases}, "ranks": per_rank, "ref": ref,
            "limit": limit, "replicated": replicated}


@pytest.mark.parametrize("label", ["ddp", "fsdp", "tp", "fsdp+tp", "auto", "cp", "cp ring"])
def test_gloo_training_matches_single_device(gloo_runs, label):
    shape, _ = gloo_runs["cases"][label]
    names = NAMES[shape]
    ref = gloo_runs["ref"]
    res = [r[label] for r in gloo_runs["ranks"]]
    assert len(res) == WORLD == math.prod(shape)
    plan = res[0]["plan"]
    if label == "cp ring":   # keys split with the rows: the ring, its sends asynchronous on gloo
        attention = [s for n, s in plan.node_strategies.items() if n.startswith("scaled_dot_product_attention")]
        assert attention and all(s.inputs[1] == ("S(2)",) for s in attention), attention
    for rank, r in enumerate(res):
        assert r["plan"].param_placements == plan.param_placements, f"{label}: rank {rank} planned differently"
        assert r["plan"].node_strategies == plan.node_strategies, f"{label}: rank {rank} planned differently"
        (expected,) = plan.local_targets(ref["outputs"], rank=rank)
        assert r["outputs"].shape == expected.shape, f"{label} rank {rank}: output shape"
        torch.testing.assert_close(r["outputs"], expected, atol=ATOL, rtol=0,
                                   msg=lambda m: f"{label} rank {rank} outputs: {m}")
        assert set(r["grads"]) == set(ref["grads"]) and set(r["params"]) == set(ref["params"])
        for name, g in ref["grads"].items():
            torch.testing.assert_close(r["grads"][name], g, atol=ATOL, rtol=0,
                                       msg=lambda m: f"{label} rank {rank} grad of {name}: {m}")
        for name, p in ref["params"].items():
            torch.testing.assert_close(r["params"][name], p, atol=ATOL, rtol=0,
                                       msg=lambda m: f"{label} rank {rank} {name} after {STEPS} steps: {m}")
        if not plan.batch_axes:
            assert r["losses"] == pytest.approx(ref["losses"], abs=ATOL, rel=0), f"{label} rank {rank} losses"
    for step in range(STEPS):
        mean = sum(r["losses"][step] for r in res) / len(res)
        assert mean == pytest.approx(ref["losses"][step], abs=ATOL, rel=0), f"{label}: mean loss of step {step + 1}"

    # what went over the wire is what the plan predicted
    for rank, r in enumerate(res):
        moved = {a: 0.0 for a in names}
        for kind, axis, full_bytes, _ in r["comm"]:
            moved[names[axis]] += cm.bytes_moved(kind, full_bytes, shape[axis])
        for a in names:
            assert plan.predicted.comm_bytes.get(a, 0.0) == pytest.approx(moved[a], rel=1e-9, abs=1e-9), (
                f"{label} rank {rank} axis {a}: predicted {plan.predicted.comm_bytes.get(a)} bytes, sent {moved[a]}")


def test_gloo_auto_shards_under_the_memory_limit(gloo_runs):
    plan = gloo_runs["ranks"][0]["auto"]["plan"]
    assert plan.strategy == "auto"
    assert plan.predicted.memory.total <= gloo_runs["limit"] * (1 + 1e-9), (
        f"auto plan needs {plan.predicted.memory.total} bytes, limit {gloo_runs['limit']}")
    sharded = bool(plan.batch_axes) or any(p != "R" for pl in plan.param_placements.values() for p in pl)
    assert sharded, f"auto under {gloo_runs['limit']} bytes (replicated: {gloo_runs['replicated']}) shards nothing"
