"""On a GPU: the emitted module trains like one device with CUDA tensors, in float32 and bf16-mixed.

The rest of the suite runs on CPU ranks. These tests move the same whole-model comparison
(tests/test_equivalence.py's) onto a GPU, where tensors the runtime makes without naming a device,
a CPU-only op or a dtype the GPU kernels treat differently would show; and Hugging Face Llama
called with `labels=` (its loss inside forward) with SGD. All ranks are threads of
this process sharing one GPU (run_threaded), so one GPU is enough; NCCL itself is not exercised
(benchmarks/runtime_overhead.py --device cuda is, on as many GPUs as ranks).

CI has no GPU: there these tests are skipped. Run them on a GPU machine with
`pytest tests/test_cuda.py`.

Tolerance: float32 GEMMs on a GPU pick their kernel, and with it the order of a sum, by shape; a
sharded matmul and the whole one then differ by ~1e-6 relative, more than the CPU's exact
agreement. TF32 is off (PyTorch's default for matmuls), so 1e-4 still catches a gradient averaged
wrongly (a factor of 2 or 3) or an update applied to the wrong shard (~lr = 1e-2 with SGD).
"""
from __future__ import annotations

import copy
import math

import pytest
import torch

from autopar.testing import GPT, GPTConfig, gpt_loss, parallel_record, run_threaded, single_device_reference

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CI has none)")

CFG = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32, dropout=0.0)
ATOL = 1e-4
STEPS = 3
LR = {torch.optim.SGD: 1e-2, torch.optim.AdamW: 1e-4}

CASES = [("ddp", (2,), ("dp",)), ("fsdp", (2,), ("dp",)), ("fsdp", (3,), ("dp",)), ("zero2", (2,), ("dp",)),
         ("tp", (2,), ("tp",)), ("tp+sp", (2,), ("tp",)), ("fsdp+tp", (2, 2), ("dp", "tp"))]


def _model_and_batch():
    torch.manual_seed(0)
    model = GPT(CFG)
    x = torch.randint(0, CFG.vocab_size, (6, CFG.block_size))
    y = torch.randint(0, CFG.vocab_size, (6, CFG.block_size))
    return model, x, y


@pytest.mark.parametrize("optimizer", [torch.optim.SGD, torch.optim.AdamW], ids=["sgd", "adamw"])
@pytest.mark.parametrize("strategy, shape, axes", CASES, ids=[f"{s}-{'x'.join(map(str, m))}" for s, m, _ in CASES])
def test_gpt_on_a_gpu_trains_like_one_gpu(strategy, shape, axes, optimizer):
    model, x, y = _model_and_batch()
    ref = single_device_reference(lambda: copy.deepcopy(model).cuda(), x.cuda(), y.cuda(), gpt_loss,
                                  STEPS, LR[optimizer], optimizer=optimizer)
    res = run_threaded(math.prod(shape), parallel_record, model, shape, axes, x, y, gpt_loss, STEPS,
                       LR[optimizer], {"strategy": strategy}, optimizer, "cuda", timeout=300)
    plan = res[0]["plan"]
    for rank, r in enumerate(res):
        assert r["outputs"].is_cuda, f"rank {rank}: outputs on {r['outputs'].device}"
        (expected,) = plan.local_targets(ref["outputs"], rank=rank)
        torch.testing.assert_close(r["outputs"], expected, atol=ATOL, rtol=0,
                                   msg=lambda m: f"{strategy} rank {rank} outputs: {m}")
        assert r["grads"].keys() == ref["grads"].keys()
        for name, g in ref["grads"].items():
            torch.testing.assert_close(r["grads"][name].to(g.device), g, atol=ATOL, rtol=0,
                                       msg=lambda m: f"{strategy} rank {rank} grad of {name}: {m}")
        for name, p in ref["params"].items():
            assert r["params"][name].is_cuda, f"rank {rank}: {name} on {r['params'][name].device}"
            torch.testing.assert_close(r["params"][name], p, atol=ATOL, rtol=0,
                                       msg=lambda m: f"{strategy} rank {rank} {name} after {STEPS} steps: {m}")
    for step in range(STEPS):   # equal batch shards: the mean of the local losses is the global loss
        mean = sum(r["losses"][step] for r in res) / len(res)
        assert mean == pytest.approx(ref["losses"][step], abs=ATOL, rel=0), f"{strategy} loss of step {step + 1}"


def _train_bf16(rank, model, strategy, shape, axes, x, y, steps):
    import autopar
    from torch.distributed.device_mesh import init_device_mesh
    pm = autopar.parallelize(copy.deepcopy(model).cuda(), init_device_mesh("cuda", shape, mesh_dim_names=axes),
                             (x.cuda(),), strategy=strategy, precision="bf16-mixed")
    opt = autopar.ShardedOptimizer(pm, torch.optim.AdamW, lr=3e-3)
    (local_x,), (local_y,) = pm.plan.local_inputs(x.cuda()), pm.plan.local_targets(y.cuda())
    losses = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        logits = pm(local_x)
        loss = gpt_loss(logits, local_y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, logits.dtype, {p.dtype for p in pm.parameters()}


@pytest.mark.parametrize("strategy, shape, axes", [("ddp", (2,), ("dp",)), ("fsdp", (2,), ("dp",)),
                                                   ("tp", (2,), ("tp",)), ("fsdp+tp", (2, 2), ("dp", "tp"))])
def test_bf16_mixed_on_a_gpu_trains_within_bf16_tolerance_of_float32(strategy, shape, axes):
    model, x, y = _model_and_batch()
    steps = 20
    ref = single_device_reference(lambda: copy.deepcopy(model).cuda(), x.cuda(), y.cuda(), gpt_loss,
                                  steps, 3e-3, optimizer=torch.optim.AdamW)
    results = run_threaded(math.prod(shape), _train_bf16, model, strategy, shape, axes, x, y, steps, timeout=300)
    losses = torch.tensor([r[0] for r in results]).mean(0)
    want = torch.tensor(ref["losses"])
    assert losses[-1] < 0.9 * losses[0]
    torch.testing.assert_close(losses, want, rtol=0.03, atol=0)   # bf16: ~0.4% per op, as on the CPU
    for _, logits_dtype, param_dtypes in results:
        assert logits_dtype == torch.bfloat16 and param_dtypes == {torch.float32}


def _train_with_labels(rank, model, inputs, strategy, shape, axes, steps):
    import autopar
    from torch.distributed.device_mesh import init_device_mesh
    inputs = tuple(t.cuda() for t in inputs)
    pm = autopar.parallelize(copy.deepcopy(model).cuda(), init_device_mesh("cuda", shape, mesh_dim_names=axes),
                             inputs, strategy=strategy)
    opt = autopar.ShardedOptimizer(pm, torch.optim.SGD, lr=LR[torch.optim.SGD])
    local = pm.plan.local_inputs(*inputs)
    losses = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = pm(*local).loss
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.clone() for k, v in pm.state_dict(full=True).items()}


@pytest.mark.parametrize("strategy, shape, axes", [("fsdp+tp", (2, 2), ("dp", "tp")), ("tp+sp", (2,), ("tp",))])
def test_hf_llama_called_with_labels_on_a_gpu_trains_like_one_gpu(strategy, shape, axes):
    """A model written elsewhere, used as its authors use it: Hugging Face Llama computing its loss from
    `labels=` inside forward (some ignored), with SGD, which a wrong gradient scale would move off."""
    pytest.importorskip("transformers")
    from autopar.testing import WithLabels, tiny_llama
    torch.manual_seed(0)
    model = WithLabels(tiny_llama().model)
    x = torch.randint(0, 64, (8, 16))
    labels = x.clone()
    labels[1, :13] = -100   # ignored targets, unevenly spread over the batch shards
    ref_model = copy.deepcopy(model).cuda()
    opt = torch.optim.SGD(ref_model.parameters(), lr=LR[torch.optim.SGD])
    ref_losses = []
    for _ in range(STEPS):
        opt.zero_grad(set_to_none=True)
        loss = ref_model(x.cuda(), labels.cuda()).loss
        loss.backward()
        opt.step()
        ref_losses.append(loss.item())
    results = run_threaded(math.prod(shape), _train_with_labels, model, (x, labels), strategy, shape, axes, STEPS,
                           timeout=300)
    for rank, (losses, params) in enumerate(results):
        assert losses == pytest.approx(ref_losses, abs=ATOL), f"{strategy} rank {rank} losses"
        for name, p in ref_model.named_parameters():
            torch.testing.assert_close(params[name], p.detach(), atol=ATOL, rtol=0,
                                       msg=lambda m: f"{strategy} rank {rank} {name} after {STEPS} steps: {m}")


# ---------------------------------------------------------------- context parallelism's ring (issue 39)

def test_ring_attention_on_a_gpu_equals_one_gpu_attention():
    """The ring on 2 threaded ranks sharing one GPU against SDPA on the whole sequence: float32 to 1e-4, and bf16
    inputs (its scores and merges in fp32) against float32 SDPA on the same values to 2e-2; causal, not causal,
    and with a padded batch's boolean mask (left-padded rows see no key: against CPU SDPA, which gives them 0,
    as CUDA kernels need not)."""
    import torch.distributed as dist
    import torch.nn.functional as F

    from autopar.runtime.collectives import AxisGroup, Comm
    from autopar.runtime.lowering.ring_attention import RingAttention
    n, L = 2, 64
    torch.manual_seed(0)
    pos = torch.arange(L)
    padded = ((pos[None, None, :] >= torch.tensor([0, 40])[:, None, None]) & (pos[None, :] <= pos[:, None]))[:, None]
    cases = []
    for dtype, atol in ((torch.float32, 1e-4), (torch.bfloat16, 2e-2)):
        for causal, mask in ((False, None), (True, None), (False, padded)):
            q, k, v = (torch.randn(2, 4, L, 32, device="cuda").to(dtype) for _ in range(3))
            grad = torch.randn(2, 4, L, 32, device="cuda").to(dtype)
            device = "cuda" if mask is None else "cpu"
            whole = [t.detach().float().to(device).requires_grad_() for t in (q, k, v)]
            F.scaled_dot_product_attention(*whole, attn_mask=mask, is_causal=causal).backward(grad.float().to(device))
            cases.append((causal, mask, atol, (q, k, v), grad, whole))

    def rank_fn(rank):
        out = []
        for causal, mask, _, qkv, grad, _ in cases:
            local = [t.chunk(n, -2)[rank].clone().requires_grad_() for t in qkv]
            rows = () if mask is None else (mask.chunk(n, -2)[rank].cuda(),)
            y = RingAttention(Comm([AxisGroup(dist.group.WORLD, n, rank)]), 0, causal, None, False)(*local, *rows)
            y.backward(grad.chunk(n, -2)[rank])
            out.append((y.detach(), *(t.grad for t in local)))
        return out

    for rank, results in enumerate(run_threaded(n, rank_fn)):
        for (causal, mask, atol, _, _, whole), got in zip(cases, results):
            want = F.scaled_dot_product_attention(*[t.detach() for t in whole], attn_mask=mask, is_causal=causal)
            for g, w in zip(got, (want, *(t.grad for t in whole))):
                assert g.is_cuda
                torch.testing.assert_close(g.float().cpu(), w.chunk(n, -2)[rank].cpu(), atol=atol, rtol=0)


def test_gpt_with_ring_attention_on_a_gpu_trains_like_one_gpu():
    """Our GPT on 3 threaded ranks of one GPU, its causal attention a balanced ring (2 heads: no Ulysses on 3;
    cp links free but for all-gathers and all-to-alls: no gather), with AdamW, as the CPU test does
    (tests/test_context_parallel.py). (On free links the h100 preset, a CUDA mesh's default, gathers K/V.)"""
    import cost_models as cm
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=12, n_layer=2, n_head=2, n_embd=32, dropout=0.0))
    x, y = torch.randint(0, 64, (2, 12)), torch.randint(0, 64, (2, 12))
    ref = single_device_reference(lambda: copy.deepcopy(model).cuda(), x.cuda(), y.cuda(), gpt_loss, STEPS,
                                  LR[torch.optim.AdamW], optimizer=torch.optim.AdamW)
    dear = cm.Link(bandwidth=1e3, latency=1.0)
    links = cm.Link(bandwidth=1e12, latency=1e-12, kinds={cm.ALL_GATHER: dear, cm.ALL_TO_ALL: dear})
    kwargs = {"strategy": "cp", "links": {"cp": links}}
    res = run_threaded(3, parallel_record, model, (3,), ("cp",), x, y, gpt_loss, STEPS, LR[torch.optim.AdamW],
                       kwargs, torch.optim.AdamW, "cuda", timeout=300)
    attention = [s for n, s in res[0]["plan"].node_strategies.items() if n.startswith("scaled_dot_product")]
    assert attention and all(s.inputs[1] == ("S(2)",) for s in attention), attention
    for rank, r in enumerate(res):
        for name, p in ref["params"].items():
            torch.testing.assert_close(r["params"][name], p, atol=ATOL, rtol=0,
                                       msg=lambda m: f"cp ring rank {rank} {name} after {STEPS} steps: {m}")
