"""Vocab-parallel embedding: each rank holds a slice of the table and looks up only its own rows."""
import copy
import json

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import autopar
from autopar.capture.export import capture
from autopar.runtime.rewrite import local_target, vocab_parallel_embedding
from autopar.sharding.strategies import Strategy
from autopar.testing import GPT, GPTConfig, gpt_loss, parallel_record, run_threaded, single_device_reference


def _force_vocab_split(plan: autopar.Plan) -> autopar.Plan:
    """The same plan, but with the token embedding's table split along the vocab on the tp axis."""
    d = json.loads(plan.to_json())
    d["node_strategies"]["p_wte_weight"]["output"] = ["S(0)"]
    d["param_placements"]["wte.weight"] = ["S(0)"]
    d["node_strategies"]["embedding"] = {"inputs": [["S(0)"], ["R"]], "output": ["P"]}
    return autopar.Plan.from_json(json.dumps(d))


def test_vocab_parallel_embedding_trains_like_single_device():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=256, n_embd=16, n_head=2))
    idx, tgt = torch.randint(0, 256, (4, 16)), torch.randint(0, 256, (4, 16))
    plan = _force_vocab_split(autopar.plan(model, (idx,), {"tp": 2}, strategy="tp", hardware="cpu"))
    ref = single_device_reference(lambda: copy.deepcopy(model), idx, tgt, gpt_loss, lr=1e-4)
    records = run_threaded(2, parallel_record, model, (2,), ("tp",), idx, tgt, gpt_loss, 3, 1e-4, {"plan": plan})
    for rec in records:
        assert rec["plan"].param_placements["wte.weight"] == ("S(0)",)
        torch.testing.assert_close(rec["outputs"], ref["outputs"], atol=1e-5, rtol=0)
        for name, g in ref["grads"].items():
            torch.testing.assert_close(rec["grads"][name], g, atol=1e-5, rtol=0, msg=name)
        for name, p in ref["params"].items():
            torch.testing.assert_close(rec["params"][name], p, atol=1e-5, rtol=0, msg=name)
        # the embedding's partial sums are reduced once, in forward, on the tp axis
        assert ("all_reduce", 0, 4 * 16 * 16 * 4, "forward") in rec["comm"]


# ---------------------------------------------------------------- padding_idx survives the rewrite


@st.composite
def _lookups(draw):
    shards = draw(st.sampled_from([2, 3, 4]))
    vocab = shards * draw(st.integers(1, 4))
    padding = draw(st.sampled_from([None, 0, vocab - 1, vocab // 2]))
    idx = torch.tensor(draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=12)))
    if padding is not None:
        idx[0] = padding   # the padding token is looked up at least once
    return vocab, shards, padding, idx


@settings(max_examples=40, deadline=None)
@given(case=_lookups())
def test_vocab_split_lookup_keeps_every_argument(case):
    """Each rank runs what rewrite.local_target gives for the captured embedding, with its arguments:
    outputs sum to the whole lookup, and the gradients of the slices are the whole table's, the
    padding row's exactly 0 (BERT's row 0 once got a gradient this way)."""
    vocab, shards, padding, idx = case
    torch.manual_seed(0)
    emb = torch.nn.Embedding(vocab, 3, padding_idx=padding).double()
    node = next(n for n in capture(emb, (idx,), None).graph.nodes if "embedding" in str(n.target))
    split = Strategy(inputs=(("S(0)",), ("R",)), output=("P",))
    whole = emb(idx)
    upstream = torch.randn_like(whole)
    whole.backward(upstream)
    rows = vocab // shards
    total, grads = 0, []
    for rank in range(shards):
        target, extra = local_target(node, split, (rank,), (shards,))
        shard = emb.weight.detach()[rank * rows:(rank + 1) * rows].clone().requires_grad_()
        out = target(shard, idx, *extra)
        out.backward(upstream)
        total = total + out.detach()
        grads.append(shard.grad)
    torch.testing.assert_close(total, whole.detach(), atol=1e-12, rtol=0)
    torch.testing.assert_close(torch.cat(grads), emb.weight.grad, atol=1e-12, rtol=0)
    if padding is not None:
        assert torch.cat(grads)[padding].abs().max() == 0


def _local_lookup_args(rank, model, idx, plan):
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    # a copy per rank thread, as every threaded test makes: two threads capturing one module share its
    # tensors, and torch's fake-tensor state with them (it failed once: fake_mode.in_kernel_invocation)
    pm = autopar.parallelize(copy.deepcopy(model), mesh, (idx,), plan=plan)
    return [n.args[2:] for n in pm.graph_module.graph.nodes if n.target is vocab_parallel_embedding]


def test_rewritten_lookup_carries_the_local_padding_idx():
    """The rewritten graph itself: the rank holding padding row 200 of a 256-row table split in two
    names it by its local index (200 - 128), the other rank none (-1)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=256, n_embd=16, n_head=2))
    model.wte = torch.nn.Embedding(256, 16, padding_idx=200)
    idx = torch.randint(0, 256, (4, 16))
    plan = _force_vocab_split(autopar.plan(model, (idx,), {"tp": 2}, strategy="tp", hardware="cpu"))
    calls = run_threaded(2, _local_lookup_args, model, idx, plan)
    assert calls == [[(0, -1)], [(128, 72)]]


def test_lookup_scaled_by_token_counts_or_sparse_is_never_split():
    """scale_grad_by_freq divides by each token's count in the batch, which neither a rank's rows of
    the vocab nor its shard of the batch know; a sparse gradient has no masked vocab-split form."""
    from autopar.mesh import MeshSpec
    from autopar.sharding.strategies import op_strategies
    idx = torch.randint(0, 8, (4, 6))
    mesh = MeshSpec(("tp",), (2,))
    for kwargs, splits in (({}, True), ({"scale_grad_by_freq": True}, False), ({"sparse": True}, False)):
        cap = capture(torch.nn.Embedding(8, 4, **kwargs), (idx,), None)
        node = next(n for n in cap.graph.nodes if "embedding" in str(n.target))
        options = op_strategies(node, cap, mesh).strategies
        assert any(s.output != ("R",) for s in options) == splits, kwargs
