"""autopar: automatic DP / FSDP / TP plans for PyTorch training, planned by ILP over a symbolic cost model."""
from . import checkpoint
from .checkpoint import load_checkpoint, load_hf_checkpoint   # deprecated: autopar.checkpoint.load, .load_hf
from .api import compare, parallelize, plan
from .audit import AuditReport, audit
from .calibrate import Calibration, calibrate
from .cost.precision import AUTO_FP8, BF16_MIXED, FP8_MIXED, Float8, OptimizerSpec, Precision
from .errors import (AutoparError, CaptureError, DivisibilityWarning, InfeasiblePlanError, InputShapeError, MeshError,
                     PipelineError, PlanError, ShardingError, UnsupportedAutogradError, UnsupportedOpWarning)
from .planning.options import PlanOptions
from .planning.result import Plan
from .runtime.optim.clip_grad import clip_grad_norm_
from .runtime.module import ParallelModule
from .runtime.optim.sharded import ShardedOptimizer
from .search.classics import STRATEGIES
from .whatif import max_batch, min_axis_size, min_compute_bound_batch

__all__ = ["plan", "compare", "parallelize", "checkpoint", "audit", "AuditReport", "calibrate", "Calibration", "Plan", "PlanOptions", "ParallelModule", "ShardedOptimizer", "clip_grad_norm_", "load_checkpoint",
           "load_hf_checkpoint",
           "Precision", "BF16_MIXED", "FP8_MIXED", "AUTO_FP8", "Float8", "OptimizerSpec", "AutoparError", "CaptureError",
           "InfeasiblePlanError", "InputShapeError", "DivisibilityWarning", "MeshError", "PipelineError", "PlanError", "ShardingError", "UnsupportedAutogradError",
           "UnsupportedOpWarning",
           "max_batch", "min_compute_bound_batch", "min_axis_size", "STRATEGIES"]
__version__ = "0.1.0"
