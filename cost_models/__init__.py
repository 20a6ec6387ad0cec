"""Cost models for autopar: hardware specs and symbolic compute / comm / memory terms.

Pure Python plus sympy, no torch, so plans can be costed anywhere; every formula
accepts ints or sympy expressions for sizes.
"""

from .comm import (ALL_GATHER, ALL_REDUCE, ALL_TO_ALL, KINDS, REDUCE_SCATTER, SEND_RECV,
                   algorithm_terms, bytes_moved, collective_time)
from .compute import TRAIN_FLOPS_FACTOR, compute_time, matmul_flops, memory_time, optimizer_time
from .errors import CostModelError
from .hardware import FLOAT8, PRESETS, Hardware, Link, axis_links, axis_ranks_per_node, axis_reach, describe_links, get_hardware
from .memory import format_bytes, parse_bytes

__all__ = [
    "Link", "Hardware", "PRESETS", "FLOAT8", "get_hardware", "axis_links", "axis_ranks_per_node", "axis_reach", "describe_links",
    "algorithm_terms", "bytes_moved", "collective_time", "ALL_GATHER", "REDUCE_SCATTER", "ALL_REDUCE",
    "ALL_TO_ALL", "SEND_RECV", "KINDS",
    "compute_time", "memory_time", "optimizer_time", "matmul_flops", "TRAIN_FLOPS_FACTOR",
    "parse_bytes", "format_bytes", "CostModelError",
]
