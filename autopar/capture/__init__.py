"""Capture: the user's nn.Module -> a `Captured` fx graph with shapes, dtypes and module paths.

Takes a model and example inputs; hands on `Captured` (export.py): the training graph as
torch.export traces it, every node's TensorMeta (sizes may be sympy symbols: batch, seq),
which node is a parameter, buffer, user input or op, and the module each op came from.

Reading order: export.py (torch.export and the node table), losses.py (mean losses rewritten
as sum / count at capture), blocks.py (which ops form repeated layers), repeat.py (trace three
layers of a deep stack and copy the rest), cache.py (those three layers' capture kept on disk),
microbatch.py (a pipeline's microbatch capture for planning, derived from the whole batch's).
"""
