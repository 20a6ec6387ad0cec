"""Train and eval mode: which models trace differently in the two, and when one mode's plan runs the other's graph.

torch.export bakes the mode into the graph it traces. A dropout traced in eval mode is an op with p and
train=False (export.mode_dependent_ops sees it), but Hugging Face attention passes SDPA
`dropout_p=0.0 if not self.training else self.attention_dropout`: traced in eval mode, nothing in the
graph shows the dropout train mode runs. So `mode_dependent` reads the model too: torch's modules that
act by mode (dropout with p > 0, norms with running statistics, RReLU) and any module holding a nonzero
number in an attribute named for dropout or jitter noise (HF's `attention_dropout`, `dropout`,
`dropout_p`, `attn_drop`, `layerdrop`, `jitter_noise`, stochastic depth's `drop_prob`), which is how HF
forwards read the rate they pass only in training.

Limits: a forward that branches on `self.training` with nothing of this kind -- reading the rate from
`self.config`, an attribute named otherwise, a Python-side decision -- is not seen from an eval-mode graph;
such a model must be parallelized in the mode it will run in.

The two modes' graphs may also differ in ops that change no value: `x.transpose(1, 2).contiguous()`
traces `aten.contiguous` only where the tensor is not contiguous already, and CPU SDPA returns another
layout with dropout than without (HF GPT-2 and Llama: two more `contiguous` nodes in train mode). Such ops
do not make the modes differ (`same_ops`); the other mode's graph runs without them
(`without_identities`), each reader taking the op's input in the layout the plan gives that input (a
view after one runs as a reshape in the local graph: rewrite.VIEW_OPS).
"""
from __future__ import annotations

from dataclasses import replace

import torch
import torch.fx as fx
from torch import nn

from .export import Captured, mode_dependent_ops

# ops that return their input's values (a copy in another memory layout, or a view of all of it)
IDENTITY_OPS = frozenset({"aten.contiguous.default", "aten.alias.default"})

# torch's modules that act by mode (public classes: the private bases are behind _compat.py's line)
_DROPOUTS = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)
_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm, nn.InstanceNorm1d, nn.InstanceNorm2d,
          nn.InstanceNorm3d)

# attribute names holding the rate of something a forward does only in training
_RATE_WORDS = ("drop", "jitter")


def mode_dependent(model: torch.nn.Module, graph: fx.Graph) -> list[str]:
    """What makes `model` run otherwise in the other mode than the one `graph` was traced in: the graph's
    nodes (export.mode_dependent_ops), then the modules (`mode_dependent_modules`); empty when the two modes
    trace the same graph, as far as can be seen."""
    return mode_dependent_ops(graph) + mode_dependent_modules(model)


def mode_dependent_modules(model: torch.nn.Module) -> list[str]:
    """Paths of the submodules whose forward acts by `self.training` ("" for the model itself)."""
    return [path for path, m in model.named_modules() if _acts_by_mode(m)]


def _acts_by_mode(m: torch.nn.Module) -> bool:
    if isinstance(m, _DROPOUTS):
        return m.p > 0
    if isinstance(m, _NORMS):
        return m.track_running_stats   # batch statistics in training, running ones in eval
    if isinstance(m, nn.RReLU):
        return True   # a random slope in training
    return any(_is_rate(name, value) for name, value in vars(m).items())


def _is_rate(name: str, value) -> bool:
    """A nonzero number in an attribute named for a dropout or noise rate (a flag is no rate)."""
    return (isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0
            and any(w in name.lower() for w in _RATE_WORDS))


def identities(graph: fx.Graph) -> set[fx.Node]:
    """The nodes of IDENTITY_OPS that can be left out: none of their readers writes into them (then the
    copy keeps the input unchanged, which leaving it out would not)."""
    return {n for n in graph.nodes
            if n.op == "call_function" and str(n.target) in IDENTITY_OPS and not any(_writes(u, n) for u in n.users)}


def _writes(user: fx.Node, node: fx.Node) -> bool:
    """Whether `user` may write into `node`: an op whose schema marks the argument `node` is passed as written
    (in place, out=); a reader other than an aten op or the output may, for all we know."""
    if user.op == "output":
        return False
    schema = getattr(user.target, "_schema", None)
    if user.op != "call_function" or schema is None:
        return True
    given = dict(zip([a.name for a in schema.arguments], user.args)) | dict(user.kwargs)
    return any(given.get(a.name) is node for a in schema.arguments
               if a.alias_info is not None and a.alias_info.is_write)


def same_ops(a: fx.Graph, b: fx.Graph) -> bool:
    """Same nodes (names, kinds and targets) in the same order, leaving out ops that change no value: a plan
    made for one applies to the other."""
    def key(graph):
        skip = identities(graph)
        return [(n.name, n.op, n.target) for n in graph.nodes if n not in skip]
    return key(a) == key(b)


def without_identities(cap: Captured) -> Captured:
    """`cap` with its graph copied without the ops `identities` names, each reader taking the op's input.

    A copy: a capture is shared by the ranks of a threaded run (shared.py), and the nodes kept keep their
    names, by which a plan lays them out."""
    skip = identities(cap.graph)
    if not skip:
        return cap
    graph, env = fx.Graph(), {}
    for node in cap.graph.nodes:
        if node in skip:
            env[node] = env[node.args[0]]
        else:
            env[node] = graph.node_copy(node, lambda x: env[x])
            assert env[node].name == node.name, (node.name, env[node].name)
    names = {n.name for n in skip}
    return replace(cap, graph=graph, info={k: v for k, v in cap.info.items() if k not in names})
