"""Dropout under a plan: one mask per replica, independent masks per shard (runtime/rng.py).

On one device the mask of head 0 and that of head h/2, or of batch rows 0 and B/2, are independent draws.
Ranks that hold different shards of a dropout's output (heads under tp, sequence positions under sp, batch
rows under dp) must draw different masks, and ranks that hold the same values (the tp ranks of a replicated
activation) the same mask, or their replicas drift apart.

Threads of one process (run_threaded) share torch's default generators, so what a rank's own generator would
do is checked in real processes (run_gloo): ranks seeded alike gave every shard one mask before rng.py, ranks
seeded differently gave replicas different masks. The threaded tests check the streams each random op draws
from across layouts: masks equal exactly where the layout replicates the op's output, replicated weights
bitwise equal across tp ranks after SGD and AdamW steps, checkpoint recompute replaying forward's masks
(gradients equal to the run without checkpointing), eagerly and compiled, manual_seed, and torch.compile.
"""
from __future__ import annotations

import copy
import math
import os
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import example, given, settings
from hypothesis import strategies as st

import autopar
from autopar.runtime.rng import RandomOp
from autopar.testing import MegatronStack, run_gloo, run_threaded

P = 0.5


class AttentionProbs(nn.Module):
    """Attention probabilities after dropout, [b, heads, s, s]: a tp plan splits them by head; the module
    returns them whole, so every rank sees every head's mask."""

    def __init__(self, hidden: int = 16, heads: int = 4):
        super().__init__()
        self.heads = heads
        self.q, self.k = nn.Linear(hidden, hidden), nn.Linear(hidden, hidden)
        self.drop = nn.Dropout(P)

    def forward(self, x):
        b, s, h = x.shape
        q, k = (f(x).view(b, s, self.heads, h // self.heads).transpose(1, 2) for f in (self.q, self.k))
        return self.drop((q @ k.transpose(-2, -1)).softmax(-1))


def _mesh(shape, names):
    from torch.distributed.device_mesh import init_device_mesh
    return init_device_mesh("cpu", shape, mesh_dim_names=names)


def _parallelize(model, shape, names, x, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", autopar.UnsupportedOpWarning)
        return autopar.parallelize(copy.deepcopy(model), _mesh(shape, names), (x,), hardware="cpu", **kwargs)


# ----------------------------------------------------------------------------- real processes

def _own_generators(rank, probs_model, linear_model, stack, x_probs, x_rows, x_stack):
    """Each case in this process, with its own default generator seeded as users do."""
    out = {}
    torch.manual_seed(0)   # every rank alike: the common case
    pm = _parallelize(probs_model, (2,), ("tp",), x_probs, strategy="tp")
    out["probs"] = pm(*pm.plan.local_inputs(x_probs)).detach()
    pm = _parallelize(linear_model, (2,), ("dp",), x_rows, strategy="ddp")
    out["rows"] = pm(*pm.plan.local_inputs(x_rows)).detach()
    torch.manual_seed(rank)   # every rank differently (or not at all): replicas must still agree
    pm = _parallelize(stack, (2,), ("tp",), x_stack, strategy="tp")
    out["replicated"] = pm(*pm.plan.local_inputs(x_stack)).detach()
    return out


@pytest.mark.gloo
def test_processes_seeded_alike_draw_a_mask_per_shard_and_seeded_apart_one_per_replica():
    torch.manual_seed(0)
    probs_model, x_probs = AttentionProbs().train(), torch.randn(2, 8, 16)
    linear_model, x_rows = nn.Sequential(nn.Linear(16, 16), nn.Dropout(P)).train(), torch.randn(8, 16)
    stack, x_stack = MegatronStack(num_layers=1, hidden=16, heads=4, dropout=P).train(), torch.randn(2, 8, 16)
    ranks = run_gloo(2, _own_generators, probs_model, linear_model, stack, x_probs, x_rows, x_stack, timeout=300)

    probs = ranks[0]["probs"]   # whole: [b, 4 heads, s, s], heads 0-1 drawn on tp rank 0, 2-3 on rank 1
    assert probs.shape == (2, 4, 8, 8) and torch.equal(probs, ranks[1]["probs"])
    kept = probs != 0
    assert not torch.equal(kept[:, :2], kept[:, 2:]), "tp rank 1's heads were dropped as rank 0's"
    assert 0.3 < kept.float().mean() < 0.7

    rows = [r["rows"] != 0 for r in ranks]   # each rank's 4 rows of the batch of 8
    assert rows[0].shape == (4, 16) and not torch.equal(rows[0], rows[1]), "dp rank 1's rows dropped as rank 0's"

    assert torch.equal(ranks[0]["replicated"], ranks[1]["replicated"]), \
        "tp ranks seeded differently drew different masks for a replicated activation"


# ----------------------------------------------------------------------------- threads

LAYOUTS = [("tp", (2,), ("tp",)), ("tp+sp", (2,), ("tp",)), ("fsdp+tp", (2, 2), ("dp", "tp"))]


def _stack(num_layers: int = 1):
    torch.manual_seed(0)
    return MegatronStack(num_layers=num_layers, hidden=16, heads=4, dropout=P).train(), torch.randn(4, 8, 16)


def _record_masks(pm) -> dict:
    """{random op's module name: (its stream key, the kept-mask of its last call)}, filled as pm runs."""
    seen = {}
    for name, m in pm.graph_module.named_modules():
        if isinstance(m, RandomOp):
            m.register_forward_hook(lambda mod, args, out, name=name: seen.__setitem__(name, (mod.key, out != 0)))
    return seen


def _train(rank, model, x, strategy, shape, names, optimizer):
    pm = _parallelize(model, shape, names, x, strategy=strategy)
    pm.manual_seed(1234)
    masks = _record_masks(pm)
    opt = autopar.ShardedOptimizer(pm, optimizer, lr=0.1)
    (local,) = pm.plan.local_inputs(x)
    for _ in range(2):
        opt.zero_grad()
        out = pm(local)
        out.square().mean().backward()
        opt.step()
    tp = names.index("tp")
    replicated = {n: p.detach().clone() for n, p in pm.named_parameters() if pm.plan.param_placements[n][tp] == "R"}
    return {"coords": tuple(a.coord for a in pm.comm.axes), "masks": masks, "out": out.detach(),
            "replicated": replicated}


@pytest.mark.parametrize("optimizer", [torch.optim.SGD, torch.optim.AdamW], ids=["sgd", "adamw"])
@pytest.mark.parametrize("strategy, shape, names", LAYOUTS, ids=[c[0] for c in LAYOUTS])
def test_shards_draw_their_own_masks_and_replicas_stay_bitwise_equal(strategy, shape, names, optimizer):
    model, x = _stack()
    ranks = run_threaded(math.prod(shape), _train, model, x, strategy, shape, names, optimizer)
    tp = names.index("tp")
    masks = ranks[0]["masks"]
    assert len(masks) == 3   # attention probabilities', after attention, after the MLP
    split_by_tp = [n for n, (key, _) in masks.items() if tp in dict(key)]
    assert split_by_tp, "no dropout split by tp: the layout under test is not the one meant"
    for name in masks:
        for a in range(len(ranks)):
            for b in range(a + 1, len(ranks)):
                (key_a, mask_a), (key_b, mask_b) = ranks[a]["masks"][name], ranks[b]["masks"][name]
                if key_a == key_b:   # the same shard of the op's output: one mask
                    assert torch.equal(mask_a, mask_b), f"{name}: ranks {a}, {b} hold one replica, drew two masks"
                else:
                    assert not torch.equal(mask_a, mask_b), f"{name}: ranks {a}, {b} hold other shards, drew one mask"
    for a in range(len(ranks)):
        for b in range(len(ranks)):
            same_data_shard = all(ca == cb for i, (ca, cb) in enumerate(zip(ranks[a]["coords"], ranks[b]["coords"]))
                                  if i != tp)
            if a < b and same_data_shard:   # tp ranks of one dp group: the output and replicated weights agree
                assert torch.equal(ranks[a]["out"], ranks[b]["out"])
                for n, p in ranks[a]["replicated"].items():
                    assert torch.equal(p, ranks[b]["replicated"][n]), f"{n} drifted apart on tp ranks {a}, {b}"


def _grads(rank, model, x, checkpointing):
    """Seed 7's output and gradients, and seed 8's output."""
    pm = _parallelize(model, (2,), ("tp",), x, strategy="tp", checkpointing=checkpointing)
    assert bool(pm.plan.checkpointed) == (checkpointing == "full")
    (local,) = pm.plan.local_inputs(x)
    pm.manual_seed(7)
    out = pm(local)
    out.square().mean().backward()
    pm.manual_seed(8)
    with torch.no_grad():
        other = pm(local)
    return out.detach(), {n: p.grad.clone() for n, p in pm.named_parameters()}, other


def test_checkpoint_recompute_draws_the_masks_forward_drew():
    model, x = _stack(num_layers=2)   # checkpointing keeps a layer's input: two layers to recompute
    plain = run_threaded(2, _grads, model, x, "none")
    recomputed = run_threaded(2, _grads, model, x, "full")
    for (out, grads, other), (out_r, grads_r, _) in zip(plain, recomputed):
        assert torch.equal(out, out_r)   # the same seed draws the same masks
        assert not torch.equal(out, other)
        for n, g in grads.items():   # rerun with other masks, backward would take other gradients
            torch.testing.assert_close(grads_r[n], g, rtol=0, atol=1e-6, msg=f"{n}'s gradient")


def _compiled(rank, model, x):
    pm = _parallelize(model, (2,), ("tp",), x, strategy="tp")
    masks = _record_masks(pm)
    torch.distributed.barrier()   # no rank traces (export) while another compiles: torch would skip compiling
    run = torch.compile(pm, backend="eager")
    with warnings.catch_warnings():
        warnings.filterwarnings("error", "torch.compile is ignored")
        run(*pm.plan.local_inputs(x)).sum().backward()
    return masks


def test_compiled_module_draws_a_mask_per_shard():
    model, x = _stack()
    ranks = run_threaded(2, _compiled, model, x)
    split = [n for n, (key, _) in ranks[0].items() if key]
    assert split
    for n in split:
        assert not torch.equal(ranks[0][n][1], ranks[1][n][1])
    for n in set(ranks[0]) - set(split):
        assert torch.equal(ranks[0][n][1], ranks[1][n][1])


def _attention_dropout_stack():
    """Two layers whose one dropout is attention's: a selective plan's recomputed core draws, and the rest of
    each layer compiles in few graphs (each random op breaks the graph: more of them, slower to compile)."""
    model, x = _stack(num_layers=2)
    for layer in model.layers:
        layer.dropout_1.p = layer.dropout_2.p = 0.0
    return model, x


def _seeded_grads(rank, model, x, checkpointing, backend):
    """Seed 7's output and gradients, the module compiled with `backend` (None: run eagerly)."""
    pm = _parallelize(model, (2,), ("tp",), x, strategy="tp", checkpointing=checkpointing)
    assert set(pm.plan.checkpointed.values()) == {checkpointing} - {"none"}
    run = pm
    if backend is not None:
        torch.distributed.barrier()   # no rank traces (export) while another compiles: torch would skip compiling
        run = torch.compile(pm, backend=backend)
    (local,) = pm.plan.local_inputs(x)
    pm.manual_seed(7)
    out = run(local)
    out.square().mean().backward()
    return out.detach(), {n: p.grad.clone() for n, p in pm.named_parameters()}


@pytest.fixture(scope="module")
def uncompiled_without_checkpointing():
    model, x = _attention_dropout_stack()
    return model, x, run_threaded(2, _seeded_grads, model, x, "none", None)


# A checkpointed region that draws runs eagerly under any backend (recompute.EagerCheckpointRegion), so the
# backend does not matter to the draws; two backends, not every pair, keep this quick.
@pytest.mark.parametrize("checkpointing, backend", [("full", "aot_eager"), ("selective", "eager")])
def test_compiled_recompute_draws_the_masks_forward_drew(uncompiled_without_checkpointing, checkpointing, backend):
    """Compiled, a checkpointed block's recompute once drew new masks from streams forward had advanced:
    gradients against masks forward never drew (here max |dgrad| 0.033 full, 0.029 selective; max |grad| 0.19)."""
    torch._dynamo.reset()   # the ranks' modules are entries under the same code: start from no cache
    model, x, plain = uncompiled_without_checkpointing
    compiled = run_threaded(2, _seeded_grads, model, x, checkpointing, backend)
    for (out, grads), (out_c, grads_c) in zip(plain, compiled):
        assert torch.equal(out, out_c)   # forward draws from the same streams either way
        for n, g in grads.items():
            torch.testing.assert_close(grads_c[n], g, rtol=0, atol=1e-6, msg=f"{n}'s gradient")


# ----------------------------------------------------------------------------- the hypothesis net (issue 51)

class RateAttention(nn.Module):
    """Attention written as Hugging Face writes it: SDPA's dropout_p is the module's rate in training and 0.0 in
    eval, so a graph traced in eval mode holds no dropout at all."""

    def __init__(self, hidden: int = 16, heads: int = 4, attention_dropout: float = P):
        super().__init__()
        self.heads, self.attention_dropout = heads, attention_dropout
        self.qkv, self.out = nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, hidden)

    def forward(self, x):
        b, s, h = x.shape
        q, k, v = (t.view(b, s, self.heads, h // self.heads).transpose(1, 2) for t in self.qkv(x).split(h, -1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.attention_dropout if self.training else 0.0)
        return x + self.out(y.transpose(1, 2).reshape(b, s, h))


class RateAttentionStack(nn.Module):
    """Two such layers: a stack the plan can checkpoint block by block."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([RateAttention(), RateAttention()])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def _seeded_run(rank, model, x, strategy, shape, names, built_in, backend, checkpointing):
    """Output and gradients at seed 3 of the module parallelized in mode `built_in` and run in train mode."""
    model = copy.deepcopy(model).train(built_in == "train")
    pm = _parallelize(model, shape, names, x, strategy=strategy, checkpointing=checkpointing).train()
    run = pm
    if backend is not None:
        torch.distributed.barrier()   # no rank traces (export) while another compiles
        run = torch.compile(pm, backend=backend)
    (local,) = pm.plan.local_inputs(x)
    pm.manual_seed(3)
    out = run(local)
    out.square().mean().backward()
    return out.detach(), pm.full_grads()


DRAWN = 12 if os.environ.get("HYPOTHESIS_PROFILE") == "thorough" else 2


@settings(max_examples=DRAWN)
# (the drawing that failed in about half the runs while a compiling rank could set the default generators back
# in the middle of another rank's stream swap: test_a_stream_swap_waits_for_a_compile_in_another_thread)
@example(layout=("fsdp", (3,), ("dp",)), built_in="train", backend="aot_eager", checkpointing="full")
@given(layout=st.sampled_from([("ddp", (2,), ("dp",)), ("fsdp", (3,), ("dp",)), ("tp", (2,), ("tp",))]),
       built_in=st.sampled_from(["eval", "train"]), backend=st.sampled_from([None, "eager", "aot_eager"]),
       checkpointing=st.sampled_from(["none", "full", "selective"]))
def test_drawn_dropout_trains_as_the_module_built_in_train_mode_uncompiled(layout, built_in, backend,
                                                                            checkpointing):
    """Dropout x checkpointing x compile x strategy x the mode parallelize saw: the module's train-mode output
    and gradients at a seed equal those of the same model parallelized in train mode, uncompiled, without
    checkpointing (its masks drawn per shard as tests above check)."""
    strategy, shape, names = layout
    torch.manual_seed(0)
    model, x = RateAttentionStack(), torch.randn(6, 8, 16)
    torch._dynamo.reset()
    want = run_threaded(shape[0], _seeded_run, model, x, strategy, shape, names, "train", None, "none")
    got = run_threaded(shape[0], _seeded_run, model, x, strategy, shape, names, built_in, backend, checkpointing)
    for (out, grads), (out_got, grads_got) in zip(want, got):
        assert torch.equal(out, out_got)
        for n, g in grads.items():
            torch.testing.assert_close(grads_got[n], g, rtol=0, atol=1e-6, msg=f"{n}'s gradient")


def test_a_stream_swap_waits_for_a_compile_in_another_thread():
    """A random op draws with its stream swapped into the process's default generator (runtime/rng.py), and
    torch.compile sets that generator back to its state at the start of each frame it compiles. Ranks run as
    threads share it: a swap must not run while another thread compiles, or the rank draws from the state the
    compile restored (in a checkpointed block's rerun, a mask forward never drew). So a swap waits for the
    compiler's lock, which another thread holds here as a compile would."""
    import threading

    from torch._dynamo.convert_frame import compile_lock

    from autopar.runtime.rng import RandomStreams

    streams = RandomStreams(0)
    drawn = threading.Event()

    def draw():
        streams.run(("dp", 0), torch.device("cpu"), lambda: torch.rand(3))
        drawn.set()

    with compile_lock:   # another thread is compiling a frame
        rank = threading.Thread(target=draw)
        rank.start()
        assert not drawn.wait(0.5)   # the swap waits
    rank.join(10)
    assert drawn.is_set()
    alone = RandomStreams(0).run(("dp", 0), torch.device("cpu"), lambda: torch.rand(3))
    again = RandomStreams(0).run(("dp", 0), torch.device("cpu"), lambda: torch.rand(3))
    assert torch.equal(alone, again)   # and a stream still draws the same numbers from the same seed
