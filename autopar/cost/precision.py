"""Precision policy and optimizer: how many bytes each parameter costs.

A training step keeps, per parameter element: the weight, the gradient in the
accumulation dtype, and the optimizer's state tensors. The gradient crosses
the network in the reduce dtype. Under mixed precision the module keeps one
copy of each weight, in the master dtype, and casts it to the compute dtype
where an op uses it (after the FSDP all-gather's input cast, as FSDP2's
MixedPrecisionPolicy does): a cast copy lives while its op runs, not for the
step. So fp32 AdamW costs 4 + 4 + 2*4 = 16 bytes per parameter, and so does
bf16 compute with fp32 master, gradients and AdamW state; what bf16 halves is
the activations and the weight all-gathers. (Megatron and apex O2 keep a bf16
copy beside the fp32 master, 18 bytes with fp32 gradients; autopar does not:
the copy would go stale behind any optimizer that does not refresh it.)
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import AutoparError

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
           "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
           "float64": torch.float64, "fp64": torch.float64, "double": torch.float64}


def _dtype(value, field: str):
    if value is None or isinstance(value, torch.dtype):
        return value
    key = str(value).removeprefix("torch.").strip().lower()
    if key not in _DTYPES:
        raise AutoparError(f"Precision({field}={value!r}): unknown dtype; use one of "
                           f"{', '.join(sorted(set(_DTYPES)))} or a torch.dtype")
    return _DTYPES[key]


@dataclass(frozen=True)
class Precision:
    """Dtypes of one training step; None means the parameter's own dtype.

    compute: weights as the ops see them (and the activations they make);
    master: the copy the optimizer updates; grad_accum: gradients as kept
    between backward and the optimizer step; reduce: gradients as they cross
    the network; optimizer_state: e.g. AdamW's moments. The defaults (all
    None) train in the model's own dtype, which is what the runtime does
    without a policy.
    """
    compute: object = None
    master: object = None
    grad_accum: object = None
    reduce: object = None
    optimizer_state: object = None

    def __post_init__(self):
        for f in ("compute", "master", "grad_accum", "reduce", "optimizer_state"):
            object.__setattr__(self, f, _dtype(getattr(self, f), f))

    def resolve(self, param_dtype: torch.dtype) -> "Precision":
        """Every None replaced: compute by the parameter's dtype, the rest by the master dtype."""
        master = self.master or param_dtype
        return Precision(self.compute or param_dtype, master, self.grad_accum or master,
                         self.reduce or self.grad_accum or master, self.optimizer_state or master)

    def to_dict(self) -> dict:
        return {f: (str(getattr(self, f)).removeprefix("torch.") if getattr(self, f) is not None else None)
                for f in ("compute", "master", "grad_accum", "reduce", "optimizer_state")}


BF16_MIXED = Precision(compute="bfloat16", master="float32", grad_accum="float32", reduce="float32",
                       optimizer_state="float32")


def precision_of(value) -> Precision:
    if value is None:
        return Precision()
    if isinstance(value, Precision):
        return value
    if isinstance(value, str) and value.strip().lower() in ("bf16-mixed", "bf16_mixed"):
        return BF16_MIXED
    if isinstance(value, dict):
        return Precision(**value)
    raise AutoparError(f"precision={value!r}: pass an autopar.Precision(compute=..., master=..., grad_accum=..., "
                       "reduce=..., optimizer_state=...), 'bf16-mixed', or None for the model's own dtype")


@dataclass(frozen=True)
class OptimizerSpec:
    """What the planner needs to know of an optimizer: how many state tensors it keeps per parameter,
    and how many parameter-sized tensors its step reads or writes (its time: memory-bound elementwise
    kernels). The default, 4 per state plus 3, is the count for the known ones' shape of update."""
    name: str
    states_per_param: int
    update_passes: int = -1

    def __post_init__(self):
        if self.update_passes < 0:
            object.__setattr__(self, "update_passes", _PASSES.get(self.name, 4 * self.states_per_param + 3))


# state tensors the size of the parameter (scalar "step" counters are not counted)
_KNOWN = {"adamw": 2, "adam": 2, "sgd": 0, "sgd-momentum": 1}
# Parameter-sized reads + writes of torch.optim's foreach step (_multi_tensor_*), per element. AdamW:
# lerp_ m (3), mul_ v (2), addcmul_ v (4), decay mul_ p (2), sqrt (2), div_ (2), add_ eps (2),
# addcdiv_ p (4) = 21; Adam (no decay) 19; SGD add_ (3); momentum mul_ + add_ buf (5) + add_ p (3).
_PASSES = {"adamw": 21, "adam": 19, "sgd": 3, "sgd-momentum": 8}


def optimizer_spec(value="adamw") -> OptimizerSpec:
    """From a name ("adamw", "adam", "sgd", "sgd-momentum"), a torch optimizer, or its class."""
    if isinstance(value, OptimizerSpec):
        return value
    if isinstance(value, str):
        key = value.strip().lower()
        if key not in _KNOWN:
            raise AutoparError(f"optimizer={value!r}: unknown name; use one of {', '.join(_KNOWN)}, "
                               "or pass the torch.optim optimizer itself")
        return OptimizerSpec(key, _KNOWN[key])
    cls = value if isinstance(value, type) else type(value)
    group = {}   # a class: its defaults are not known until it is built
    if isinstance(value, torch.optim.Optimizer):
        group = value.param_groups[0] if value.param_groups else value.defaults
    if issubclass(cls, (torch.optim.Adam, torch.optim.AdamW)):
        name = "adamw" if issubclass(cls, torch.optim.AdamW) else "adam"
        return OptimizerSpec(name, 3 if group.get("amsgrad") else 2)   # amsgrad keeps max_exp_avg_sq
    if issubclass(cls, torch.optim.SGD):
        return OptimizerSpec("sgd-momentum", 1) if group.get("momentum", 0) else OptimizerSpec("sgd", 0)
    raise AutoparError(f"optimizer {cls.__name__}: autopar does not know how much state it keeps; pass "
                       "optimizer=OptimizerSpec(name, states_per_param) from autopar.precision instead")


@dataclass(frozen=True)
class ParamBytes:
    """Bytes per parameter element, by what they hold."""
    weight: int        # as stored: the master dtype (the compute dtype's copy exists only while an op runs)
    master: int        # a second, persistent copy for the optimizer: 0, autopar keeps one (module docstring)
    grad: int
    reduce: int        # per element crossing the network in a gradient reduction
    optimizer: int     # all state tensors together
    cast: bool = False  # stored in the master dtype and cast to a narrower compute dtype at each use
    update: int = 0    # bytes the optimizer step moves through memory per element it updates

    @property
    def total(self) -> int:
        return self.weight + self.master + self.grad + self.optimizer


def param_bytes(precision: Precision, optimizer: OptimizerSpec, param_dtype: torch.dtype,
                trainable: bool = True) -> ParamBytes:
    p = precision.resolve(param_dtype)
    if not param_dtype.is_floating_point:
        return ParamBytes(param_dtype.itemsize, 0, 0, 0, 0)
    cast = p.compute != p.master
    if not trainable:
        return ParamBytes(p.master.itemsize, 0, 0, 0, 0, cast)
    return ParamBytes(p.master.itemsize, 0, p.grad_accum.itemsize, p.reduce.itemsize,
                      optimizer.states_per_param * p.optimizer_state.itemsize, cast,
                      optimizer.update_passes * p.master.itemsize)
