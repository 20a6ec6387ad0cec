"""The rates one GPU reaches on the kernels a training step is made of, for the cost model's presets.

    python benchmarks/gpu_kernels.py               # the 0.886B Llama's shapes of gpu_step.py, on this GPU
    python benchmarks/gpu_kernels.py --device cpu --tokens 256 --hidden 64 --inter 128 --vocab 256   # smoke

autopar prices compute per op class (cost/terms.py): a matmul at the dtype's FLOP/s, attention at
`attention_efficiency` of it, a memory-bound op at memory bandwidth. A datasheet peak is not what a
step reaches, so this prints what each class reaches at the shapes of gpu_step.py's model (8192 tokens,
hidden 2048, intermediate 5632, vocabulary 32000, bf16): each matmul of a layer as forward and the two
backward products run it, flash attention forward + backward (counted as the cost model counts it),
elementwise bandwidth (a bf16 add and an fp32 cast), and AdamW's step over the model's fp32 weights
(foreach, as torch.optim picks on CUDA). Then autopar.calibrate's own figures on a mesh of this device.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.nn.functional as F


def timed(fn, device: str, repeats: int = 10) -> float:
    """Median seconds of fn() after two warm-up calls."""
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    for _ in range(2):
        fn()
    sync()
    times = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def matmuls(args, dtype) -> list:
    """(name, m, k, n, TFLOP/s) for a layer's linears as forward, grad-input and grad-weight run them."""
    t, h, kv = args.tokens, args.hidden, args.hidden // 2
    layers = {"q/o proj": (h, h), "k/v proj": (h, kv), "mlp up/gate": (h, args.inter),
              "mlp down": (args.inter, h), "lm head": (h, args.vocab)}
    rows = []
    for name, (k_in, n_out) in layers.items():
        for phase, (m, k, n) in (("forward", (t, k_in, n_out)), ("grad input", (t, n_out, k_in)),
                                 ("grad weight", (k_in, t, n_out))):
            a = torch.randn(m, k, device=args.device, dtype=dtype)
            b = torch.randn(k, n, device=args.device, dtype=dtype)
            s = timed(lambda: a @ b, args.device)
            rows.append((f"{name} {phase}", m, k, n, 2 * m * k * n / s / 1e12))
    return rows


def attention(args, dtype, explicit_mask: bool = False) -> float:
    """TFLOP/s of causal SDPA forward + backward, counted as the cost model counts it: 3 x (QK^T + PV).
    `explicit_mask`: the causal mask passed as a bool tensor, as a traced HF model passed it before
    capture/causal_masks.py (CUDA then runs the memory-efficient kernel, not flash)."""
    b, heads, s, d = args.tokens // args.seq, args.hidden // 128, args.seq, 128
    q, k, v = (torch.randn(b, heads, s, d, device=args.device, dtype=dtype, requires_grad=True) for _ in range(3))
    mask = torch.ones(s, s, dtype=torch.bool, device=args.device).tril().expand(b, 1, s, s)

    def step():
        if explicit_mask:
            F.scaled_dot_product_attention(q, k, v, attn_mask=mask).sum().backward()
        else:
            F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
    return 3 * 4 * b * heads * s * s * d / timed(step, args.device) / 1e12


def bandwidth(args) -> dict:
    """GB/s of a bf16 add (two reads, one write) and an fp32 -> bf16 cast, each over 256 MiB of output."""
    n = 128 * 2**20
    x, y = (torch.randn(n, device=args.device, dtype=torch.bfloat16) for _ in range(2))
    z = torch.randn(n, device=args.device)
    return {"bf16 add": 3 * 2 * n / timed(lambda: x + y, args.device) / 1e9,
            "fp32->bf16 cast": 6 * n / timed(lambda: z.to(torch.bfloat16), args.device) / 1e9}


def adamw(args) -> tuple:
    """(ms, GB/s) of AdamW's foreach step over weights of the model's size in fp32, in 16 x 9 tensors."""
    numel = args.params // (16 * 9)
    params = [torch.nn.Parameter(torch.randn(numel, device=args.device)) for _ in range(16 * 9)]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(params, lr=1e-5)
    s = timed(opt.step, args.device, repeats=5)
    # reads weight, grad, exp_avg, exp_avg_sq; writes weight, exp_avg, exp_avg_sq: 7 x 4 bytes a weight
    return s * 1e3, 28 * numel * len(params) / s / 1e9


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tokens", type=int, default=4 * 2048)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--inter", type=int, default=5632)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--params", type=int, default=886_000_000)
    p.add_argument("--no-calibrate", action="store_true")
    args = p.parse_args(argv)
    args.seq = min(args.seq, args.tokens)
    on_gpu = args.device.startswith("cuda")
    print(f"device {torch.cuda.get_device_name(0) if on_gpu else 'cpu'}, torch {torch.__version__}")
    dtype = torch.bfloat16 if on_gpu else torch.float32
    print(f"\n| matmul ({dtype}) | m | k | n | TFLOP/s |\n|---|---|---|---|---|")
    rows = matmuls(args, dtype)
    for name, m, k, n, rate in rows:
        print(f"| {name} | {m} | {k} | {n} | {rate:.1f} |")
    flops = sum(2 * m * k * n for _, m, k, n, _ in rows)
    seconds = sum(2 * m * k * n / (rate * 1e12) for _, m, k, n, rate in rows)
    print(f"all of them together: {flops / seconds / 1e12:.1f} TFLOP/s")
    print(f"\ncausal attention ({dtype}) forward + backward: {attention(args, dtype):.1f} TFLOP/s with is_causal, "
          f"{attention(args, dtype, explicit_mask=True):.1f} with the same mask as a tensor")
    for name, rate in bandwidth(args).items():
        print(f"{name}: {rate:.0f} GB/s")
    ms, rate = adamw(args)
    print(f"AdamW foreach step over {args.params:,} fp32 weights: {ms:.1f} ms, {rate:.0f} GB/s")
    if args.no_calibrate:
        return
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import autopar
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29532")
    dist.init_process_group("nccl" if on_gpu else "gloo", rank=0, world_size=1)
    mesh = init_device_mesh(args.device.split(":")[0], (1,), mesh_dim_names=("dp",))
    hw = autopar.calibrate(mesh, quick=not on_gpu).hardware
    print(f"\nautopar.calibrate: peak_flops {dict(hw.peak_flops)}, attention_efficiency "
          f"{hw.attention_efficiency:.3f}, memory_bandwidth {hw.memory_bandwidth / 1e9:.0f} GB/s")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
