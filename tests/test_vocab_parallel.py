"""Vocab-parallel embedding and cross-entropy: each rank holds a slice of the vocabulary and never the whole."""
import copy
import json
import warnings
from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import autopar
from autopar.capture.export import capture
from autopar.errors import UnsupportedOpWarning
from autopar.runtime.lowering.vocab_parallel import VocabParallelCrossEntropy, local_target, vocab_parallel_embedding
from autopar.sharding.strategies import Strategy
from autopar.testing import GPT, GPTConfig, GPTWithLoss, gpt_loss, parallel_record, run_threaded, single_device_reference


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
    """Each rank runs what vocab_parallel.local_target gives for the captured embedding, with its arguments:
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


# ---------------------------------------------------------------- vocab-parallel cross-entropy


def _loss_shares(rank, x, target, num_ranks, ignore_index, smoothing, upstream):
    """On one threaded rank: its share of each position's loss from its slice of the classes, the
    gradient of that slice, and the collectives it launched."""
    import torch.distributed as dist

    from autopar.runtime.collectives import AxisGroup, Comm, CommLog
    comm = Comm([AxisGroup(dist.group.WORLD, num_ranks, rank)], CommLog())
    local = x.shape[1] // num_ranks
    piece = x[:, rank * local:(rank + 1) * local].clone().requires_grad_()
    loss = VocabParallelCrossEntropy(comm, (0,), rank * local, x.shape[1], ignore_index, smoothing)(piece, target)
    loss.backward(upstream)
    return loss.detach(), piece.grad, comm.log.records


@st.composite
def _losses(draw):
    num_ranks = draw(st.sampled_from([2, 3]))
    classes = num_ranks * draw(st.integers(1, 5))
    n = draw(st.integers(1, 6))
    extra = draw(st.sampled_from([(), (1,), (3,)]))   # cross_entropy's x[N, C, d...]
    seed = draw(st.integers(0, 2 ** 16))
    ignore_index = draw(st.sampled_from([-100, 0]))    # outside the vocab, or a class some rank holds
    smoothing = draw(st.sampled_from([0.0, 0.1]))
    dtype = draw(st.sampled_from([torch.float64, torch.float32]))
    return num_ranks, classes, n, extra, seed, ignore_index, smoothing, dtype


@settings(max_examples=25, deadline=None)
@given(case=_losses())
def test_vocab_parallel_cross_entropy_equals_cross_entropy(case):
    """Drawn shapes, ignored targets and label smoothing: the ranks' shares sum to F.cross_entropy's
    per-position loss, each rank's gradient is its slice of the whole gradient, and the op launches
    exactly the two all-reduces per position the cost model prices (terms.op_collectives)."""
    num_ranks, classes, n, extra, seed, ignore_index, smoothing, dtype = case
    gen = torch.Generator().manual_seed(seed)
    x = (3 * torch.randn((n, classes) + extra, generator=gen)).to(dtype)
    target = torch.randint(0, classes, (n,) + extra, generator=gen)
    target[torch.rand(target.shape, generator=gen) < 0.3] = ignore_index   # some positions ignored
    upstream = torch.randn(target.shape, generator=gen, dtype=dtype)
    whole = x.clone().requires_grad_()
    expected = torch.nn.functional.cross_entropy(whole, target, reduction="none", ignore_index=ignore_index,
                                                 label_smoothing=smoothing)
    expected.backward(upstream)
    shares = run_threaded(num_ranks, _loss_shares, x, target, num_ranks, ignore_index, smoothing, upstream)
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(sum(s[0] for s in shares), expected.detach(), atol=tol, rtol=tol)
    torch.testing.assert_close(torch.cat([s[1] for s in shares], dim=1), whole.grad, atol=tol, rtol=tol)
    position_bytes = target.numel() * max(x.element_size(), 4)
    for _, _, records in shares:
        assert records == [("all_reduce", 0, position_bytes, "forward")] * 2


def _gpt_with_loss():
    """nanoGPT's forward(idx, targets) with some targets ignored (-1). The vocabulary is large next to the
    hidden size, as in real models, so that gathering the logits costs more than the two all-reduces."""
    torch.manual_seed(0)
    model = GPTWithLoss(GPTConfig(vocab_size=1536, block_size=24, n_layer=2, n_head=6, n_embd=48))
    x, y = torch.randint(0, 1536, (8, 24)), torch.randint(0, 1536, (8, 24))
    y[0, :11] = -1
    y[5, 3:] = -1
    return model, x, y


def _train_with_loss_inside(rank, model, x, y, num_ranks, optimizer, lr, steps=3):
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (num_ranks,), mesh_dim_names=("tp",))
    pm = autopar.parallelize(copy.deepcopy(model), mesh, (x, y), strategy="tp", hardware="cpu", record_comm=True)
    opt = autopar.ShardedOptimizer(pm, optimizer, lr=lr)
    losses, launched = [], None
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        pm.comm.log.records.clear()
        loss = pm(x, y)[1]
        loss.backward()
        opt.step()
        losses.append(loss.item())
        launched = launched if launched is not None else list(pm.comm.log.records)
    return pm.plan, losses, launched, {k: v.clone() for k, v in pm.state_dict(full=True).items()}


@pytest.mark.parametrize("num_ranks", [2, 3])
def test_loss_inside_forward_trains_vocab_parallel_under_tp(num_ranks):
    """nanoGPT's own loss under tp on 2 and 3 ranks: cross-entropy runs on each rank's slice of the
    vocabulary (no gathered logits for it, no replicated-op warning) and trains like one device with
    SGD (a wrong loss share or gradient scale moves parameters by ~lr x gradient) and with AdamW; the
    collectives launched are the plan's, the two per-position all-reduces included."""
    model, x, y = _gpt_with_loss()
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnsupportedOpWarning)
        autopar.plan(model, (x, y), {"tp": num_ranks}, strategy="tp", hardware="cpu")
    for optimizer, lr, atol in ((torch.optim.SGD, 0.5, 1e-5), (torch.optim.AdamW, 1e-3, 1e-3)):
        ref = copy.deepcopy(model)
        opt = optimizer(ref.parameters(), lr=lr)
        ref_losses = []
        for _ in range(3):
            opt.zero_grad(set_to_none=True)
            loss = ref(x, y)[1]
            loss.backward()
            opt.step()
            ref_losses.append(loss.item())
        for plan, losses, launched, params in run_threaded(num_ranks, _train_with_loss_inside, model, x, y,
                                                           num_ranks, optimizer, lr):
            loss_op = next(n for n in plan.node_strategies if n.startswith("cross_entropy_loss_default"))
            assert plan.node_strategies[loss_op].inputs[0] == ("S(1)",)
            assert sum(c.tensor == loss_op for c in plan.collectives) == 2
            assert Counter((k, a, float(b), ph) for k, a, b, ph in launched) == \
                Counter((c.kind, 0, c.bytes, c.phase) for c in plan.collectives)
            torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), atol=1e-5, rtol=0)
            for name, p in ref.named_parameters():
                torch.testing.assert_close(params[name], p.detach(), atol=atol, rtol=0, msg=name)
