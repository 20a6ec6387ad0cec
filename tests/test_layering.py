"""autopar's modules import in one direction: capture -> sharding -> cost -> search -> plan -> runtime.

Every module's imports are read with `ast` (function-level imports too, since a lazy import
is still a dependency), resolved to autopar's own modules, and checked against the chain:
a module may import from its own stage or an earlier one, never a later one. Imports must
also form no cycle, and nothing outside autopar/testing/ may import autopar.testing (the
harness depends on the library, not the other way round). docs/ARCHITECTURE.md draws the chain.
"""
from __future__ import annotations

import ast
import pathlib
import re
import textwrap

import networkx as nx

REPO = pathlib.Path(__file__).resolve().parents[1]

# Stages in the order data flows; a module belongs to the entry that is it, else the first that is its package.
STAGES = [
    ("base", ("autopar.errors", "autopar.mesh", "autopar._compat")),
    ("capture", ("autopar.capture",)),
    ("sharding", ("autopar.sharding",)),
    ("cost", ("autopar.cost",)),
    ("search", ("autopar.search",)),
    ("plan", ("autopar.planning",)),                     # but planning.plots and planning.progress, named below
    ("runtime", ("autopar.runtime",)),
    ("questions", ("autopar.whatif", "autopar.audit", "autopar.calibrate", "autopar.checkpoint",
                   "autopar.planning.plots")),   # of a finished plan or module
    ("api", ("autopar.api", "autopar.planning.progress")),
    ("cli", ("autopar.cli", "autopar.__main__")),          # the `autopar` command, over the api
    ("package", ("autopar",)),                            # autopar/__init__.py: the public names
]
TESTING = "autopar.testing"


def module_names(package_dir: pathlib.Path) -> dict[str, pathlib.Path]:
    """Dotted module name -> file, for every .py under `package_dir` (a package's name for its __init__)."""
    out = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = list(path.relative_to(package_dir.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def imports_of(name: str, path: pathlib.Path, known: dict) -> list[tuple[str, int]]:
    """(module imported, line) for each import of one of `known`'s modules in the file."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            # `from pkg import mod` imports the module; `from mod import name` the module itself
            candidates = [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in known] or [target]
        elif isinstance(node, ast.Import):
            candidates = [a.name for a in node.names]
        else:
            continue
        for c in candidates:
            while c and c not in known:   # `import autopar.cost.terms` -> that module; a name -> its module
                c = c.rpartition(".")[0]
            if c and c != name:
                found.append((c, node.lineno))
    return found


def stage_of(name: str) -> int | None:
    """Index into STAGES of the module `name`, or None if it is in none: the entry naming the module itself
    wins over one naming its package (autopar.planning.progress is api's, the rest of autopar.planning plan's)."""
    for i, (_, prefixes) in enumerate(STAGES):
        if name in prefixes:
            return i
    for i, (_, prefixes) in enumerate(STAGES):
        if any(p != "autopar" and name.startswith(p + ".") for p in prefixes):
            return i
    return None


def layering_problems(package_dir: pathlib.Path) -> list[str]:
    """Every import against the chain, every import of autopar.testing from the library, every cycle."""
    known = module_names(package_dir)
    graph, problems = nx.DiGraph(), []
    for name, path in known.items():
        graph.add_node(name)
        here = stage_of(name)
        in_testing = name == TESTING or name.startswith(TESTING + ".")
        for target, line in imports_of(name, path, known):
            graph.add_edge(name, target)
            where = f"{path.relative_to(package_dir.parent)}:{line}"
            if target == TESTING or target.startswith(TESTING + "."):
                if not in_testing:
                    problems.append(f"{where}: {name} imports {target}; only tests and autopar.testing may")
                continue
            if in_testing:
                continue
            there = stage_of(target)
            if here is None:
                problems.append(f"{where}: {name} belongs to no stage; add it to STAGES in tests/test_layering.py")
            elif there is not None and there > here:
                chain = " -> ".join(s for s, _ in STAGES[:-2])
                problems.append(f"{where}: {name} ({STAGES[here][0]}) imports {target} ({STAGES[there][0]}), "
                                f"against the direction {chain}")
    for cycle in nx.simple_cycles(graph):
        problems.append("import cycle: " + " -> ".join(cycle + cycle[:1]))
    return problems


def test_autopar_imports_follow_the_stages_and_form_no_cycle():
    problems = layering_problems(REPO / "autopar")
    assert not problems, "\n".join(problems)


def test_every_autopar_module_belongs_to_a_stage():
    lost = [m for m in module_names(REPO / "autopar")
            if stage_of(m) is None and not (m == TESTING or m.startswith(TESTING + "."))]
    assert not lost, f"modules in no stage of STAGES: {lost}"


def test_cost_models_does_not_import_autopar():
    known = {**module_names(REPO / "autopar"), **module_names(REPO / "cost_models")}
    back = [(m, t) for m, p in module_names(REPO / "cost_models").items()
            for t, _ in imports_of(m, p, known) if t.startswith("autopar")]
    assert not back, back


def test_the_plan_has_its_own_room_and_autopar_plan_stays_the_function():
    """The plan's modules live in autopar/planning/, not autopar/plan/: a subpackage named `plan` would put a
    module where the function `autopar.plan` is (importing autopar.plan.text sets the package's attribute).
    Whatever planning module is imported, `autopar.plan` is the API's function; the top of the package keeps
    only what a user imports or runs."""
    import importlib

    import autopar
    import autopar.api

    planning = [m for m in module_names(REPO / "autopar") if m == "autopar.planning" or m.startswith("autopar.planning.")]
    assert len(planning) > 1, planning
    for name in sorted(planning):
        importlib.import_module(name)
    assert callable(autopar.plan) and autopar.plan is autopar.api.plan
    assert not (REPO / "autopar" / "plan").exists() and not (REPO / "autopar" / "plan.py").exists()
    top = sorted(p.name for p in (REPO / "autopar").glob("*.py"))
    assert len(top) <= 10, top


def _package(tmp_path: pathlib.Path, files: dict) -> pathlib.Path:
    root = tmp_path / "autopar"
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return root


def test_the_check_catches_an_import_against_the_direction(tmp_path):
    root = _package(tmp_path, {
        "__init__.py": "",
        "cost/__init__.py": "",
        "cost/predict.py": "def f():\n    from ..search.ilp import solve   # lazy, still a dependency\n",
        "search/__init__.py": "",
        "search/ilp.py": "from ..cost.predict import f\n",
    })
    problems = layering_problems(root)
    assert any("autopar.cost.predict (cost) imports autopar.search.ilp (search)" in p for p in problems), problems
    assert any(p.startswith("import cycle:") for p in problems), problems


def test_the_check_catches_the_library_importing_its_test_harness(tmp_path):
    root = _package(tmp_path, {
        "__init__.py": "",
        "runtime/__init__.py": "",
        "runtime/module.py": "from autopar.testing import run_gloo\n",
        "testing/__init__.py": "from ..runtime import module\n",
    })
    problems = layering_problems(root)
    assert any("autopar.runtime.module imports autopar.testing" in p for p in problems), problems
    assert not any("testing/__init__" in p and "against" in p for p in problems), problems


# private PyTorch: torch._C, torch._dynamo, torch.distributed.tensor._ops, a tensor's autograd `_base`, ...
_PRIVATE_TORCH = re.compile(r"torch\._[A-Za-z]|torch(\.[a-z_]+)*\._[a-z]|\._base\b")


def test_private_torch_apis_are_used_only_in_compat():
    """A PyTorch upgrade should break one module: autopar/_compat.py."""
    found = []
    for path in sorted((REPO / "autopar").rglob("*.py")):
        if path.name == "_compat.py" and path.parent.name == "autopar":
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if _PRIVATE_TORCH.search(line):
                found.append(f"{path.relative_to(REPO)}:{number}: {line.strip()}")
    assert not found, "\n".join(found)


def test_the_private_api_check_catches_a_view_base_and_a_private_module():
    assert _PRIVATE_TORCH.search("base = t._base")
    assert _PRIVATE_TORCH.search("from torch.distributed.tensor._ops import x")
    assert _PRIVATE_TORCH.search("torch._dynamo.utils.counters")
    assert not _PRIVATE_TORCH.search("torch.distributed.tensor.Shard(0)")


def private_attribute_problems(package_dir: pathlib.Path) -> list[str]:
    """A private name of another autopar module imported; `obj._name` read or written where `obj` is not
    self, cls or super(), outside _compat.py, unless this
    very file defines `_name` (as a function, class, variable or self._name): a module may use its own
    classes' private parts, never another module's, and never torch's (that is _compat.py's job: a private
    name no autopar file defines is torch's or another library's)."""
    files = {p: ast.parse(p.read_text()) for p in sorted(package_dir.rglob("*.py"))}
    defined: dict = {}   # private name -> the files that define it
    for path, tree in files.items():
        for node in ast.walk(tree):
            names = []
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names = [node.name]
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and \
                    isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                names = [node.attr]
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names = [node.id]
            elif isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) and \
                    isinstance(node.slice.value, str) and isinstance(node.ctx, ast.Store):
                names = [node.slice.value]   # self.__dict__["_name"] = ...
            for name in names:
                defined.setdefault(name, set()).add(path)
    found = []
    for path, tree in files.items():
        if path.name == "_compat.py" and path.parent == package_dir:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("autopar")):
                found += [f"{path.relative_to(package_dir.parent)}:{node.lineno}: imports {a.name} from "
                          f"{'.' * node.level}{node.module or ''} (another module's private name)"
                          for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
                continue
            if not (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")):
                continue
            owner = node.value
            if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
                continue
            if isinstance(owner, ast.Call) and isinstance(owner.func, ast.Name) and owner.func.id == "super":
                continue   # an override calling the method it overrides
            if path in defined.get(node.attr, ()):
                continue
            whose = ", ".join(str(p.relative_to(package_dir)) for p in sorted(defined.get(node.attr, ())))
            found.append(f"{path.relative_to(package_dir.parent)}:{node.lineno}: {ast.unparse(node)} "
                         f"({'defined in ' + whose if whose else 'not ours: behind _compat.py'})")
    return found


def test_no_module_reads_another_modules_private_attributes():
    """What a class offers other modules is public (runtime/module.ParallelModule's read-only views, for
    one); its private attributes are its own file's business."""
    problems = private_attribute_problems(REPO / "autopar")
    assert not problems, "\n".join(problems)


def test_the_private_attribute_check_catches_reaching_into_another_module(tmp_path):
    root = _package(tmp_path, {
        "__init__.py": "",
        "runtime/module.py": "class M:\n    def __init__(self):\n        self._table = {}\n"
                             "def own(m):\n    return m._table   # its own file's class: fine\n",
        "runtime/pipeline/stages.py": "def f(pm):\n    return pm._table\n",
        "capture/dtype.py": "def g(module):\n    return module._parameters   # torch's\n",
        "capture/ok.py": "class A(B):\n    def _apply(self, fn):\n        return super()._apply(fn)\n",
        "capture/repeat.py": "from .export import capture, _canonical_names\n",
    })
    problems = private_attribute_problems(root)
    assert any("runtime/pipeline/stages.py:2: pm._table (defined in runtime/module.py)" in p for p in problems), problems
    assert any("capture/dtype.py:2: module._parameters (not ours" in p for p in problems), problems
    assert any("capture/repeat.py:1: imports _canonical_names from .export" in p for p in problems), problems
    assert len(problems) == 3, problems


def runtime_reaches_back(package_dir: pathlib.Path) -> list[str]:
    """Every import of autopar.cost or autopar.search by a module under autopar.runtime: the runtime reads what
    the plan decided (planning/schedule.py records it) and derives nothing from the cost model or the search."""
    known = module_names(package_dir)
    found = []
    for name, path in known.items():
        if name != "autopar.runtime" and not name.startswith("autopar.runtime."):
            continue
        for target, line in imports_of(name, path, known):
            if any(target == p or target.startswith(p + ".") for p in ("autopar.cost", "autopar.search")):
                found.append(f"{path.relative_to(package_dir.parent)}:{line}: {name} imports {target}")
    return found


def test_the_runtime_imports_nothing_of_the_cost_model_or_the_search():
    problems = runtime_reaches_back(REPO / "autopar")
    assert not problems, "\n".join(problems)


def test_the_runtime_check_catches_an_import_of_the_cost_model(tmp_path):
    root = _package(tmp_path, {
        "__init__.py": "",
        "cost/__init__.py": "", "cost/buckets.py": "X = 1\n",
        "search/__init__.py": "", "search/pipeline.py": "Y = 2\n",
        "runtime/__init__.py": "",
        "runtime/lowering/rewrite.py": "from ...cost.buckets import X\n",
        "runtime/pipeline/runner.py": "import autopar.search.pipeline\n",
    })
    problems = runtime_reaches_back(root)
    assert any("runtime/lowering/rewrite.py:1" in p and "autopar.cost.buckets" in p for p in problems), problems
    assert any("runtime/pipeline/runner.py:1" in p and "autopar.search.pipeline" in p for p in problems), problems
    assert len(problems) == 2, problems


def test_the_constants_the_runtime_keeps_are_the_planners():
    """Names both sides spell: the runtime keeps its own copy rather than import the search or the cost model."""
    from autopar.cost.overlap import BUCKET
    from autopar.runtime.pipeline import stages
    from autopar.runtime.reduction import grad_buckets
    from autopar.search import pipeline

    assert grad_buckets.BUCKET == BUCKET
    for name in ("GPIPE", "ONE_F_ONE_B", "INTERLEAVED", "ZERO_BUBBLE"):
        assert getattr(stages, name) == getattr(pipeline, name), name
    assert set(pipeline.SCHEDULES) == {stages.GPIPE, stages.ONE_F_ONE_B, stages.INTERLEAVED, stages.ZERO_BUBBLE}
