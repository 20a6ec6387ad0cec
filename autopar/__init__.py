"""autopar: automatic DP / FSDP / TP plans for PyTorch training, planned by ILP over a symbolic cost model."""
from .api import parallelize, plan
from .audit import AuditReport, audit
from .errors import (AutoparError, CaptureError, DivisibilityWarning, InfeasiblePlanError, MeshError, PlanError, ShardingError,
                     UnsupportedOpWarning)
from .plan_result import Plan
from .runtime import ParallelModule

__all__ = ["plan", "parallelize", "audit", "AuditReport", "Plan", "ParallelModule", "AutoparError", "CaptureError",
           "InfeasiblePlanError", "DivisibilityWarning", "MeshError", "PlanError", "ShardingError", "UnsupportedOpWarning"]
__version__ = "0.1.0"
