"""Size and shape of the autopar package: modules per folder, the longest module and function,
and import cycles between modules. Usage: python scripts/code_stats.py [REPO_DIR]

The limits issue 15 set (no module over ~450 lines, no function over ~60, no cycle) are
checked here by eye; tests/test_layering.py enforces the import direction and cycles.
"""
import ast
import collections
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))
from test_layering import imports_of, module_names   # noqa: E402  (one parser for both)

import networkx as nx   # noqa: E402


def main(repo: pathlib.Path) -> None:
    package = repo / "autopar"
    known = module_names(package)
    per_folder = collections.Counter(str(p.parent.relative_to(repo)) for p in known.values())
    lines = {str(p.relative_to(repo)): len(p.read_text().splitlines()) for p in known.values()}
    functions = []
    for p in known.values():
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                functions.append((node.end_lineno - node.lineno + 1, f"{p.relative_to(repo)}:{node.name}"))
    graph = nx.DiGraph((m, t) for m, p in known.items() for t, _ in imports_of(m, p, known))
    cycles = list(nx.simple_cycles(graph))
    print(f"modules per folder: {dict(sorted(per_folder.items()))} ({len(known)} in all)")
    print(f"longest module: {max(lines.items(), key=lambda kv: kv[1])}; over 450 lines: "
          f"{sorted((n, f) for f, n in lines.items() if n > 450)}")
    print(f"longest function: {max(functions)}; over 60 lines: {sorted(f for f in functions if f[0] > 60)}")
    print(f"import cycles: {len(cycles)} {cycles[:5]}")


if __name__ == "__main__":
    main(pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else pathlib.Path(__file__).resolve().parents[1]))
