"""Repeated blocks share the search's variables, and that costs the plan nothing."""
from __future__ import annotations

import torch

import autopar
from autopar.api import _plan_captured
from autopar.blocks import find_blocks
from autopar.capture import capture
from autopar.testing import GPT, MLP, GPTConfig


def _gpt(n_layer=3):
    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=n_layer, n_head=2, n_embd=16, vocab_size=32, block_size=8)
    return GPT(cfg), torch.randint(0, 32, (4, 8))


def test_identical_layers_tie_to_the_first():
    model, x = _gpt(4)
    blocks = find_blocks(capture(model, (x,)))
    assert blocks.stacks == (("h", 4),)
    firsts = set(blocks.canonical.values())
    assert firsts and all(blocks.canonical[n] != n for n in blocks.canonical)
    # every tied node maps to a node of block 0, parameters by their name
    assert "p_h_3_fc_weight" in blocks.canonical and blocks.canonical["p_h_3_fc_weight"] == "p_h_0_fc_weight"


def test_a_layer_of_another_shape_is_not_tied():
    torch.manual_seed(0)
    model = MLP([8, 16, 16, 16, 8])        # layers.0 (8->16) and layers.6 (16->8) differ from the middle
    blocks = find_blocks(capture(model, (torch.randn(4, 8),)))
    tied_paths = {n for n in blocks.canonical}
    assert "p_layers_4_weight" in tied_paths and blocks.canonical["p_layers_4_weight"] == "p_layers_2_weight"
    assert "p_layers_6_weight" not in tied_paths


def test_tying_finds_as_cheap_a_plan():
    """Without tying, each layer could choose alone. Without a memory limit, and with one
    half again the least any plan needs, identical layers gain nothing from that; closer to the
    least (here 80 KB against 52 KB), layers that differ can fill the limit more tightly --
    measured 4.2% faster -- which is the price of a search whose size does not grow with depth."""
    model, x = _gpt(2)
    cap = capture(model, (x,))
    for limit, slack in ((None, 2e-3), (100_000, 2e-3), (80_000, 0.05)):   # none: 199 KB chosen
        tied = _plan_captured(cap, {"a": 2, "b": 2}, hardware="cpu", memory_limit=limit)
        untied = _plan_captured(cap, {"a": 2, "b": 2}, hardware="cpu", memory_limit=limit, tie_blocks=False)
        assert tied.stats["num_variables"] < untied.stats["num_variables"]
        assert tied.predicted.step_time <= untied.predicted.step_time * (1 + slack), limit
        assert limit is None or tied.predicted.memory.total <= limit


def test_auto_on_three_axes_tries_role_assignments_and_beats_the_classics():
    """On 3+ axes auto solves one ILP per role assignment (data / tp); each classic's roles are a
    restriction of one of them, so under the same cost model auto is never slower."""
    model, x = _gpt(2)
    x = torch.randint(0, 32, (8, 8))
    mesh = {"a": 2, "b": 2, "c": 2}
    auto = autopar.plan(model, (x,), mesh, hardware="cpu")
    assert auto.stats["searches"] > 1 and set(auto.stats["axis_roles"].split(",")) <= {
        f"{a}={r}" for a in mesh for r in ("data", "tp", "any")}
    for classic in ("ddp", "fsdp", "zero2", "fsdp+tp"):
        other = autopar.plan(model, (x,), mesh, hardware="cpu", strategy=classic)
        assert auto.stats["objective_seconds"] <= other.stats["objective_seconds"] * (1 + 2e-3), classic
