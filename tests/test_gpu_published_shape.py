"""benchmarks/gpu_published_shape.py: torchtitan's per-op selective AC policy as it writes it (every second mm
of a block recomputed, forward and recompute counted apart), and the whole script at its CPU smoke shape (the
GPU measurement itself runs in scripts/gpu_check.sh's `published` section)."""
import math
import os
import pathlib
import socket
import subprocess
import sys
from collections import defaultdict
from types import SimpleNamespace

import torch
from torch.utils.checkpoint import CheckpointPolicy

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
import gpu_published_shape as bench  # noqa: E402

aten = torch.ops.aten
SAVE, RECOMPUTE = CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_RECOMPUTE


def llama_block_ops(attention):
    """A Llama block's ops as a dispatch mode sees them, in order: q, k, v projections, attention, o, then the
    MLP's gate, up, down (the mms numbered 1 to 7), with the elementwise ops between."""
    mm = aten.mm.default
    return [aten._to_copy.default, aten.pow.Tensor_Scalar, aten.mean.dim, aten.rsqrt.default, aten.mul.Tensor,
            mm, mm, mm, aten.mul.Tensor, aten.cat.default, attention, mm, aten.add.Tensor,
            aten.mul.Tensor, mm, aten.silu.default, mm, aten.mul.Tensor, mm, aten.add.Tensor]


def decide(policy, ops, recompute: bool):
    ctx = SimpleNamespace(is_recompute=recompute)
    return [policy(ctx, op) for op in ops]


def test_policy_saves_odd_mms_and_the_attention_kernel():
    for attention in (aten._scaled_dot_product_flash_attention.default,
                      aten._scaled_dot_product_efficient_attention.default):
        ops = llama_block_ops(attention)
        policy = bench.sac_policy(defaultdict(int))   # one checkpointed call: one block
        # forward, then the rerun in backward: counted apart, so the rerun decides as the forward did (a shared
        # count would start the rerun at mm #8 and flip every choice)
        for recompute in (False, True):
            got = decide(policy, ops, recompute)
            saved = [i for i, (op, d) in enumerate(zip(ops, got)) if d == SAVE]
            mm_at = [i for i, op in enumerate(ops) if op == aten.mm.default]
            assert saved == sorted([mm_at[0], mm_at[2], mm_at[4], mm_at[6], ops.index(attention)])
            assert all(d in (SAVE, RECOMPUTE) for d in got)
            assert got.count(RECOMPUTE) == len(ops) - 5


def test_policy_counts_afresh_per_block_and_saves_the_listed_ops():
    ops = llama_block_ops(aten._scaled_dot_product_flash_attention.default)
    first = decide(bench.sac_policy(defaultdict(int)), ops, False)
    second = decide(bench.sac_policy(defaultdict(int)), ops, False)   # the next block's context: a fresh count
    assert first == second
    policy = bench.sac_policy(defaultdict(int))
    assert decide(policy, [aten.max.default, aten.add.Tensor, aten.bmm.default,
                           aten._scaled_dot_product_cudnn_attention.default], False) == [SAVE, RECOMPUTE, RECOMPUTE,
                                                                                           RECOMPUTE]
    assert aten.mm.default in bench.sac_save_ops() and aten.addmm.default not in bench.sac_save_ops()


def test_policy_on_a_real_decoder_layer():
    """Run a tiny HF Llama decoder layer under checkpoint with the policy's context and read what it decided."""
    args = bench.parse_args(["--cpu-smoke"])
    model = bench.build(bench.config(args), torch.device("cpu"))
    layer = model.model.model.layers[0]
    log = []
    wrapped = bench.Checkpointed(layer, lambda: bench.logging_sac_context_fn(log))
    x = torch.randn(2, 16, 64, requires_grad=True)
    positions = torch.arange(16)[None]
    rope = model.model.model.rotary_emb(x, positions)
    wrapped(x, attention_mask=None, position_embeddings=rope, position_ids=positions).sum().backward()
    forward = [(op, saved) for mode, op, saved in log if mode == "forward"]
    mms = [saved for op, saved in forward if op == aten.mm.default]
    assert mms == [True, False, True, False, True, False, True]
    assert not any(saved for op, saved in forward if op != aten.mm.default)   # CPU's attention op is not listed
    rerun = [saved for mode, op, saved in log if mode == "recompute" and op == aten.mm.default]
    # torch 2.13 asks the policy in forward only (the rerun replays forward's decisions by index); a torch that
    # asks again in the rerun must decide as forward did
    assert rerun == mms[:len(rerun)]
    assert bench.policy_summary(log).startswith("per-op policy, first block's forward: 7 mm, saved mm #1, #3, #5, #7")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_cpu_smoke_prints_the_table():
    env = dict(os.environ, MASTER_PORT=str(_free_port()), PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="")
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_published_shape.py"), "--cpu-smoke"],
                         capture_output=True, text=True, timeout=170, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    lines = out.stdout.splitlines()
    head = lines.index(next(line for line in lines if line.startswith("| side | measured ms | predicted ms")))
    rows = {}
    for line in lines[head + 2:]:
        if not line.startswith("| "):
            break
        rows[line.split("|")[1].strip()] = [c.strip() for c in line.split("|")[2:-1]]
    assert set(rows) == set(bench.SIDES)
    for side, (measured, predicted, ratio, alloc, reserved, predicted_gib, *_rest) in rows.items():
        assert float(measured) > 0 and float(predicted) > 0, side
        assert math.isfinite(float(ratio)) and float(ratio) > 0, side
        assert alloc == reserved == "-"   # no CUDA memory on CPU
    assert "compile gain (1 - compiled / eager step): measured" in out.stdout
    assert "per-op-compiled ran with fullgraph=True" in out.stdout
    assert "saved mm #1, #3, #5, #7" in out.stdout
