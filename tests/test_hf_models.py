"""Hugging Face Llama (GQA), GPT-2 (tied embeddings, Conv1D) and BERT (an encoder: post-norm blocks,
an embedding LayerNorm, a tied decoder with its own bias, padding_idx=0), from small random configs.

Nothing is downloaded. The models train through autopar.parallelize on the
threaded backend and must match the single-device run, with AdamW or with
SGD (Adam's step is blind to a gradient's scale), both in every case; ops autopar has no rule for
(the rotary no_grad region of transformers <= 5.23, kept here as `llama_rope_under_no_grad`) run
replicated. Every
batch holds token 0, the padding row of BERT's embeddings: its gradient is 0
on one device and must stay 0 when the table is split by vocabulary.
"""
import warnings

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

import autopar
from autopar.testing import LogitsOnly, gpt_loss, run_threaded, tiny_llama
from autopar.testing.harness import check_runs_against_one_device, parallel_records

# AdamW's lr small enough that it does not turn float noise into differences above atol
OPTIMIZERS = {"adamw": (torch.optim.AdamW, 1e-4), "sgd": (torch.optim.SGD, 0.1)}


def llama(heads=4, kv_heads=2, hidden=32):
    return tiny_llama(heads=heads, kv_heads=kv_heads, hidden=hidden)


class NoGradRotary(LlamaRotaryEmbedding):
    """Llama's rotary tables as transformers up to 5.23 computed them: under `@torch.no_grad()`, which
    torch.export keeps as a `wrap_with_set_grad_enabled` region (a higher-order op with its own
    subgraph, no sharding rule: it runs replicated, and the rewriter carries its submodule over)."""

    @torch.no_grad()
    def forward(self, x, position_ids):
        return super().forward(x, position_ids)


def llama_rope_under_no_grad():
    model = llama()
    model.model.model.rotary_emb.__class__ = NoGradRotary   # survives deepcopy, unlike a patched method
    return model


def gpt2():
    cfg = GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=4, use_cache=False,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="sdpa")
    return LogitsOnly(GPT2LMHeadModel(cfg)).train()


class BertLogits(torch.nn.Module):
    """BertForMaskedLM as its authors call it, returning the logits."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids):
        return self.model(input_ids=input_ids).logits


def bert():
    from transformers import BertConfig, BertForMaskedLM
    cfg = BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=64, max_position_embeddings=32, hidden_dropout_prob=0.0,
                     attention_probs_dropout_prob=0.0, pad_token_id=0, attn_implementation="sdpa")
    return BertLogits(BertForMaskedLM(cfg)).train()


# every case trains with SGD and with AdamW from one parallelize (parallel_records: its capture is what takes
# the time). The cases cover each model, each strategy on each model that has it, and meshes (2,), (4,) and
# 2 x 2, without their cross product: each drawn case costs a capture of a Hugging Face model
CASES = [
    ("bert", "tp+sp", (2, 2)), ("bert", "auto", (2, 2)), ("bert", "ddp", (2,)),
    ("gpt2", "ddp", (2, 2)), ("gpt2", "tp", (2, 2)), ("gpt2", "fsdp+tp", (2, 2)), ("gpt2", "tp+sp", (2, 2)),
    ("gpt2", "auto", (2,)),
    ("llama-rope-no-grad", "tp", (2,)), ("llama", "fsdp+tp", (2, 2)), ("llama", "fsdp", (4,)),
    ("llama", "tp+sp", (2,)), ("llama", "auto", (2,)), ("llama-8h", "tp", (2, 2)), ("llama-8h", "tp+sp", (2, 2)),
]


def _auto_plan_under_pressure(model, idx, mesh):
    """An 'auto' plan whose memory limit lies halfway between what the fsdp plan takes and what the
    unconstrained (latency-bound, mostly replicated) plan takes, so it must shard. (The fsdp plan is a
    feasible anchor one search finds; the least memory any plan needs takes a minimizing search per
    checkpointing kind, tens of seconds here -- test_errors.py checks that figure.)"""
    both = autopar.compare(model, (idx,), mesh, hardware="cpu", strategies=["auto", "fsdp"])   # one capture
    free, least = both["auto"], both["fsdp"].predicted.memory.total
    limit = int((least + free.predicted.memory.total) / 2)
    plan = autopar.plan(model, (idx,), mesh, hardware="cpu", memory_limit=limit)
    assert plan.predicted.memory.total <= limit < free.predicted.memory.total
    return plan


@pytest.mark.parametrize("kind, strategy, mesh_shape", CASES, ids=[f"{k}-{s}-{'x'.join(map(str, m))}" for k, s, m in CASES])
def test_hf_model_trains_like_single_device(kind, strategy, mesh_shape):
    torch.manual_seed(0)
    model = {"llama": llama, "gpt2": gpt2, "llama-8h": lambda: llama(8, 4, 64), "bert": bert,
             "llama-rope-no-grad": llama_rope_under_no_grad}[kind]()
    idx, targets = torch.randint(0, 64, (4, 16)), torch.randint(0, 64, (4, 16))
    idx[:, -3:] = 0   # padding tokens (BERT's padding_idx) in every row
    names = ("dp", "tp")[:len(mesh_shape)] if len(mesh_shape) == 2 else ("tp",)
    world = 1
    for n in mesh_shape:
        world *= n
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", autopar.UnsupportedOpWarning)
        if strategy == "auto":  # planned once here (the search takes seconds), applied on every rank
            kwargs = {"plan": _auto_plan_under_pressure(model, idx, dict(zip(names, mesh_shape)))}
        else:
            kwargs = {"strategy": strategy}
        records = run_threaded(world, parallel_records, model, mesh_shape, names, idx, targets, gpt_loss,
                               OPTIMIZERS, 3, kwargs)
    check_runs_against_one_device(model, idx, targets, gpt_loss, records, OPTIMIZERS)
    plan = records[-1]["sgd"]["plan"]
    if strategy in ("tp", "tp+sp", "fsdp+tp"):  # the matrices really are split over the tp axis
        tp = plan.mesh.axis_names.index("tp")
        split = [n for n, pl in plan.param_placements.items() if pl[tp].startswith("S(")]
        assert any("mlp" in n or "intermediate" in n for n in split) and any("attn" in n or "attention" in n
                                                                             for n in split)


def test_gpt2_tied_embedding_is_one_parameter_under_both_names():
    torch.manual_seed(0)
    model = gpt2()
    plan = autopar.plan(model, (torch.randint(0, 64, (4, 16)),), {"tp": 2}, strategy="tp")
    assert "model.transformer.wte.weight" in plan.param_placements
    assert "model.lm_head.weight" not in plan.param_placements   # tied: the same tensor


def test_llama_ops_without_rules_are_named_in_a_warning():
    torch.manual_seed(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        autopar.plan(llama_rope_under_no_grad(), (torch.randint(0, 64, (4, 16)),), {"tp": 2}, strategy="tp")
    msgs = [str(w.message) for w in caught if issubclass(w.category, autopar.UnsupportedOpWarning)]
    assert len(msgs) == 1 and "wrap_with_set_grad_enabled" in msgs[0] and "model.model.rotary_emb" in msgs[0]


def test_tp_degree_that_does_not_divide_the_kv_heads_is_named_up_front():
    torch.manual_seed(0)
    with pytest.warns(autopar.DivisibilityWarning, match=r"degree 4 \(a=2 x b=2\) does not divide the 2 key/value "
                                                         r"heads.*model.model.layers.0.self_attn"):
        autopar.plan(llama(), (torch.randint(0, 64, (4, 16)),), {"a": 2, "b": 2}, strategy="tp")
    with pytest.warns(autopar.DivisibilityWarning, match=r"sequence length \(6"):
        autopar.plan(gpt2(), (torch.randint(0, 64, (4, 6)),), {"a": 4}, strategy="tp+sp")
    with warnings.catch_warnings():
        warnings.simplefilter("error", autopar.DivisibilityWarning)   # dividing heads: no warning
        autopar.plan(llama(8, 4, 64), (torch.randint(0, 64, (4, 16)),), {"a": 2, "b": 2}, strategy="tp")
