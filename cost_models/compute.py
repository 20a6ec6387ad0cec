"""Compute time: FLOPs over peak FLOP/s, bytes over memory bandwidth.

Roofline pieces; the caller takes the larger of the two per op (symbolically,
with sympy.Max) -- here we only convert, so sizes may be ints or sympy expressions.
"""

# Forward of a matmul is one matmul; backward is two (grad wrt input, grad wrt
# weight) of the same size, so a training step costs 3x the forward FLOPs.
TRAIN_FLOPS_FACTOR = 3


def matmul_flops(m, n, k):
    """FLOPs of an (m, k) @ (k, n) matmul: one multiply and one add per term."""
    return 2 * m * n * k


def compute_time(flops, dtype, hardware):
    """Seconds at peak throughput for this dtype."""
    return flops / hardware.flops_per_second(dtype)


def optimizer_time(bytes, hardware):
    """Seconds of the optimizer step's kernels moving `bytes`: a few large foreach kernels, which reach
    more of the bandwidth than a step's many small memory-bound ops (Hardware.optimizer_efficiency)."""
    return bytes / (hardware.memory_bandwidth * hardware.optimizer_efficiency)


def memory_time(bytes, hardware):
    """Seconds to stream `bytes` through device memory once, at the bandwidth a step's kernels reach."""
    return bytes / (hardware.memory_bandwidth * hardware.memory_efficiency)
