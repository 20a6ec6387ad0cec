"""autopar.testing: threaded and gloo runners, toy models, the single-device reference."""

import threading
import time

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from autopar._compat import destroy_process_group_if_initialized, init_fake_process_group
from autopar.testing import (GPT, MLP, GPTConfig, RankError, run_gloo, run_threaded,
                             single_device_reference)


# --- run_threaded -----------------------------------------------------------

def _mesh_all_reduce(rank):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))
    t = torch.tensor([float(rank)])
    dist.all_reduce(t, group=mesh.get_group("a"))
    return rank, tuple(mesh.get_coordinate()), t.item()


def test_run_threaded_all_reduce_over_mesh_axis():
    results = run_threaded(4, _mesh_all_reduce)
    # mesh [[0, 1], [2, 3]]: axis "a" groups ranks {0, 2} and {1, 3}
    assert results == [(0, (0, 0), 2.0), (1, (0, 1), 4.0), (2, (1, 0), 2.0), (3, (1, 1), 4.0)]


def _sub_group_collectives(rank):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))
    ga, gb = mesh.get_group("a"), mesh.get_group("b")
    gathered = torch.empty(4)
    dist.all_gather_into_tensor(gathered, torch.full((2,), float(rank)), group=ga)
    scattered = torch.empty(2)
    dist.reduce_scatter_tensor(scattered, torch.arange(4.0) + 10 * rank, group=gb)
    swapped = torch.empty(4)
    dist.all_to_all_single(swapped, torch.arange(4.0) + 10 * rank, group=ga)
    # backward inside the thread, then a DDP-style gradient all-reduce
    w = torch.ones(3, requires_grad=True)
    (w * (rank + 1)).sum().backward()
    dist.all_reduce(w.grad, group=gb)
    return gathered, scattered, swapped, w.grad


@pytest.mark.filterwarnings("ignore::FutureWarning")  # *_into_tensor renamed in torch 2.13
def test_run_threaded_sub_group_collectives_and_autograd():
    out = run_threaded(4, _sub_group_collectives)
    t = torch.tensor
    expect = [  # rank: (all_gather on a, reduce_scatter on b, all_to_all on a, grad summed on b)
        (t([0., 0, 2, 2]), t([10., 12]), t([0., 1, 20, 21]), t([3., 3, 3])),
        (t([1., 1, 3, 3]), t([14., 16]), t([10., 11, 30, 31]), t([3., 3, 3])),
        (t([0., 0, 2, 2]), t([50., 52]), t([2., 3, 22, 23]), t([7., 7, 7])),
        (t([1., 1, 3, 3]), t([54., 56]), t([12., 13, 32, 33]), t([7., 7, 7])),
    ]
    for rank, (got, want) in enumerate(zip(out, expect)):
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, msg=lambda m: f"rank {rank}: {m}")


def _fail_on_rank_1(rank):
    if rank == 1:
        raise ValueError("boom on purpose")
    t = torch.ones(1)
    dist.all_reduce(t)  # the others wait here for rank 1, which never comes
    return t


def test_run_threaded_exception_propagates_without_hanging():
    start = time.monotonic()
    with pytest.raises(RankError, match="rank 1 .*boom on purpose") as info:
        run_threaded(4, _fail_on_rank_1, timeout=60)
    assert info.value.rank == 1
    assert isinstance(info.value.__cause__, ValueError)
    assert time.monotonic() - start < 30  # woken, not timed out
    # the threaded world is reset: a fresh run works and leaves no group behind
    assert run_threaded(2, lambda rank: rank * 10) == [0, 10]
    assert not dist.is_initialized()
    assert torch.is_grad_enabled() and torch._C._is_multithreading_enabled()


def _fail_before_mesh(rank):
    if rank == 3:
        raise KeyError("no mesh for me")
    # the others block in new_group's store barrier, not in a collective
    init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))


def test_run_threaded_failure_wakes_ranks_creating_groups():
    start = time.monotonic()
    with pytest.raises(RankError, match="rank 3 .*no mesh for me"):
        run_threaded(4, _fail_before_mesh, timeout=60)
    assert time.monotonic() - start < 30
    assert [t for t in threading.enumerate() if t.name.startswith("autopar-rank")] == []


def _rank_0_skips_collective(rank):
    if rank != 0:
        dist.all_reduce(torch.ones(1))


def test_run_threaded_deadlock_times_out():
    with pytest.raises(RankError, match="did not finish within"):
        run_threaded(2, _rank_0_skips_collective, timeout=3)
    assert run_threaded(2, lambda rank: rank) == [0, 1]


def test_fake_process_group_builds_a_1000_rank_mesh():
    init_fake_process_group(1000, rank=7)
    try:
        mesh = init_device_mesh("cpu", (8, 125), mesh_dim_names=("tp", "dp"))
        assert tuple(mesh.get_coordinate()) == (0, 7)
        assert mesh.get_group("dp").size() == 125 and mesh.get_group("tp").size() == 8
    finally:
        destroy_process_group_if_initialized()
    assert not dist.is_initialized()


# --- run_gloo ---------------------------------------------------------------
# workers are module-level: run_gloo spawns processes, which unpickle them by name

def _gloo_all_reduce(rank, scale):
    t = torch.full((3,), float(rank + 1)) * scale
    dist.all_reduce(t)
    return {"rank": dist.get_rank(), "world": dist.get_world_size(), "sum": t}


def test_run_gloo_all_reduce():
    out = run_gloo(2, _gloo_all_reduce, 10.0, timeout=120)
    assert [o["rank"] for o in out] == [0, 1] and [o["world"] for o in out] == [2, 2]
    for o in out:
        torch.testing.assert_close(o["sum"], torch.full((3,), 30.0))


def _gloo_fail_on_rank_1(rank):
    if rank == 1:
        raise ValueError("gloo rank 1 fails on purpose")
    dist.barrier()  # rank 0 blocks here until run_gloo kills it


def test_run_gloo_reports_the_failing_rank_traceback():
    with pytest.raises(RankError, match="rank 1 ") as info:
        run_gloo(2, _gloo_fail_on_rank_1, timeout=120)
    assert info.value.rank == 1
    assert "Traceback" in str(info.value) and "gloo rank 1 fails on purpose" in str(info.value)


# --- models and reference ---------------------------------------------------

def test_gpt_forward_shape_and_export_with_dynamic_batch():
    cfg = GPTConfig()
    torch.manual_seed(0)
    model = GPT(cfg)
    idx = torch.randint(0, cfg.vocab_size, (3, cfg.block_size))
    assert model(idx).shape == (3, cfg.block_size, cfg.vocab_size)
    names = dict(model.named_parameters())
    assert {"h.0.attn.q.weight", "h.0.attn.k.weight", "h.0.attn.v.weight",
            "h.0.attn.o.weight", "h.1.fc.weight", "h.1.proj.weight", "ln_f.weight",
            "lm_head.weight"} <= names.keys() and "lm_head.bias" not in names

    batch = torch.export.Dim("batch")
    ep = torch.export.export(model, (idx,), dynamic_shapes={"idx": {0: batch}}, strict=False)
    other = torch.randint(0, cfg.vocab_size, (5, cfg.block_size))
    torch.testing.assert_close(ep.module()(other), model(other))


def test_mlp_shapes_and_activation():
    torch.manual_seed(0)
    mlp = MLP([8, 16, 4], activation="relu")
    assert mlp(torch.randn(2, 3, 8)).shape == (2, 3, 4)
    assert [type(m).__name__ for m in mlp.layers] == ["Linear", "ReLU", "Linear"]
    with pytest.raises(ValueError, match="activation"):
        MLP([8, 4], activation="tanh")


def test_single_device_reference_records_first_step_and_trains():
    def model_fn():
        torch.manual_seed(0)
        return MLP([4, 16, 1])

    torch.manual_seed(1)
    x = torch.randn(32, 4)
    y = x.sum(dim=1, keepdim=True)
    ref = single_device_reference(model_fn, x, y, torch.nn.functional.mse_loss, steps=5)

    losses = ref["losses"]
    assert len(losses) == 5 and all(b < a for a, b in zip(losses, losses[1:]))
    # outputs and grads are from step 1, params from after the last step
    fresh = model_fn()
    torch.testing.assert_close(ref["outputs"], fresh(x).detach())
    torch.nn.functional.mse_loss(fresh(x), y).backward()
    for name, p in fresh.named_parameters():
        torch.testing.assert_close(ref["grads"][name], p.grad)
        assert not torch.equal(ref["params"][name], p.detach())
    assert ref["grads"].keys() == ref["params"].keys() == dict(fresh.named_parameters()).keys()
