"""The package's import graph follows docs/design.md: layers import only downward, and no module cycles.

Every import counts, also one inside a function or under TYPE_CHECKING: a lazy import is still a
dependency, and a cycle through one is still a cycle a reader has to untangle.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "shardprep"
DESIGN = ROOT / "docs" / "design.md"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """shardprep modules that `name` imports, resolved to modules (`from pkg import mod` counts as pkg.mod)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.add(target)
            found.update(f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in known)
    return {m for m in found if m in known and m != name}


def layer_of(module: str) -> str:
    if module in ("shardprep.errors", "shardprep._version"):
        return "base"
    if module in ("shardprep.run", "shardprep.__main__"):
        return "cli"
    if module == "shardprep":
        return "facade"
    return module.split(".")[1]


def allowed_table() -> dict[str, set[str]]:
    """The `| layer | may import |` table of docs/design.md."""
    table: dict[str, set[str]] = {}
    section = DESIGN.read_text().split("## Allowed imports", 1)[1]
    for line in section.splitlines():
        m = re.match(r"^\| `(\w+)` \| (.*) \|$", line.strip())
        if m:
            table[m.group(1)] = set(re.findall(r"`(\w+)`", m.group(2))) | {m.group(1)}
    return table


def test_every_module_belongs_to_a_layer_of_the_design_table():
    table = allowed_table()
    assert {"base", "manifests", "requant", "prep", "loader", "runtime", "cli"} <= set(table)
    unknown = sorted({layer_of(m) for m in modules()} - set(table))
    assert not unknown, f"layers missing from docs/design.md's table: {unknown}"


def test_imports_only_run_down_the_layers():
    table = allowed_table()
    known = set(modules())
    bad = []
    for name, path in modules().items():
        for target in imports_of(name, path, known):
            if layer_of(target) not in table[layer_of(name)]:
                bad.append(f"{name} ({layer_of(name)}) imports {target} ({layer_of(target)})")
    assert not bad, "\n".join(bad)


def test_the_module_import_graph_has_no_cycles():
    known = set(modules())
    graph = {name: imports_of(name, path, known) for name, path in modules().items()}
    # A package's __init__ re-exporting its own children is not a cycle a reader has to untangle.
    for name in graph:
        graph[name] = {t for t in graph[name] if not t.startswith(name + ".")}
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)


def test_the_checker_sees_a_lazy_upward_import(tmp_path):
    # The checker itself must be able to fail: a function-local import counts.
    path = tmp_path / "mod.py"
    path.write_text("def f():\n    from ..runtime.views import layer_views\n")
    found = imports_of("shardprep.manifests.mod", path, {"shardprep.runtime.views", "shardprep.runtime"})
    assert "shardprep.runtime.views" in found
