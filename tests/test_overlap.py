"""The overlap model (cost/overlap.py): gradient buckets hide behind the rest of backward, FSDP's prefetched
gathers behind the layer before, other collectives do not. Pure planning: no ranks."""
from __future__ import annotations

import pytest
import sympy
import torch

import autopar
import cost_models as cm
from autopar.testing import GPT, MLP, GPTConfig


def _gpt_plan(bucket_bytes):
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=4, n_embd=64, vocab_size=512, block_size=32))
    x = torch.randint(0, 512, (8, 32))
    return autopar.plan(model, (x,), {"dp": 2}, strategy="ddp", hardware="cpu", bucket_bytes=bucket_bytes)


def test_buckets_hide_behind_the_backward_still_to_run():
    """Small buckets of a 4-layer GPT: the last layers' buckets go out while backward runs through the
    first ones, so less is exposed than is sent, and the step is compute + the exposed part."""
    p = _gpt_plan(2**14).predicted
    assert p.exposed_comm_time["dp"] < 0.5 * p.comm_time["dp"]
    assert p.hidden_comm_time["dp"] == pytest.approx(p.comm_time["dp"] - p.exposed_comm_time["dp"])
    assert p.step_time == pytest.approx(p.compute_time + p.optimizer_time + p.exposed_comm_time["dp"])


def test_nothing_hides_where_communication_takes_the_compute_cores():
    """The same plan on hardware whose collectives run on the cores that compute (CPU ranks using every
    core: calibrate.comm_can_overlap): every byte is exposed, and the step grows by what hid before."""
    import dataclasses
    hides = _gpt_plan(2**14).predicted
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=4, n_embd=64, vocab_size=512, block_size=32))
    busy = dataclasses.replace(cm.get_hardware("cpu"), comm_overlaps_compute=False)
    p = autopar.plan(model, (torch.randint(0, 512, (8, 32)),), {"dp": 2}, strategy="ddp", hardware=busy,
                     bucket_bytes=2**14).predicted
    assert hides.hidden_comm_time["dp"] > 0 and p.hidden_comm_time["dp"] == 0
    assert p.exposed_comm_time["dp"] == pytest.approx(p.comm_time["dp"]) == pytest.approx(hides.comm_time["dp"])
    assert p.step_time == pytest.approx(hides.step_time + hides.hidden_comm_time["dp"])


def test_nothing_hides_without_backward_left_to_run():
    """One linear layer: its gradients are made by the last op of backward, so its bucket waits for the end
    of backward and the whole all-reduce is exposed. One bucket for a GPT: nearly the same (the embedding's
    gradient is in it, made last but for the backward of the position ids' arange and the like)."""
    model = torch.nn.Sequential(torch.nn.Linear(256, 256))
    p = autopar.plan(model, (torch.randn(64, 256),), {"dp": 2}, strategy="ddp", hardware="cpu").predicted
    assert p.comm_time["dp"] > 0
    assert p.exposed_comm_time["dp"] == pytest.approx(p.comm_time["dp"], rel=1e-9)
    p = _gpt_plan(25 * 2**20).predicted
    assert p.exposed_comm_time["dp"] == pytest.approx(p.comm_time["dp"], rel=1e-3)


def test_blocking_collectives_stay_exposed():
    """tp's all-reduces feed the next op: none of them hides."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_embd=64, vocab_size=512, block_size=32))
    x = torch.randint(0, 512, (8, 32))
    p = autopar.plan(model, (x,), {"tp": 2}, strategy="tp", hardware="cpu").predicted
    assert p.comm_time["tp"] > 0
    assert p.exposed_comm_time["tp"] == pytest.approx(p.comm_time["tp"])


def test_exposed_time_is_symbolic_and_survives_json():
    plan = _gpt_plan(2**14)
    sym = plan.symbolic.exposed_comm_time["dp"]
    hints = {sympy.Symbol(k, integer=True, positive=True): v for k, v in plan.symbols.items()}
    assert float(sympy.sympify(sym).subs(hints)) == pytest.approx(plan.predicted.exposed_comm_time["dp"], rel=1e-6)
    back = autopar.Plan.from_json(plan.to_json())
    assert back.predicted.exposed_comm_time == pytest.approx(plan.predicted.exposed_comm_time)
    assert "hidden behind compute" in str(plan)


def test_fsdp_gathers_hide_behind_the_layer_before_but_the_first_is_waited_on():
    """FSDP on 4 layers: each layer's reduce-scatter goes out when backward has made its gradients and
    hides behind the layers before it; each layer's gather is launched at the previous layer's first use
    (the module's prefetch) and hides behind that layer's compute, but the first gather of forward (the
    root's: embeddings and head) is waited on whole, as is backward's first re-gather of a block (the root,
    re-gathered first, has no layer before it to prefetch for it)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=4, n_embd=64, vocab_size=512, block_size=32))
    x = torch.randint(0, 512, (8, 32))
    plan = autopar.plan(model, (x,), {"dp": 2}, strategy="fsdp", hardware="cpu")
    p = plan.predicted
    layer_scatters = [c for c in plan.collectives if c.kind == "reduce_scatter" and c.where.startswith("layer h.")]
    assert len(layer_scatters) == 4   # one per block

    def seconds(c):
        return cm.collective_time(c.kind, c.bytes, 2, cm.get_hardware("cpu").intra_node_link)

    gathers = {(c.where, c.phase): c for c in plan.collectives if c.kind == "all_gather"}
    waited = seconds(gathers["layer root", "forward"]) + seconds(gathers["layer h.3", "backward"])
    assert waited <= p.exposed_comm_time["dp"] < sum(map(seconds, gathers.values())) < p.comm_time["dp"]


def test_a_gather_hides_behind_the_compute_launched_before_it():
    """The timeline by hand: three layers, 1 s of forward compute each, 2 s gathers on one link. The first
    is waited on (2 s) and launches the second, which arrives at 4 s, 1 s after the first layer's compute
    ends (1 s waited); the third arrives at 6 s, the second layer's compute having ended at 5 s (1 s)."""
    from autopar.cost.overlap import _Move, _Timeline
    step = _Timeline()
    step.forward([1.0] * 3, [_Move(0, 2.0, k, k) for k in range(3)])
    assert step.waited == {0: 4.0} and step.clock == 7.0
    step = _Timeline()   # compute longer than the gathers: only the first is waited on
    step.forward([3.0] * 3, [_Move(0, 2.0, k, k) for k in range(3)])
    assert step.waited == {0: 2.0}
    # backward, 3 s an op: a root layer (read by ops 0 and 3) and blocks at ops 1 and 2. The root, needed
    # first, has no layer before it (2 s waited); the block at op 2 is waited on whole (2 s) and launches
    # the one at op 1's, which arrives (at 9 s) while op 2 computes; the root is not gathered again
    step = _Timeline()
    step.backward([3.0] * 4, [_Move(0, 2.0, 0, 3), _Move(0, 2.0, 1, 1), _Move(0, 2.0, 2, 2)], [])
    assert step.waited == {0: 4.0} and step.link == {0: 9.0} and step.clock == 16.0


@pytest.mark.parametrize("optimizer, passes", [("adamw", 21), ("sgd", 3), ("sgd-momentum", 8)])
def test_the_optimizer_step_is_priced_by_the_bytes_it_moves(optimizer, passes):
    """The step adds the optimizer's update: `passes` parameter-sized reads and writes (torch's foreach
    kernels) of the elements this rank updates, at the memory bandwidth: all of them under ddp, half
    under fsdp on 2 ranks."""
    torch.manual_seed(0)
    model, x = MLP([16, 32, 16]), torch.randn(8, 16)
    numel = sum(p.numel() for p in model.parameters())
    bandwidth = cm.get_hardware("cpu").memory_bandwidth
    for strategy, share in (("ddp", 1), ("fsdp", 2)):
        p = autopar.plan(model, (x,), {"dp": 2}, hardware="cpu", strategy=strategy, optimizer=optimizer).predicted
        assert p.optimizer_time == pytest.approx(numel / share * passes * 4 / bandwidth, rel=1e-12)
        assert p.step_time == pytest.approx(p.compute_time + p.optimizer_time + sum(p.exposed_comm_time.values()))


def test_a_prefetched_gather_goes_out_ahead_of_the_reduce_scatter_of_the_layer_that_launched_it():
    """The timeline by hand, backward: two blocks at ops 0 and 1, 3 s of backward each; gathers 1 s,
    reduce-scatters 2 s. Block 1's gather is waited on whole (1 s) and launches block 0's, which arrives at
    2 s, before block 1's reduce-scatter goes out (at 4 s, until 6 s); block 0's reduce-scatter goes out at
    7 s and the optimizer waits for it (2 s). Launched only when block 0 needs it (as the runtime once did
    a recompute's gather), block 0's gather would have waited behind that reduce-scatter: 3 s more."""
    from autopar.cost.overlap import _Move, _Timeline
    step = _Timeline()
    gathers, scatters = [_Move(0, 1.0, k, k) for k in range(2)], [_Move(0, 2.0, k, k, "fsdp") for k in range(2)]
    step.backward([3.0, 3.0], gathers, scatters)
    assert step.waited == {0: 3.0} and step.clock == 9.0


def test_backward_prefetches_the_nearest_layer_before_not_yet_launched():
    """A block whose weights form two groups (a big one, and a norm weight whose gradient is summed over tp
    apart, read inside the big one's span): two blocks at ops 0-3 and 4-7, big groups 2 s, norms 0.1 s,
    1 s of backward an op. Backward needs block 1's big group first (waited on whole, 2 s), which launches
    block 0's norm; block 1's norm, needed next (0.1 s waited), finds the group before it in hand and the one
    before that launched, and launches block 0's big group, which arrives before backward reaches block 0.
    (Launching only the group just before would leave block 0's big group to be waited on whole: 2 s more.)"""
    from autopar.cost.overlap import _Move, _Timeline
    step = _Timeline()
    step.backward([1.0] * 8, [_Move(0, 2.0, 0, 3), _Move(0, 0.1, 2, 2), _Move(0, 2.0, 4, 7), _Move(0, 0.1, 6, 6)], [])
    assert step.waited[0] == pytest.approx(2.1) and step.clock == pytest.approx(10.1)


@pytest.mark.parametrize("checkpointing", ["full", "per-op"])
def test_fsdp_recompute_gathers_are_prefetched_like_backward_re_gathers(checkpointing):
    """FSDP with every block checkpointed: a block keeps none of its gathered weights; its rerun gathers them
    again (phase "recompute"), and that gather serves its backward. The module prefetches it as it does a
    re-gather (runtime/reduction/layer_groups.LayerGroup.gathered: the block after launches it, ahead of its
    own reduce-scatter), so the same bytes move at the same points of backward and exactly as much is
    exposed as without checkpointing. (Priced as exposed outright, the recompute's gathers once made
    0.373 ms exposed of 0.661; then, waited on behind the reduce-scatters, 0.444; now 0.253, as unchecked.)"""
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=4, n_embd=64, vocab_size=512, block_size=32))
    x = torch.randint(0, 512, (8, 32))
    plain = autopar.plan(model, (x,), {"dp": 2}, strategy="fsdp", hardware="cpu", checkpointing="none")
    plan = autopar.plan(model, (x,), {"dp": 2}, strategy="fsdp", hardware="cpu", checkpointing=checkpointing)
    p = plan.predicted
    assert plan.checkpointed == {"h": checkpointing}

    def seconds(c):
        return cm.collective_time(c.kind, c.bytes, 2, cm.get_hardware("cpu").intra_node_link)

    recompute = [c for c in plan.collectives if c.phase == "recompute"]
    assert sorted(c.where for c in recompute) == [f"layer h.{k}" for k in range(4)]
    assert all(c.kind == "all_gather" for c in recompute)
    assert not [c for c in plan.collectives if c.phase == "backward" and c.where.startswith("layer h.")
                and c.kind == "all_gather"]   # nothing re-gathered for backward: the rerun's gather serves it
    assert p.comm_time["dp"] == pytest.approx(plain.predicted.comm_time["dp"])
    assert p.exposed_comm_time["dp"] == pytest.approx(plain.predicted.exposed_comm_time["dp"], rel=1e-9)
    outright = [c for c in plan.collectives if not c.where.startswith("layer ")]
    root = [c for c in plan.collectives if c.where == "layer root" and c.kind == "all_gather"]
    assert p.exposed_comm_time["dp"] < sum(map(seconds, outright + root + recompute))
    assert p.step_time == pytest.approx(p.compute_time + p.optimizer_time + p.exposed_comm_time["dp"])
