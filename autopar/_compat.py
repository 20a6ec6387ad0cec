"""The one module of autopar that touches private PyTorch APIs.

Everything here reaches into torch._C.*, torch.testing._internal.* or
underscored torch.distributed state, which PyTorch may change in any release.
Keeping it in one file means an upgrade breaks one place; nothing else in
autopar may import those modules directly.

- install_threaded_pg & co: torch's in-process "threaded" process group, on
  which autopar.testing.run_threaded runs N ranks as N threads of this process.
- init_fake_process_group: a "fake" backend whose collectives do nothing, so
  a 1000-rank DeviceMesh can be built (and a plan traced) in one process.
- storage_id, view_base: which traced (fake) tensors share a storage; what a view was made from.
- operator_name, operator_named: a graph's operator by name and back (the capture cache).
- pipeline_stage: a PipelineStage whose shape inference gives integer inputs zeros.
- backward_keeps_graph, backward_id, leaf_gradient_use: what the backward now
  running is, for the gradient reductions that run inside it.
- register_ordered_effect: a custom op whose calls torch.compile must keep, each one, in order.
- functional_collectives: torch's functional collectives (a result tensor instead of a work handle),
  which torch.compile can trace, reorder and bucket; the reduction engine's other launcher.
- scaled_mm, scaled_mm_op: torch._scaled_mm, the float8 matmul (runtime/lowering/float8.py; torchao calls it
  too), and its aten overload (per-op checkpointing caches it: runtime/lowering/per_op.py).
- generator_swap_lock: the lock under which torch.compile saves and restores the default generators,
  which runtime/rng.py's stream swaps must not interleave with.
"""

import sys
import threading

import torch
import torch.distributed as dist

# torch.export / make_fx keep module-level state (e.g. export's
# _EXPORT_MODULE_HIERARCHY) and fail with AssertionErrors when two threads trace
# at once. Hold this around any tracing that may run inside run_threaded ranks.
# Eager forward/backward in other threads while one traces is fine.
trace_lock = threading.RLock()

# The lock a thread holds while it swaps a random stream into the default generators (runtime/rng.py).
# torch.compile reads the default generators' states when it starts compiling a frame and sets them back when
# it ends (torch._dynamo.convert_frame's preserve_global_state), under convert_frame.compile_lock. Threads of
# one process (run_threaded's ranks) share the default generators: a compile in one rank that set them back
# while another rank had its stream swapped in made that rank draw from the wrong state -- in a checkpointed
# block's rerun, a mask forward never drew, so a wrong gradient (about half the runs of fsdp on 3 threaded ranks
# compiled with aot_eager and full checkpointing). Swapping under the compiler's own lock keeps the two apart.
# A torch without that lock: one of autopar's, which keeps the ranks' swaps apart only.
try:
    from torch._dynamo.convert_frame import compile_lock as generator_swap_lock
except ImportError:   # pragma: no cover - a torch that moved it
    generator_swap_lock = threading.RLock()


# -----------------------------------------------------------------------------
# torch's threaded process group (driven by autopar.testing.threaded)

def _multi_threaded_pg():
    # imported on use: it pulls in torch's test utilities, which `import autopar` does not need
    from torch.testing._internal.distributed import multi_threaded_pg
    return multi_threaded_pg


def install_threaded_pg():
    """Make the "threaded" backend usable in this process; returns the distributed "world" it installed."""
    # Functional collectives (and so DTensor) resolve groups by name in a
    # C++ registry; isolation makes that registry per thread, like per process.
    torch._C._distributed_c10d._set_thread_isolation_mode(True)
    return _multi_threaded_pg()._install_threaded_pg()


def uninstall_threaded_pg() -> None:
    """Undo install_threaded_pg: torch.distributed's own world and one group registry again."""
    _multi_threaded_pg()._uninstall_threaded_pg()
    torch._C._distributed_c10d._set_thread_isolation_mode(False)


def reset_threaded_pg() -> None:
    """Clear the class-level state the threaded pg keeps between runs (collectives in flight, its abort flag)."""
    _multi_threaded_pg().ProcessLocalGroup.reset()


def wake_threaded_ranks(exc: BaseException) -> None:
    """Wake every rank blocked in a threaded-pg collective; each leaves it with SystemExit."""
    _multi_threaded_pg().ProcessLocalGroup.exception_handle(exc)


def destroy_threaded_group() -> None:
    """Leave the threaded pg in a rank thread (dist.destroy_process_group).

    On torch before 2.13 that call reads `comms` from the threaded pg's world, which that world lacks
    (seen on 2.11: AttributeError in every rank thread at the end of a run). The rank's groups then
    stay in its thread-local world, which uninstall_threaded_pg drops with the rest."""
    try:
        dist.destroy_process_group()
    except AttributeError as e:
        if "comms" not in str(e):
            raise


def current_world():
    """torch.distributed's module-level state (its "world"), which the threaded pg swaps for its own."""
    return dist.distributed_c10d._world


def exit_without_teardown() -> None:
    """End this process now, skipping the interpreter's teardown (a gloo rank whose work and result are done).

    torch's C++ objects destroyed at exit (a process group's or the TCP store's threads) sometimes abort a
    process there: "terminate called without an active exception", SIGABRT, seen in CI about one run in
    four in tests/test_resume.py's 2-rank load, after the rank had finished."""
    import os
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def threaded_world():
    """The world of the threaded pg run now going on in this process (one object for all its rank threads,
    a new one each run), or None outside such a run."""
    mtpg = sys.modules.get("torch.testing._internal.distributed.multi_threaded_pg")
    world = dist.distributed_c10d._world
    return world if mtpg is not None and isinstance(world, mtpg.ThreadLocalWorld) else None


# -----------------------------------------------------------------------------
# the fake process group, and the rest

def init_fake_process_group(world_size: int, rank: int = 0) -> None:
    """Initialise the default process group on the "fake" backend.

    Collectives on it return at once and move no data (outputs keep whatever
    they held), so only shapes, ranks and group structure are meaningful:
    enough to build a DeviceMesh of any size and trace or plan with it in one
    process. Pair with destroy_process_group_if_initialized() when done.
    """
    from torch.testing._internal.distributed.fake_pg import FakeStore
    dist.init_process_group(backend="fake", rank=rank, world_size=world_size,
                            store=FakeStore())


def destroy_process_group_if_initialized() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def output_spec(exported):
    """How the model's own output structure (tensor, tuple, dict...) is flattened into the graph's outputs.
    Read once: torch.compile cannot trace ExportedProgram.call_spec and would break the graph there."""
    return exported.call_spec.out_spec


def unflatten_outputs(spec, flat_outputs):
    """Rebuild the model's own output structure from the graph's flat outputs (`spec`: output_spec's)."""
    import torch.utils._pytree as pytree
    return pytree.tree_unflatten(list(flat_outputs), spec)


def fake_mode_of(t: torch.Tensor):
    """The FakeTensorMode an exported graph's example values live in (to compute new nodes' values)."""
    return t.fake_mode


def symint_expr(s):
    """The sympy expression behind a torch.SymInt (export's symbolic dim), e.g. `s0` or `2*s0`."""
    return s.node.expr


def symint_hint(s) -> int:
    """The example value export traced a SymInt with."""
    return int(s.node.hint)


def operator_name(target) -> str | None:
    """An aten-style operator's name as torch prints it (e.g. "aten.add.Tensor"), None for another target."""
    return str(target) if isinstance(target, torch._ops.OpOverload) else None


def operator_named(name: str):
    """The operator operator_name named (its namespace must be loaded: aten always is)."""
    namespace, op, overload = name.split(".")
    return getattr(getattr(getattr(torch.ops, namespace), op), overload)


def op_schema(target):
    """An OpOverload's schema (its arguments' names and defaults): `_schema`, which torch.fx's own
    argument normalization reads too."""
    return target._schema


def new_state_dict(destination=None, prefix: str = "", version=None):
    """`destination` (a new OrderedDict when None) with `version` noted under `prefix` in its `_metadata`, as
    nn.Module.state_dict notes each module's version for its _load_from_state_dict."""
    from collections import OrderedDict
    if destination is None:
        destination = OrderedDict()
        destination._metadata = OrderedDict()
    if hasattr(destination, "_metadata"):
        destination._metadata[prefix[:-1]] = {"version": version}
    return destination


def storage_id(t: torch.Tensor) -> int:
    """Identity of the storage behind a tensor, fake ones included: views share it.

    Fake and meta tensors have no data pointer to compare; the storage's C++
    handle (what torch's own StorageWeakRef hashes) tells them apart. Valid
    while the tensors are alive (traced graphs keep theirs in node.meta).
    """
    return t.untyped_storage()._cdata


def dispatch_mode_class():
    """The base class of a mode that sees every aten op a region runs (tests/test_megatron_activations.py
    records the storages forward makes with one): torch.utils._python_dispatch.TorchDispatchMode."""
    from torch.utils._python_dispatch import TorchDispatchMode
    return TorchDispatchMode


def profiler_event_types():
    """The kinds of the profiler's event tree nodes (TorchOp, PyCall, Allocation): benchmarks/peak_memory.py
    reads which op allocated what from that tree, which torch.profiler exposes only through torch._C."""
    return torch._C._profiler._EventType


def view_base(t: torch.Tensor) -> torch.Tensor | None:
    """The tensor a view was made from (None for a tensor that owns its storage): autograd's `_base`."""
    return t._base


# -----------------------------------------------------------------------------
# the autograd engine

def at_backward_end(callback) -> None:
    """Run `callback()` once the backward pass now running has finished (call from inside backward).

    DDP's reducer and FSDP2 wait for their asynchronous gradient reductions this way, so the
    gradients are whole when `loss.backward()` returns; torch has no public API for it."""
    from torch.autograd import Variable
    Variable._execution_engine.queue_callback(callback)


def backward_keeps_graph() -> bool:
    """Whether the backward pass now running keeps its graph (retain_graph=True): another backward may
    run through the same graph and bring the same gradients again (call from inside backward)."""
    return torch._C._autograd._get_current_graph_task_keep_graph()


def backward_id() -> int:
    """The id of the backward pass now running (call from inside backward): each loss.backward() and each
    torch.autograd.grad has its own, so a callback queued in a backward that raised (which torch never
    runs) can be told from one still to come."""
    return torch._C._current_graph_task_id()


# what the backward now running does with a leaf's gradient (leaf_gradient_use)
TO_GRAD, RETURNED, NOT_NEEDED = "to .grad", "returned", "not needed"


def leaf_gradient_use(grad_accumulator) -> str:
    """TO_GRAD when the backward now running accumulates the leaf's gradient into .grad (loss.backward(),
    or backward(inputs=) naming it), RETURNED when it hands it back to its caller (torch.autograd.grad with
    respect to the leaf), NOT_NEEDED when it does neither (backward(inputs=) or autograd.grad naming other
    tensors). `grad_accumulator`: the leaf's AccumulateGrad node (ctx.next_functions of an op reading it).

    torch has no call that says so: _will_engine_execute_node answers the first and the last, and refuses
    a leaf autograd.grad captures with the RuntimeError below, which is how the middle one shows."""
    try:
        return TO_GRAD if torch._C._will_engine_execute_node(grad_accumulator) else NOT_NEEDED
    except RuntimeError as e:
        if "autograd.grad" in str(e):
            return RETURNED
        raise


# -----------------------------------------------------------------------------
# effectful custom ops

def register_ordered_effect(op) -> None:
    """Mark `op` (a torch.library.custom_op) as having a side effect: torch.compile then threads an effect
    token through its calls, so it keeps each one, in program order. Otherwise it takes a custom op without
    mutated arguments for pure, and may merge two equal calls into one or drop one whose result is unused."""
    effect_type = getattr(torch.library, "EffectType", None)
    if effect_type is not None and hasattr(op, "register_effect"):
        op.register_effect(effect_type.ORDERED)
        return
    # older releases: the registry the effect tokens read, by the op's overload
    from torch._higher_order_ops.effects import _EffectType, _register_effectful_op
    _register_effectful_op(op._opoverload, _EffectType.ORDERED)


# -----------------------------------------------------------------------------
# torch.distributed.pipelining

def pipeline_stage(submodule, stage_index: int, num_stages: int, device, group):
    """A torch PipelineStage whose shape inference feeds integer inputs zeros instead of uninitialised memory.

    Before a schedule's first step, torch runs each stage once on tensors made from the previous stage's
    shapes (`PipelineStage._to_tensor`: torch.empty). A stage that receives token ids or targets (a loss
    computed inside forward, at the last stage) then indexes an embedding or a cross-entropy with garbage,
    which raises IndexError on CPU (and can fault on a GPU); zeros are valid indices for both."""
    from torch.distributed.pipelining import PipelineStage

    class _Stage(PipelineStage):
        def _to_tensor(self, arg):
            t = super()._to_tensor(arg)
            if not isinstance(arg, torch.Tensor) and isinstance(t, torch.Tensor) and not (
                    t.is_floating_point() or t.is_complex()):
                with torch.no_grad():
                    t.zero_()
            return t

    return _Stage(submodule, stage_index, num_stages, device, group=group)


# -----------------------------------------------------------------------------
# functional collectives (runtime/reduction/engine.FunctionalLauncher)

def functional_collectives():
    """(all_reduce, reduce_scatter, all_gather, wait) of torch.distributed._functional_collectives, each
    taking (tensor, group) and returning a tensor whose value is ready once `wait` has returned it.

    torch 2.13 renamed the tensor-in/tensor-out ones *_single (the old names warn); 2.11 has only the old."""
    import torch.distributed._functional_collectives as funcol
    # same signatures under both names
    reduce_scatter_tensor = getattr(funcol, "reduce_scatter_single", None) or funcol.reduce_scatter_tensor
    all_gather_tensor = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor

    def reduce_scatter(t, group):
        return reduce_scatter_tensor(t, "sum", 0, group)

    def all_gather(t, group):
        return all_gather_tensor(t, 0, group)

    def all_reduce(t, group):
        return funcol.all_reduce(t, "sum", group)

    return all_reduce, reduce_scatter, all_gather, funcol.wait_tensor


def tensor_version(t: torch.Tensor) -> int:
    """A tensor's version counter (each in-place change bumps it): runtime/lowering/per_op.py checks that a
    result it cached in forward is unchanged when backward's rerun takes it."""
    return t._version


def scaled_mm_op():
    """The aten overload a float8 matmul dispatches to (torch._scaled_mm): per-op checkpointing counts and caches
    it as it does aten.mm (runtime/lowering/per_op.py)."""
    return torch.ops.aten._scaled_mm.default


def scaled_mm(a, b, scale_a, scale_b, out_dtype, use_fast_accum: bool):
    """a @ b of float8 matrices, each cast with the inverse of its scale, in `out_dtype` (torch._scaled_mm:
    private, and the only float8 matmul torch has; torchao's Float8Linear calls it as well)."""
    return torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype, use_fast_accum=use_fast_accum)
