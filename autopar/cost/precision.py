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

from dataclasses import dataclass, field

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


FLOAT8_RECIPES = ("tensorwise", "rowwise")


@dataclass(frozen=True)
class Float8:
    """Float8 training of the linear layers' matmuls, with torchao's and torchtitan's knobs under their names.

    Each float8 linear casts its input and weight to float8_e4m3fn and, in backward, its output's gradient to
    float8_e5m2, each with a scale made from the amax (largest magnitude) of the whole tensor, however the plan
    splits it (runtime/lowering/float8.py), and multiplies with PyTorch's scaled matmul into the compute dtype.

    recipe_name: "tensorwise" (one scale per tensor) or "rowwise" (one per row of a matmul's left operand and
      per column of its right, scales rounded down to a power of 2, every cast e4m3: torchao's rowwise).
    enable_fsdp_float8_all_gather: an FSDP weight cast to float8 before its all-gather (half the bytes of
      bf16), with the whole weight's scale (its shards' amaxes all-reduced once per layer and forward). Off,
      as torchtitan's default. Tensorwise only, as torchao's. A float8 linear's weight gathers in float8 where
      the plan gathers it with its FSDP layer and hands it to the linear as gathered, and no other op reads it
      (cost/float8.py); eager only: under torch.compile the module gathers each weight alone, in bf16.
    filter_fqns: linears whose module path contains one of these stay in the compute dtype: torchtitan's
      default "output", and Hugging Face's "lm_head", keep the output head out (its gradient feeds the loss's
      softmax, where float8's 3-bit mantissa costs most).
    auto_filter_small_kn: also keep in the compute dtype each linear the cost model says float8 does not speed
      up (its casts cost more than the faster matmul saves); "auto-fp8" sets it.
    """
    recipe_name: str = "tensorwise"
    enable_fsdp_float8_all_gather: bool = False
    filter_fqns: tuple = ("output", "lm_head")
    auto_filter_small_kn: bool = False

    def __post_init__(self):
        if self.recipe_name not in FLOAT8_RECIPES:
            raise AutoparError(f"Float8(recipe_name={self.recipe_name!r}): use one of {', '.join(FLOAT8_RECIPES)}")
        if isinstance(self.filter_fqns, str):
            raise AutoparError(f"Float8(filter_fqns={self.filter_fqns!r}): a list of module-path parts, not one string")
        if self.enable_fsdp_float8_all_gather and self.recipe_name != "tensorwise":
            raise AutoparError(f"Float8(recipe_name={self.recipe_name!r}, enable_fsdp_float8_all_gather=True): "
                               "float8 all-gathers take one scale per weight, the tensorwise recipe's (as "
                               "torchao's); use recipe_name='tensorwise' or leave the all-gathers in bf16")
        object.__setattr__(self, "filter_fqns", tuple(self.filter_fqns))

    def to_dict(self) -> dict:
        return {"recipe_name": self.recipe_name, "enable_fsdp_float8_all_gather": self.enable_fsdp_float8_all_gather,
                "filter_fqns": list(self.filter_fqns), "auto_filter_small_kn": self.auto_filter_small_kn}


def _float8(value):
    if value is None or isinstance(value, Float8):
        return value
    if isinstance(value, dict):
        return Float8(**value)
    raise AutoparError(f"Precision(float8={value!r}): pass an autopar.Float8(...), its dict, or None")


@dataclass(frozen=True)
class Precision:
    """Dtypes of one training step; None means the parameter's own dtype.

    compute: weights as the ops see them (and the activations they make);
    master: the copy the optimizer updates; grad_accum: gradients as kept
    between backward and the optimizer step; reduce: gradients as they cross
    the network; optimizer_state: e.g. AdamW's moments. The defaults (all
    None) train in the model's own dtype, which is what the runtime does
    without a policy. float8: the linear layers' matmuls in float8 (Float8),
    None for none.
    """
    compute: object = None
    master: object = None
    grad_accum: object = None
    reduce: object = None
    optimizer_state: object = None
    float8: Float8 | None = field(default=None)

    def __post_init__(self):
        for f in ("compute", "master", "grad_accum", "reduce", "optimizer_state"):
            object.__setattr__(self, f, _dtype(getattr(self, f), f))
        object.__setattr__(self, "float8", _float8(self.float8))

    def resolve(self, param_dtype: torch.dtype) -> "Precision":
        """Every None replaced: compute by the parameter's dtype, the rest by the master dtype."""
        master = self.master or param_dtype
        return Precision(self.compute or param_dtype, master, self.grad_accum or master,
                         self.reduce or self.grad_accum or master, self.optimizer_state or master, self.float8)

    def to_dict(self) -> dict:
        out = {f: (str(getattr(self, f)).removeprefix("torch.") if getattr(self, f) is not None else None)
               for f in ("compute", "master", "grad_accum", "reduce", "optimizer_state")}
        if self.float8 is not None:   # absent, not None, without float8: plans saved before it read the same
            out["float8"] = self.float8.to_dict()
        return out


BF16_MIXED = Precision(compute="bfloat16", master="float32", grad_accum="float32", reduce="float32",
                       optimizer_state="float32")
# bf16-mixed with the linear layers' matmuls in float8 (every one the rule in cost/float8.py allows) ...
FP8_MIXED = Precision(compute="bfloat16", master="float32", grad_accum="float32", reduce="float32",
                      optimizer_state="float32", float8=Float8())
# ... or those where the cost model says float8 pays
AUTO_FP8 = Precision(compute="bfloat16", master="float32", grad_accum="float32", reduce="float32",
                     optimizer_state="float32", float8=Float8(auto_filter_small_kn=True))
_NAMED = {"bf16-mixed": BF16_MIXED, "bf16_mixed": BF16_MIXED, "fp8-mixed": FP8_MIXED, "fp8_mixed": FP8_MIXED,
          "float8": FP8_MIXED, "auto-fp8": AUTO_FP8, "auto_fp8": AUTO_FP8}


def precision_of(value) -> Precision:
    if value is None:
        return Precision()
    if isinstance(value, Precision):
        return value
    if isinstance(value, str) and value.strip().lower() in _NAMED:
        return _NAMED[value.strip().lower()]
    if isinstance(value, dict):
        return Precision(**value)
    raise AutoparError(f"precision={value!r}: pass an autopar.Precision(compute=..., master=..., grad_accum=..., "
                       "reduce=..., optimizer_state=..., float8=...), 'bf16-mixed', 'fp8-mixed' (bf16-mixed with "
                       "the linear layers in float8), 'auto-fp8' (float8 where it pays), or None for the model's "
                       "own dtype")


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
