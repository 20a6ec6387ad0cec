"""Where one training step's time goes, by kernel class and by op: a profile of each side of gpu_step.py.

The classes are the ones autopar's cost model prices apart (cost/terms.py): matmuls at the FLOP/s their
shapes reach, attention at its own rate, memory-bound ops at memory bandwidth; the optimizer's kernels
(CUDA's multi-tensor "foreach" ones) and copies are split out of the last, because they are the usual
places one module spends more than another, and so are inductor's generated kernels (named triton_*),
which may fuse any of them. On a GPU the times are the kernels' own (CUDA activity); on a
CPU, the ops' self CPU times (a smoke run: the classes are then guessed from op names).
"""
from __future__ import annotations

import collections
import re

import torch
from torch.profiler import ProfilerActivity, profile

CLASSES = ("matmul", "attention", "optimizer", "copy/cast", "collective", "inductor (fused)", "elementwise/other")
# kernel (GPU) or op (CPU) name patterns, checked in this order
_PATTERNS = (
    ("attention", re.compile(r"flash|fmha|attention|efficient_attention|_scaled_dot_product", re.I)),
    ("collective", re.compile(r"nccl|all_gather|reduce_scatter|all_reduce|allreduce", re.I)),
    ("matmul", re.compile(r"gemm|nvjet|cutlass|xmma|sm\d+_.*_tn|aten::(mm|addmm|bmm|matmul|linear)$", re.I)),
    ("inductor (fused)", re.compile(r"^triton_", re.I)),   # a compiled region's kernels, whatever they fuse
    ("optimizer", re.compile(r"multi_tensor_apply|_foreach_|adam", re.I)),
    ("copy/cast", re.compile(r"memcpy|memset|copy|_to_copy|cast", re.I)),
)


def classify(name: str) -> str:
    for cls, pattern in _PATTERNS:
        if pattern.search(name):
            return cls
    return "elementwise/other"


def profile_step(step, on_gpu: bool) -> dict:
    """Profile one call of `step()`: {"classes": {class: ms}, "ops": {op: (ms, calls)}, "kernels": count}."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    with profile(activities=activities) as prof:
        step()
        if on_gpu:
            torch.cuda.synchronize()
    classes, num_kernels = collections.Counter(), 0
    if on_gpu:
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                classes[classify(e.name)] += e.device_time_total / 1e3   # us -> ms
                num_kernels += 1
    ops = {}
    for e in prof.key_averages():
        ms = (e.self_device_time_total if on_gpu else e.self_cpu_time_total) / 1e3
        if ms > 0 and (not on_gpu or not e.key.startswith(("ProfilerStep", "cuda"))):
            ops[e.key] = (ms, e.count)
    if not on_gpu:
        for key, (ms, _) in ops.items():
            if key.startswith("aten::"):
                classes[classify(key)] += ms
    return {"classes": dict(classes), "ops": ops, "kernels": num_kernels}


def print_profiles(profiles: dict, baseline: str, top: int = 12) -> None:
    """Per side, ms by class; then, per side against `baseline`, the ops whose time differs most."""
    names = list(profiles)
    unit = "kernel ms" if any(p["kernels"] for p in profiles.values()) else "CPU self ms"
    print(f"\nOne step by class ({unit}):")
    print("| class | " + " | ".join(names) + " |")
    print("|---|" + "---|" * len(names))
    for cls in CLASSES:
        print(f"| {cls} | " + " | ".join(f"{profiles[n]['classes'].get(cls, 0.0):.1f}" for n in names) + " |")
    print("| total | " + " | ".join(f"{sum(profiles[n]['classes'].values()):.1f}" for n in names) + " |")
    print("| kernels launched | " + " | ".join(str(profiles[n]["kernels"]) for n in names) + " |")
    base = profiles.get(baseline)
    if base is None:
        return
    for n in names:
        if n == baseline:
            continue
        keys = set(base["ops"]) | set(profiles[n]["ops"])
        delta = {k: profiles[n]["ops"].get(k, (0.0, 0))[0] - base["ops"].get(k, (0.0, 0))[0] for k in keys}
        print(f"\n{n} against {baseline}: the {top} ops whose self time differs most (ms; calls)")
        print(f"| op | {baseline} | {n} | difference |")
        print("|---|---|---|---|")
        for k in sorted(delta, key=lambda k: -abs(delta[k]))[:top]:
            a, b = base["ops"].get(k, (0.0, 0)), profiles[n]["ops"].get(k, (0.0, 0))
            print(f"| {k[:70]} | {a[0]:.2f} ({a[1]}) | {b[0]:.2f} ({b[1]}) | {delta[k]:+.2f} |")
