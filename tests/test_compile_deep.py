"""torch.compile(pm) on a 10-layer model: one graph however deep, nothing compiled again after the first step,
and it trains as one device does.

Eagerly, FSDP's layer groups gather a layer's weights in one flat all-gather and set the gradients when
backward ends, and saved-tensor hooks gather a kept-as-shard tensor again in backward: Python state the
compiler cannot trace (before, a 16-layer fsdp model broke into a graph per layer and hit dynamo's recompile
limit at the hooks, which then ran it eagerly). Compiled, each layout change is its steps alone, as
functional collectives in the graph, and a gather backward must repeat runs as a region whose ops backward
recomputes (rewrite.RedistributeModule._compiled): the compiled backward keeps the shard and gathers again.

Backend: aot_eager (aot_autograd with graphs run as traced), so the forward and backward graphs can be read:
torch._dynamo.utils.counters counts the graphs dynamo made, and a backend that is called again for a frame is
a recompile. Ranks are threads of this process (run_threaded), their modules separate entries of one cache.

CI runs CI_CASES (ddp; fsdp, whose backward must gather again; tp+sp with every block recomputed); the
thorough profile (HYPOTHESIS_PROFILE=thorough) runs ddp, fsdp, tp, tp+sp and fsdp+tp, each with and without
activation checkpointing (fsdp+tp on 2x2 threads takes ~2 minutes on 2 cores). Beside them: Hugging Face
Llama as shipped, compiled, with SGD and AdamW; and what record_comm says under compile.
"""
from __future__ import annotations

import copy
import os
import warnings

import pytest
import torch

import autopar
from autopar.testing import GPT, GPTConfig, gpt_loss, padded_batch, run_threaded, shipped_causal_lm
from autopar.testing.harness import check_keyword_training, single_device_reference

N_LAYER = 10
STEPS = 3
LR = 0.5
ATOL = 1e-5
ALL_CASES = [(s, c) for s in ("ddp", "fsdp", "tp", "tp+sp", "fsdp+tp") for c in ("none", "full")]
CI_CASES = [("ddp", "none"), ("fsdp", "none"), ("tp+sp", "full")]
CASES = ALL_CASES if os.environ.get("HYPOTHESIS_PROFILE") == "thorough" else CI_CASES
GATHER = "_c10d_functional.all_gather_into_tensor"


def _gpt():
    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=N_LAYER, n_head=2, n_embd=16, vocab_size=32, block_size=8)
    return GPT(cfg), torch.randint(0, 32, (8, 8)), torch.randint(0, 32, (8, 8))


def _mesh(strategy: str):
    from torch.distributed.device_mesh import init_device_mesh
    if strategy == "fsdp+tp":
        return init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    return init_device_mesh("cpu", (2,), mesh_dim_names=("tp",) if strategy.startswith("tp") else ("dp",))


def _rank(rank, model, x, y, strategy, checkpointing):
    import torch.distributed as dist
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    pm = autopar.parallelize(copy.deepcopy(model), _mesh(strategy), (x,), strategy=strategy,
                             checkpointing=checkpointing)
    dist.barrier()   # no rank traces (export) while another compiles: torch's tracing state is process-wide
    made = {"dynamo": 0, "forward": [], "backward": []}

    def keep(kind):
        def compiler(gm, example_inputs):
            made[kind].append(gm)
            return make_boxed_func(gm.forward)
        return compiler
    inner = aot_autograd(fw_compiler=keep("forward"), bw_compiler=keep("backward"))

    def backend(gm, example_inputs):
        made["dynamo"] += 1
        return inner(gm, example_inputs)
    run = torch.compile(pm, backend=backend)
    opt = torch.optim.SGD(pm.parameters(), lr=LR)
    (xi,), (yi,) = pm.plan.local_inputs(x), pm.plan.local_targets(y)
    per_step, losses = [], []
    for _ in range(STEPS):
        before = made["dynamo"]
        opt.zero_grad()
        loss = gpt_loss(run(xi), yi)
        loss.backward()
        opt.step()
        per_step.append(made["dynamo"] - before)
        losses.append(loss.item())

    def count(kind, prefix):
        return sum(1 for gm in made[kind] for n in gm.graph.nodes
                   if n.op == "call_function" and str(n.target).startswith(prefix))
    return {"per_step": per_step, "losses": losses, "params": pm.state_dict(full=True),
            "gathers": (count("forward", GATHER), count("backward", GATHER)),
            "batch_axes": pm.plan.batch_axes}


@pytest.mark.parametrize("strategy, checkpointing", CASES, ids=[f"{s}-{c}" for s, c in CASES])
def test_a_deep_model_compiles_to_one_graph_and_trains_as_one_device(strategy, checkpointing):
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model, x, y = _gpt()
    ref = single_device_reference(lambda: copy.deepcopy(model), x, y, gpt_loss, steps=STEPS, lr=LR,
                                  optimizer=torch.optim.SGD)
    ref_losses, ref_params = ref["losses"], ref["params"]
    world = 4 if strategy == "fsdp+tp" else 2
    res = run_threaded(world, _rank, model, x, y, strategy, checkpointing, timeout=600)
    for rank, r in enumerate(res):
        # one graph at the first step, none after: no graph break per layer, no recompile
        assert r["per_step"] == [1] + [0] * (STEPS - 1), (rank, r["per_step"])
        for n, p in ref_params.items():
            torch.testing.assert_close(r["params"][n], p, atol=ATOL, rtol=0, msg=lambda m: f"{n}: {m}")
        fwd_gathers, bwd_gathers = r["gathers"]
        if strategy in ("fsdp", "fsdp+tp"):
            # every layer's weights are gathered in forward and, kept as shards, gathered again in backward
            assert fwd_gathers >= N_LAYER and bwd_gathers >= N_LAYER, r["gathers"]
        if strategy == "ddp":
            assert r["gathers"] == (0, 0)
    if not res[0]["batch_axes"]:   # the same loss on every rank where the batch is not split
        assert all(abs(a - b) <= ATOL for a, b in zip(res[0]["losses"], ref_losses)), (res[0]["losses"], ref_losses)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == world


def test_hugging_face_llama_as_shipped_compiled_trains_as_one_device():
    """A model written elsewhere, used as its authors use it: HF Llama from its default config (use_cache=True),
    called with keywords and `labels=` on a padded batch, compiled, under fsdp+tp on 2 x 2 ranks; its losses
    and parameters after 3 steps of SGD and of AdamW equal one device's (tests/test_hf_as_shipped.py's runs)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = shipped_causal_lm("llama")
    batch = padded_batch(vocab=model.config.vocab_size)
    runs = {"sgd": (torch.optim.SGD, 0.5), "adamw": (torch.optim.AdamW, 1e-3)}
    check_keyword_training(model, batch, "fsdp+tp", runs, {"sgd": 1e-5, "adamw": 2e-4}, mesh_shape=(2, 2),
                           compile_backend="aot_eager")


def test_record_comm_under_compile_says_what_it_misses_or_refuses():
    """The op that logs a launch cannot be recomputed by the compiler: a compiled fsdp module's log lacks
    backward's re-gathers, which it says once; a checkpointed plan, whose blocks backward recomputes whole,
    is refused by name rather than failing deep inside inductor."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=16, vocab_size=32, block_size=8))
    x, y = torch.randint(0, 32, (8, 8)), torch.randint(0, 32, (8, 8))

    def rank(r, model, x, y):
        out = {}
        for checkpointing in ("none", "full"):
            pm = autopar.parallelize(copy.deepcopy(model), _mesh("fsdp"), (x,), strategy="fsdp", record_comm=True,
                                     checkpointing=checkpointing)
            run = torch.compile(pm, backend="aot_eager")
            (xi,), (yi,) = pm.plan.local_inputs(x), pm.plan.local_targets(y)
            try:
                for _ in range(3):
                    gpt_loss(run(xi), yi).backward()
            except autopar.PlanError as e:
                out[checkpointing] = str(e)
        return out
    # recorded here, around the ranks: warnings' filters are process-wide, and a rank that entered and left
    # catch_warnings would reset another's
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        results = run_threaded(2, rank, model, x, y, timeout=300)
    said = [str(w.message) for w in caught if "record_comm under torch.compile" in str(w.message)]
    assert len(said) == 2, said   # once for each rank's fsdp module, not once a step
    for out in results:
        assert "none" not in out, out
        assert "cannot log the collectives of the checkpointed blocks (h)" in out["full"], out
