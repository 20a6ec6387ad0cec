"""Whole models drawn the way users break them, against the single-device run.

Hypothesis draws the model (our MLP and GPT with the loss outside, nanoGPT's
`forward(idx, targets) -> (logits, loss)`, a small Hugging Face Llama returning
logits or called with `labels=`), the mesh (sizes 3 and 6 beside powers of
two, one and two axes), the strategy (every named one and auto), the optimizer
(SGD, SGD with momentum, AdamW: Adam's step is blind to a gradient's scale,
SGD is not) and how the loss is taken (a loss_fn on the outputs with targets,
`train_step(loss_fn=..., targets=...)`, `train_step` with a targets-free
loss_fn, or the loss the model returns). The parameters after 3 steps and the
whole gradients of step 1 must equal the single-device run's.

CI draws CI_CASES cases; HYPOTHESIS_PROFILE=thorough (tests/conftest.py) draws
THOROUGH_CASES. Ranks are threads (the threaded process group), inputs and
models are made before the threads start (they share one RNG).
"""
from __future__ import annotations

import copy
import math
import os
import warnings

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import autopar
from autopar.testing import GPT, MLP, GPTConfig, GPTWithLoss, LogitsOnly, WithLabels, run_threaded

CI_CASES, THOROUGH_CASES = 12, 320   # CI: 12 cases, ~70 s on 2 cores; thorough: the full sweep
CASES = THOROUGH_CASES if os.environ.get("HYPOTHESIS_PROFILE") == "thorough" else CI_CASES
STEPS = 3
BATCH, SEQ, VOCAB = 12, 12, 96   # every size divides by 2, 3, 4 and 6
OPTIMIZERS = {   # name -> (class, kwargs, atol)
    "sgd": (torch.optim.SGD, dict(lr=0.1), 1e-5),
    "sgd-momentum": (torch.optim.SGD, dict(lr=0.05, momentum=0.9), 1e-5),
    # see test_equivalence.py for why AdamW runs at lr 1e-4
    "adamw": (torch.optim.AdamW, dict(lr=1e-4), 1e-5),
}
MESHES = [(2,), (3,), (4,), (6,), (2, 2), (3, 2), (2, 3)]
ONE_AXIS = ["ddp", "zero1", "zero2", "fsdp", "tp", "tp+sp", "auto"]
TWO_AXES = ONE_AXIS + ["fsdp+tp"]
MODELS = ["mlp", "gpt", "gpt-loss-inside", "llama", "llama-labels"]
LOSS_INSIDE = {"gpt-loss-inside", "llama-labels"}
# how the loss is taken: from a loss_fn on the outputs, through train_step with or without targets
OUTSIDE_WAYS = ["loss_fn", "train_step", "train_step-no-targets"]
INSIDE_WAYS = ["returned", "train_step-no-targets"]


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=6, num_key_value_heads=3, max_position_embeddings=32,
                      use_cache=False, attn_implementation="sdpa")
    return LlamaForCausalLM(cfg).train()


def make(kind: str, seed: int):
    """(model, inputs, targets) with targets None when the model takes them as inputs."""
    torch.manual_seed(seed)
    if kind == "mlp":
        return MLP([12, 24, 12]), (torch.randn(BATCH, 12),), torch.randn(BATCH, 12)
    idx = torch.randint(0, VOCAB, (BATCH, SEQ))
    targets = torch.randint(0, VOCAB, (BATCH, SEQ))
    cfg = GPTConfig(vocab_size=VOCAB, block_size=SEQ, n_layer=2, n_head=6, n_embd=48)
    if kind == "gpt":
        return GPT(cfg), (idx,), targets
    if kind == "gpt-loss-inside":
        targets[1, :7] = -1   # ignored, unevenly over the batch shards
        return GPTWithLoss(cfg), (idx, targets), None
    if kind == "llama":
        return LogitsOnly(_llama()), (idx,), targets
    labels = idx.clone()
    labels[4, 3:] = -100
    return WithLabels(_llama()), (idx, labels), None


def outside_loss(out, targets):
    if targets.dim() == 2 and out.dim() == 3:   # token logits
        return F.cross_entropy(out.reshape(-1, out.size(-1)), targets.reshape(-1))
    return ((out - targets) ** 2).mean()


def no_targets_loss(out):
    """A loss of the outputs alone: the model's own loss if it returns one."""
    if isinstance(out, tuple):
        return out[1]
    if hasattr(out, "loss"):
        return out.loss
    return out.float().pow(2).mean()


def one_step(model, inputs, targets, way):
    """Forward and backward of one step, the way a user writes it; returns the loss."""
    if way == "loss_fn":
        loss = outside_loss(model(*inputs), targets)
    elif way == "returned":
        loss = no_targets_loss(model(*inputs))
    elif way == "train_step":
        return model.train_step(*inputs, loss_fn=outside_loss, targets=targets)
    else:   # train_step-no-targets
        return model.train_step(*inputs, loss_fn=no_targets_loss)
    loss.backward()
    return loss.detach()


def reference(model, inputs, targets, way, optimizer):
    opt_cls, kwargs, _ = OPTIMIZERS[optimizer]
    model = copy.deepcopy(model)
    opt = opt_cls(model.parameters(), **kwargs)
    grads = None
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        if way in ("loss_fn", "returned"):
            one_step(model, inputs, targets, way)
        else:   # a plain module has no train_step: the same loss, by hand
            one_step(model, inputs, targets, "loss_fn" if way == "train_step" else "returned")
        if step == 0:
            grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
        opt.step()
    return grads, {k: p.detach().clone() for k, p in model.named_parameters()}


def parallel(rank, model, inputs, targets, way, optimizer, shape, strategy):
    from torch.distributed.device_mesh import init_device_mesh
    opt_cls, kwargs, _ = OPTIMIZERS[optimizer]
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("a", "b")[:len(shape)])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # replicated ops and indivisible heads are expected here
        pm = autopar.parallelize(copy.deepcopy(model), mesh, inputs, strategy=strategy)
    local = pm.plan.local_inputs(*inputs)
    local_targets = pm.plan.local_targets(targets)[0] if targets is not None else None
    opt = autopar.ShardedOptimizer(pm, opt_cls, **kwargs)
    grads = None
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        one_step(pm, local, local_targets, way)
        if step == 0:
            grads = opt.full_grads()
        opt.step()
    return grads, pm.state_dict(full=True), pm.plan


@st.composite
def cases(draw):
    kind = draw(st.sampled_from(MODELS), label="model")
    shape = draw(st.sampled_from(MESHES), label="mesh")
    strategy = draw(st.sampled_from(TWO_AXES if len(shape) == 2 else ONE_AXIS), label="strategy")
    optimizer = draw(st.sampled_from(sorted(OPTIMIZERS)), label="optimizer")
    way = draw(st.sampled_from(INSIDE_WAYS if kind in LOSS_INSIDE else OUTSIDE_WAYS), label="loss")
    seed = draw(st.integers(0, 2 ** 16), label="seed")
    return kind, shape, strategy, optimizer, way, seed


@settings(max_examples=CASES)
@given(case=cases())
def test_drawn_model_trains_like_one_device(case):
    kind, shape, strategy, optimizer, way, seed = case
    if kind.startswith("llama"):
        pytest.importorskip("transformers")
    model, inputs, targets = make(kind, seed)
    want_grads, want_params = reference(model, inputs, targets, way, optimizer)
    atol = OPTIMIZERS[optimizer][2]
    results = run_threaded(math.prod(shape), parallel, model, inputs, targets, way, optimizer, shape, strategy)
    where = f"{kind} on mesh {shape} with {strategy}, {optimizer}, loss by {way}"
    for rank, (grads, params, plan) in enumerate(results):
        for name, g in want_grads.items():
            err = (grads[name] - g).abs().max().item()
            assert err <= atol, f"rank {rank}: step-1 gradient of {name} off by {err:.2e} ({where})"
        for name, p in want_params.items():
            err = (params[name] - p).abs().max().item()
            assert err <= atol, f"rank {rank}: {name} after {STEPS} steps off by {err:.2e} ({where})"
