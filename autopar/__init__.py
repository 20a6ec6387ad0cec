"""autopar: automatic DP / FSDP / TP plans for PyTorch training, planned by ILP over a symbolic cost model."""
from .api import parallelize, plan
from .audit import AuditReport, audit
from .errors import (AutoparError, CaptureError, InputShapeError, DivisibilityWarning, InfeasiblePlanError, MeshError, PipelineError, PlanError,
                     ShardingError,
                     UnsupportedOpWarning)
from .runtime.optim import ShardedOptimizer
from .plan_result import Plan
from .cost.precision import BF16_MIXED, OptimizerSpec, Precision
from .runtime.module import ParallelModule
from .whatif import max_batch, min_compute_bound_batch

__all__ = ["plan", "parallelize", "audit", "AuditReport", "Plan", "ParallelModule", "ShardedOptimizer",
           "Precision", "BF16_MIXED", "OptimizerSpec", "AutoparError", "CaptureError",
           "InfeasiblePlanError", "InputShapeError", "DivisibilityWarning", "MeshError", "PipelineError", "PlanError", "ShardingError", "UnsupportedOpWarning",
           "max_batch", "min_compute_bound_batch"]
__version__ = "0.1.0"
