"""Vocab-parallel embedding: each rank holds a slice of the table and looks up only its own rows."""
import copy
import json

import torch

import autopar
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

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from autopar.capture import capture  # noqa: E402
from autopar.rewrite import local_target  # noqa: E402
from autopar.strategies import Strategy  # noqa: E402


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
