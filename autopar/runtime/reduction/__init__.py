"""Reduction: gradients reduced while backward runs, and FSDP weights gathered ahead of their layer.

engine.py is the cycle all three share (arrive -> launch -> finish) and the one place their collectives
are issued, eagerly or as functional collectives. Its users: grad_buckets.py (data-parallel gradients
all-reduced in flat buckets, DDP's way), layer_groups.py (an FSDP layer's weights gathered together,
prefetched, their gradients reduce-scattered together), zero_buckets.py (ZeRO-1/2 gradients
reduce-scattered into the optimizer's slices).
"""
