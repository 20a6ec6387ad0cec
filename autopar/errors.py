"""Exceptions autopar raises for bad input.

Every message says what is wrong, where (node, module path, parameter name or
mesh axis) and what to do about it, so a user never has to read a traceback
from torch internals to find out why a plan failed.
"""


class AutoparError(Exception):
    """Base class of every error autopar raises on purpose."""


class CaptureError(AutoparError):
    """torch.export could not capture the model."""


class MeshError(AutoparError):
    """The device mesh is malformed or does not fit the request."""


class ShardingError(AutoparError):
    """A requested layout cannot be applied (e.g. an axis that does not divide a dim)."""


class InfeasiblePlanError(AutoparError):
    """No plan meets the constraints (e.g. the memory limit)."""

    def __init__(self, message: str, min_memory_bytes: float | None = None):
        super().__init__(message)
        self.min_memory_bytes = min_memory_bytes


class PlanError(AutoparError):
    """A plan does not match the model or mesh it is applied to."""


class UnsupportedOpWarning(UserWarning):
    """An op has no sharding rule, so autopar replicates it."""


class DivisibilityWarning(UserWarning):
    """A requested layout cannot split something evenly (e.g. tp degree vs heads), so the plan works around it."""


class PipelineError(AutoparError):
    """A pipeline request cannot be met (axis, stages, microbatches or schedule)."""


class UnsupportedAutogradError(AutoparError):
    """An autograd call the parallel module's gradient reductions cannot serve (torch.autograd.grad with
    respect to parameters whose gradient the module reduces)."""


class InputShapeError(AutoparError):
    """The parallel module was called with an input of a shape its graph cannot take."""
