"""A disk cache of the shallow captures planning traces, keyed by everything that decides the graph.

`capture_repeated` (repeat.py) traces a deep model with each stack cut to three
layers; torch.export takes seconds for that (more with dynamic dims), the same
seconds every time a model of one architecture is planned. So the shallow
capture is kept on disk, the way compile caches keep compiled code, and a warm
plan rebuilds it in milliseconds; repeat.py then copies its layers as usual. A model with no
stack to cut (the README's 2-layer demo GPT) is traced whole and kept the same way. Only
planning captures come from here (capture_repeated: autopar.plan, compare, the what-ifs);
`parallelize` traces the whole model every time, as running needs its program.

The key is everything the traced graph depends on:
- the code: the class of the model and of every submodule, the functions a module holds as an
  attribute or a hook, and the contents of the files that define them and of every file their
  modules' globals reach (a function imported from another file, a registry of attention
  functions): the code a forward may call; plus the versions of torch, of Python and of each
  class's package, and the source of autopar's capture stage, which post-processes the graph;
- the model's state: every module's train/eval mode and plain attributes (a Hugging Face
  config's values, `layer_idx`, an epsilon), its parameters and buffers (names, shapes,
  dtypes, devices, requires_grad, which are tied), as the shortened model holds them while
  it is traced (so a compute dtype's stand-ins are in it too);
- the call: each example input's keyword or position, shape, dtype and device, the value of
  each input that is no tensor, and the dynamic_shapes spec.
A model holding something the key cannot describe (an object whose repr names its address)
is traced every time, and so is a graph the cache cannot store (a submodule graph, a target
that is not an operator); neither is an error.

Why it is safe: a hit must match the whole key (stored in the entry, not only its hash), and
what a hit returns is what planning reads of a capture -- the nodes, their NodeInfo, which
values share a storage -- with meta tensors of the example's sizes as node values, as
repeat.py's copies have (its `exported` is None: a planning capture's program is never run).
What the key cannot see: global state a forward reads (a module-level flag set at run time,
torch's global hooks); set AUTOPAR_CAPTURE_CACHE=0 for such a model. Entries are never
trusted blindly: an unreadable, corrupt or other-format one is a miss, and is rewritten. They
are pickles, so the directory is trusted as one's own ~/.cache is.

Where: $AUTOPAR_CACHE_DIR, else ~/.cache/autopar/captures; AUTOPAR_CAPTURE_CACHE=0 turns it off.
Writes are atomic (a temporary file renamed into place), so concurrent planners do not see
half an entry.
"""
from __future__ import annotations

import contextlib
import dataclasses
import enum
import hashlib
import importlib
import inspect
import logging
import os
import pathlib
import pickle
import re
import sys
import tempfile
import types

import torch
import torch.fx as fx

from .._compat import operator_name, operator_named, storage_id, symint_hint
from .export import AUTO, Captured

log = logging.getLogger(__name__)

FORMAT = 1   # of the stored entries: a change to what is stored changes it
_NO_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")
# fields that differ from one process to the next and decide nothing a trace does: transformers'
# GenerationConfig keeps hash(self) (randomised per process by PYTHONHASHSEED) to tell if it was edited
_VOLATILE_FIELDS = frozenset({"_original_object_hash"})


def cache_dir() -> pathlib.Path | None:
    """Where entries go, None when the cache is off."""
    if os.environ.get("AUTOPAR_CAPTURE_CACHE", "1").strip().lower() in ("0", "false", "no", "off"):
        return None
    where = os.environ.get("AUTOPAR_CACHE_DIR")
    return pathlib.Path(where) if where else pathlib.Path.home() / ".cache" / "autopar" / "captures"


def cached_capture(capture_fn, model: torch.nn.Module, example_inputs: tuple, dynamic_shapes=AUTO,
                   example_kwargs=None) -> Captured:
    """`capture_fn(model, example_inputs, dynamic_shapes, example_kwargs)`, from the cache where it holds
    an entry for this model and call; traced and stored otherwise."""
    directory = cache_dir()
    key = capture_key(model, example_inputs, dynamic_shapes, example_kwargs) if directory else None
    if key is None:
        return capture_fn(model, example_inputs, dynamic_shapes, example_kwargs)
    path = directory / (hashlib.sha256(key.encode()).hexdigest() + ".pkl")
    cap = _load(path, key)
    if cap is not None:
        log.debug("capture of %s from the cache: %s", type(model).__name__, path)
        return cap
    cap = capture_fn(model, example_inputs, dynamic_shapes, example_kwargs)
    _store(path, key, cap)
    return cap


# --------------------------------------------------------------------------- the key

class _NotDescribable(Exception):
    """Something the graph may depend on has no stable description: no caching for this model."""


def capture_key(model: torch.nn.Module, example_inputs: tuple, dynamic_shapes, example_kwargs) -> str | None:
    """The cache key of a capture, as text; None when the model cannot be described (not cached)."""
    code: set = set()   # the modules whose code the model holds
    try:
        described = (_describe_model(model, code),
                     tuple((k, _describe_input(v, code)) for k, v in
                           [*enumerate(example_inputs), *dict(example_kwargs or {}).items()]),
                     _describe(dynamic_shapes, code))
    except _NotDescribable as e:
        log.debug("capture of %s not cached: %s", type(model).__name__, e)
        return None
    sources = (torch.__version__, sys.version_info[:2], _capture_stage_version(),
               tuple(sorted((f, _file_hash(f)) for f in _reachable_files(code))))
    return repr((FORMAT, sources, described))


def _capture_stage_version() -> tuple:
    """autopar's version and its capture stage's source: a development checkout changes the one, not the other."""
    here = pathlib.Path(__file__).resolve().parent
    sources = sorted(here.glob("*.py")) + [here.parent / "_compat.py"]
    return getattr(sys.modules.get("autopar"), "__version__", None), tuple(_file_hash(str(p)) for p in sources)


def _describe_model(model: torch.nn.Module, code: set) -> tuple:
    modules = tuple((path, _describe_class(type(m), code), m.training, _describe_attributes(m, code),
                     _describe_hooks(m, code))
                    for path, m in model.named_modules(remove_duplicate=False))
    first: dict = {}   # a tensor's id -> the name it is listed under first: ties
    tensors = tuple((name, tuple(t.shape), str(t.dtype), t.device.type, t.requires_grad, first.setdefault(id(t), name))
                    for name, t in [*model.named_parameters(remove_duplicate=False),
                                    *model.named_buffers(remove_duplicate=False)])
    return modules, tensors


# what every nn.Module holds (its parameters, buffers, submodules, hooks, mode): described apart
_MODULE_INTERNALS = frozenset(vars(torch.nn.Module()))


def _describe_attributes(module: torch.nn.Module, code: set) -> tuple:
    """A module's own attributes, private ones too (a `self._scale` is as much in the graph)."""
    return tuple((name, _describe(value, code)) for name, value in sorted(vars(module).items())
                 if name not in _MODULE_INTERNALS)


def _describe_hooks(module: torch.nn.Module, code: set) -> tuple:
    hooks = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")
    return tuple(_describe(tuple(getattr(module, h, {}).values()), code) for h in hooks)


def _describe_class(cls: type, code: set) -> tuple:
    _note_code(cls, code)
    top = cls.__module__.split(".")[0]
    return cls.__module__, cls.__qualname__, getattr(sys.modules.get(top), "__version__", None)


def _note_code(obj, code: set) -> None:
    """Add the module that defines `obj` to `code`. Code with no file to read (made by exec, or in a
    notebook's cell) could change unseen: a model holding it is not cached."""
    module_name = getattr(obj, "__module__", None) or ""
    module_file = getattr(sys.modules.get(module_name), "__file__", None) or ""
    if inspect.isbuiltin(obj) or module_name in sys.builtin_module_names or (
            module_file and not module_file.endswith(".py")):
        return   # C code: its package's version says it
    try:
        path = inspect.getsourcefile(obj)
    except (TypeError, OSError):
        path = None
    if path is None or _file_hash(path) is None:
        raise _NotDescribable(f"{getattr(obj, '__qualname__', obj)!r} has no source file to read")
    code.add(module_name)


def _reachable_files(roots: set) -> set:
    """The source files of the modules `roots` names and of the modules their globals reach (as a
    module, or the module of a function or class, also inside a dict: a registry of attention
    functions): the code a forward may call. The search goes on through the roots' own packages
    (transformers, the user's) and stops one module into any other, so what else a process has
    imported does not change the key; torch's and the standard library's code is left to the
    key's versions."""
    packages = {name.partition(".")[0] for name in roots}
    files, seen, todo = set(), set(), list(roots)
    while todo:
        name = todo.pop()
        top = name.partition(".")[0]
        if name in seen or top == "torch" or top in sys.stdlib_module_names:
            continue
        seen.add(name)
        module = sys.modules.get(name)
        path = getattr(module, "__file__", None)
        if not path or not path.endswith(".py"):
            continue
        files.add(path)
        # a package's namespace holds whichever of its submodules (and, lazily, their classes) this process
        # has imported so far: walking it would make the key depend on that. Its own file is in the key.
        if top not in packages or hasattr(module, "__path__"):
            continue
        for value in list(vars(module).values()):
            for v in list(value.values()) if type(value) is dict else (value,):   # a lazy mapping would import
                if isinstance(v, types.ModuleType):
                    todo.append(v.__name__)
                elif isinstance(v, (type, types.FunctionType)):
                    todo.append(getattr(v, "__module__", None) or "")
    return files


def _describe_input(value, code: set):
    if isinstance(value, torch.Tensor):
        return "tensor", tuple(value.shape), str(value.dtype), value.device.type, value.requires_grad
    return _describe(value, code)


def _describe(value, code: set, depth: int = 0, seen: frozenset = frozenset()):
    """A stable, hashable description of an attribute, input constant or dynamic_shapes entry."""
    if value is None or isinstance(value, (bool, int, float, complex, str, bytes)):
        return type(value).__name__, value
    if isinstance(value, (torch.dtype, torch.device, torch.layout, torch.memory_format, enum.Enum)):
        return type(value).__name__, str(value)
    if isinstance(value, torch.Tensor):   # a tensor attribute (not a buffer): a constant of the graph
        return "tensor", tuple(value.shape), str(value.dtype), value.device.type
    if isinstance(value, torch.nn.Module):   # listed among the modules when registered; otherwise its class
        return "module", _describe_class(type(value), code)
    if id(value) in seen or depth > 8:
        raise _NotDescribable(f"a cycle or a deep nest of objects: {type(value).__name__}")
    seen = seen | {id(value)}
    if isinstance(value, (list, tuple)):
        return type(value).__name__, tuple(_describe(v, code, depth + 1, seen) for v in value)
    if isinstance(value, (set, frozenset)):
        return type(value).__name__, tuple(sorted(repr(_describe(v, code, depth + 1, seen)) for v in value))
    if isinstance(value, dict):
        return "dict", tuple(sorted((repr(k), _describe(v, code, depth + 1, seen)) for k, v in value.items()))
    if isinstance(value, (types.FunctionType, types.MethodType, type)) or inspect.isbuiltin(value):
        fn = getattr(value, "__func__", value)
        _note_code(fn, code)
        return "code", getattr(fn, "__module__", None), getattr(fn, "__qualname__", repr(fn))
    if hasattr(value, "__dict__"):   # a config object and the like: its class and its fields
        fields = {k: v for k, v in vars(value).items() if k not in _VOLATILE_FIELDS}
        return "object", _describe_class(type(value), code), _describe(fields, code, depth + 1, seen)
    text = repr(value)
    if _NO_ADDRESS.search(text):
        raise _NotDescribable(f"{type(value).__name__} has no stable description ({text})")
    return type(value).__name__, text


def _file_hash(path: str) -> str | None:
    try:
        return hashlib.sha256(pathlib.Path(path).read_bytes()).hexdigest()
    except OSError:
        return None


# --------------------------------------------------------------------------- entries

class _NotStorable(Exception):
    """The capture holds something an entry cannot (a submodule graph, a target that is no operator)."""


@dataclasses.dataclass(frozen=True)
class _Ref:
    """A node argument in an entry: the name of the node it refers to."""
    name: str


def _store(path: pathlib.Path, key: str, cap: Captured) -> None:
    try:
        entry = {"key": key, **_records(cap)}
        data = pickle.dumps(entry, protocol=pickle.HIGHEST_PROTOCOL)
    except (_NotStorable, pickle.PicklingError, TypeError, AttributeError, ImportError) as e:
        log.debug("capture not cached: %s", e)
        return
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path.parent, prefix=path.name, suffix=".tmp", delete=False) as f:
            tmp = f.name
            f.write(data)
        os.replace(tmp, path)   # atomic: a reader sees the old entry or the new one, never half of one
    except OSError as e:
        log.debug("capture cache not written (%s): %s", path, e)
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


def _load(path: pathlib.Path, key: str) -> Captured | None:
    """The entry at `path` as a Captured, None if there is none, it is not this key's, or it is unreadable."""
    try:
        entry = pickle.loads(path.read_bytes())
        if not isinstance(entry, dict) or entry.get("key") != key:
            return None
        return _captured(entry)
    except FileNotFoundError:
        return None
    except Exception as e:   # a corrupt or foreign entry is a miss: it is traced again and rewritten
        log.debug("capture cache entry %s ignored: %s: %s", path, type(e).__name__, e)
        return None


def _records(cap: Captured) -> dict:
    storages: dict = {}   # storage id -> (its number, its size in bytes)
    nodes = []
    for node in cap.graph.nodes:
        if node.op not in ("placeholder", "call_function", "output"):
            raise _NotStorable(f"a {node.op} node ({node.name})")
        args, kwargs = _arg_record(node.args), _arg_record(node.kwargs)
        meta = {k: node.meta[k] for k in ("nn_module_stack", "stack_trace") if k in node.meta}
        nodes.append((node.op, node.name, _target_record(node.target), args, kwargs,
                      _val_record(node.meta.get("val"), storages), meta))
    fields = ("info", "symbols", "hints", "input_names", "input_keys", "constant_inputs", "aliases", "ranges")
    return {"nodes": nodes, "storages": {n: size for n, size in storages.values()},
            "fields": {f: getattr(cap, f) for f in fields}}


def _arg_record(a):
    """A node's argument with plain lists and dicts (fx's immutable ones are fx's own types) and node names."""
    if isinstance(a, fx.Node):
        return _Ref(a.name)
    if isinstance(a, (list, tuple)) and not hasattr(a, "_fields"):
        return (tuple if isinstance(a, tuple) else list)(_arg_record(x) for x in a)
    if isinstance(a, dict):
        return {k: _arg_record(v) for k, v in a.items()}
    return a


def _target_record(target):
    if isinstance(target, str):
        return "name", target
    if operator_name(target) is not None:
        return "op", operator_name(target)   # e.g. aten.add.Tensor: the operator is looked up again on load
    module, name = getattr(target, "__module__", None), getattr(target, "__qualname__", None)
    if module is None or name is None or _resolved(module, name) is not target:
        raise _NotStorable(f"target {target!r} cannot be looked up by name")
    return "function", module, name


def _resolved(module: str, qualname: str):
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _target(record):
    kind, *where = record
    if kind == "name":
        return where[0]
    if kind == "op":
        return operator_named(where[0])
    return _resolved(*where)


def _val_record(val, storages: dict):
    """A node's value as an entry keeps it: a tensor's layout at the example's sizes and its storage's number."""
    if isinstance(val, torch.Tensor):
        sid = storage_id(val)
        if sid not in storages:
            storages[sid] = (len(storages), _example(val.untyped_storage().nbytes()))
        return ("tensor", storages[sid][0], tuple(_example(d) for d in val.shape),
                tuple(_example(d) for d in val.stride()), _example(val.storage_offset()), val.dtype)
    if isinstance(val, (list, tuple)):
        return "seq", type(val) is tuple, [_val_record(v, storages) for v in val]
    if isinstance(val, torch.SymInt):   # a size computed in the graph: planning reads that it is no tensor
        return "value", _example(val)
    if val is None or isinstance(val, (bool, int, float)):
        return "value", val
    raise _NotStorable(f"a node value of type {type(val).__name__}")


def _example(size) -> int:
    if isinstance(size, int):
        return size
    try:
        return symint_hint(size)
    except TypeError:
        raise _NotStorable(f"a size with no example value: {size}") from None


def _val(record, bases: dict):
    kind, *rest = record
    if kind == "tensor":
        number, shape, stride, offset, dtype = rest
        return torch.empty(0, dtype=dtype, device="meta").set_(bases[number], offset, shape, stride)
    if kind == "seq":
        is_tuple, items = rest
        vals = [_val(v, bases) for v in items]
        return tuple(vals) if is_tuple else vals
    return rest[0]


def _captured(entry: dict) -> Captured:
    # one untyped storage per traced storage: values that shared one share one again (cost/activations.py)
    bases = {n: torch.empty(size, dtype=torch.uint8, device="meta").untyped_storage()
             for n, size in entry["storages"].items()}
    graph = fx.Graph()
    env: dict = {}
    for op, name, target, args, kwargs, val, meta in entry["nodes"]:
        def lookup(a):
            return env[a.name] if isinstance(a, _Ref) else a
        node = graph.create_node(op, _target(target), fx.node.map_aggregate(args, lookup),
                                 fx.node.map_aggregate(kwargs, lookup), name=name)
        if node.name != name:
            node.name = name   # as capture names it (fx would rename a placeholder called `input`)
        node.meta = {**meta, "val": _val(val, bases)}
        env[name] = node
    return Captured(None, graph, **entry["fields"])

