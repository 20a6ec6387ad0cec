"""Per-op selective activation checkpointing (checkpointing="per-op"), as torchtitan runs it.

Each block of a stack is one checkpointed region whose fused attention kernels and every second matmul
(the 1st, 3rd, ... aten.mm/addmm of the block) are cached in forward; every other op is recomputed in
backward. Checked: which ops the plan caches (q, v, gate, down in a Llama block), the bytes the run
keeps against the prediction (autopar.audit: autograd's saved tensors, what each checkpoint holds and what
its policy caches), training against one device (SGD and AdamW, ddp and fsdp, gloo ranks, and compiled),
and the requests that cannot be met.
"""
from __future__ import annotations

import copy
import warnings

import pytest
import torch

import autopar
from autopar.testing import (GPT, GPTConfig, gpt_loss, parallel_record, run_gloo, run_threaded,
                             single_device_reference, tiny_llama)

REL = 0.03   # activations, as in test_recompute


def _gpt(n_layer=3):
    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=n_layer, n_head=2, n_embd=16, vocab_size=32, block_size=8, dropout=0.0)
    return GPT(cfg).train(), torch.randint(0, 32, (4, 8)), torch.randint(0, 32, (4, 8))


def _llama():
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    return tiny_llama(num_layers=3), torch.randint(0, 64, (4, 16)), None


def _audit(rank, model, x, mesh_shape, names, plan_kwargs):
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", autopar.UnsupportedOpWarning)
        pm = autopar.parallelize(copy.deepcopy(model), mesh, (x,), hardware="cpu", **plan_kwargs)
    opt = autopar.ShardedOptimizer(pm, torch.optim.AdamW, lr=1e-3)
    report = autopar.audit(pm, *pm.plan.local_inputs(x), optimizer=opt)
    return {r.quantity: (r.predicted, r.measured) for r in report.rows}, pm.plan


def test_a_llama_block_caches_q_v_gate_and_down():
    """torchtitan's policy on a Llama block: of q, k, v, o, gate, up, down, the 1st, 3rd, 5th and 7th."""
    from autopar.capture.export import capture
    from autopar.cost.checkpointing import PER_OP, checkpointable_stacks
    model, x, _ = _llama()
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
@pytest.mark.parametrize("make", [_gpt, _llama], ids=["gpt", "llama"])
def test_per_op_plans_predict_what_the_run_keeps(make, strategy):
    model, x, _ = make()
    kept = {}
    for mode in ("none", "per-op", "full"):
        for rank, (rows, plan) in enumerate(run_threaded(2, _audit, model, x, (2,), ("dp",),
                                                         {"strategy": strategy, "checkpointing": mode})):
            predicted, measured = rows["activations saved for backward"]
            assert measured == pytest.approx(predicted, rel=REL), \
                f"{strategy} checkpointing={mode} rank {rank}: predicted {predicted:.0f} B, kept {measured:.0f} B"
            assert rows["comm bytes on dp"][0] == rows["comm bytes on dp"][1]
            kept[mode] = measured
    # it keeps some of what checkpointing a whole block drops
    assert kept["full"] < kept["per-op"] < kept["none"]
