"""Which package may import which: the dependency directions of docs/architecture.md
("Module map and dependency rule"), read from the source with ``ast`` (nothing is
imported). Every import counts: module level, inside functions, under TYPE_CHECKING;
relative imports are resolved. A failure names the file, the line and the import.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import NamedTuple

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "architecture.md"

# What each package may import, besides its own modules. A name allows that module and
# everything under it. A row keyed by one module (cluster.membership, cluster.etcd)
# replaces its package's row for that module, and then even its own package is only
# what the row names: the server and the CLI take membership and etcd without the
# ClusterClient behind them. "kvstore" is the top-level package itself (__init__ and
# layout.py, the public re-export of kvstore.core.layout); nothing inside imports it.
# docs/architecture.md carries this table as render_table() writes it.
RULES: dict[str, tuple[str, ...]] = {
    "tiers": (),
    "kvstore.core": ("tiers.errors",),
    "kvstore.transport": ("kvstore.core",),
    # (tiers.prefault: mapping the server's arena ahead of use, as the DRAM tier does)
    "kvstore.client": ("kvstore.core", "kvstore.transport", "tiers.prefault"),
    "kvstore.cluster": ("kvstore.core", "kvstore.client", "kvstore.transport"),
    "kvstore.cluster.membership": ("kvstore.core", "kvstore.cluster.etcd"),
    "kvstore.cluster.etcd": ("kvstore.core",),
    "kvstore.store": ("kvstore.core", "tiers"),
    "kvstore.server": ("kvstore.core", "kvstore.store", "kvstore.transport",
                       "kvstore.cluster.membership", "kvstore.cluster.etcd"),
    "kvstore.cli": ("kvstore.core", "kvstore.client",
                    "kvstore.cluster.membership", "kvstore.cluster.etcd"),
    "kvstore.connector": ("kvstore.core", "kvstore.client", "kvstore.cluster",
                          "kvstore.transport"),
    "kvstore": ("kvstore.core",),
}

OURS = ("kvstore", "tiers")


class Import(NamedTuple):
    path: str  # relative to the repository root
    line: int
    text: str  # the statement as written (relative imports stay relative)
    importer: str  # module name
    target: str  # the module imported, resolved


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def source_files() -> list[Path]:
    return sorted(p for top in OURS for p in (ROOT / top).rglob("*.py")
                  if "__pycache__" not in p.parts)


MODULES = {module_name(p) for p in source_files()}


def package_of(module: str) -> str:
    parts = module.split(".")
    if parts[0] == "tiers":
        return "tiers"
    if len(parts) > 1 and (ROOT / "kvstore" / parts[1] / "__init__.py").exists():
        return f"kvstore.{parts[1]}"
    return "kvstore"


def rule_of(module: str) -> str:
    return module if module in RULES else package_of(module)


def imports_of(path: Path) -> list[Import]:
    importer = module_name(path)
    is_package = path.name == "__init__.py"
    rel = str(path.relative_to(ROOT))
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=rel)):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                here = importer.split(".") if is_package else importer.split(".")[:-1]
                here = here[:len(here) - (node.level - 1)]
                base = ".".join(here + ([node.module] if node.module else []))
            # "from pkg import mod" imports the module pkg.mod; "from mod import name" mod.
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base
                       for a in node.names]
        else:
            continue
        found += [Import(rel, node.lineno, ast.unparse(node), importer, t)
                  for t in dict.fromkeys(targets) if t.split(".")[0] in OURS]
    return found


ALL_IMPORTS = [imp for p in source_files() for imp in imports_of(p)]


def within(target: str, names: tuple[str, ...]) -> bool:
    return any(target == n or target.startswith(n + ".") for n in names)


def allowed(imp: Import) -> bool:
    row = rule_of(imp.importer)
    own_package = row == package_of(imp.importer) and package_of(imp.target) == row
    return own_package or within(imp.target, RULES[row])


@pytest.mark.parametrize("row", list(RULES))
def test_imports_follow_the_rule(row):
    bad = [imp for imp in ALL_IMPORTS if rule_of(imp.importer) == row and not allowed(imp)]
    if bad:
        may = ", ".join(RULES[row]) or "nothing of kvstore"
        pytest.fail(f"{row} may import only its own modules and {may}:\n" + "\n".join(
            f"  {imp.path}:{imp.line}: {imp.text}  ({imp.target})" for imp in bad))


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph as [a, b, ..., a], or None."""
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> list[str] | None:
        if node in path:
            return path[path.index(node):] + [node]
        if node in done:
            return None
        for nxt in sorted(edges.get(node, ())):
            cycle = visit(nxt, path + [node])
            if cycle:
                return cycle
        done.add(node)
        return None

    for start in sorted(edges):
        cycle = visit(start, [])
        if cycle:
            return cycle
    return None


def test_no_import_cycle_between_packages():
    edges: dict[tuple[str, str], Import] = {}
    for imp in ALL_IMPORTS:
        a, b = package_of(imp.importer), package_of(imp.target)
        if a != b:
            edges.setdefault((a, b), imp)
    graph: dict[str, set[str]] = {}
    for a, b in edges:
        graph.setdefault(a, set()).add(b)
    cycle = find_cycle(graph)
    if cycle:
        pytest.fail("import cycle " + " -> ".join(cycle) + ":\n" + "\n".join(
            f"  {e.path}:{e.line}: {e.text}" for e in (edges[p] for p in zip(cycle, cycle[1:]))))


def test_the_rules_themselves_allow_no_cycle():
    graph = {row: {package_of(n) for n in names} - {package_of(row)}
             for row, names in RULES.items()}
    assert find_cycle(graph) is None


def test_every_package_has_a_row_and_every_name_exists():
    assert {package_of(m) for m in MODULES} <= set(RULES), \
        "a new package needs its row in RULES and in docs/architecture.md"
    named = set(RULES) | {n for names in RULES.values() for n in names}
    assert named <= MODULES, f"RULES names modules that do not exist: {named - MODULES}"


def render_table() -> str:
    rows = [f"| `{row}` | {', '.join(f'`{n}`' for n in names) or 'nothing of kvstore'} |"
            for row, names in RULES.items()]
    return "\n".join(["| package | may import (besides itself) |", "|---|---|", *rows])


def test_architecture_doc_has_the_same_table():
    assert render_table() in DOC.read_text(), \
        "docs/architecture.md's dependency table differs from RULES; it should read:\n" \
        + render_table()
