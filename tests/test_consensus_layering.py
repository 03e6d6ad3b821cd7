"""The engine apart from the application (issue 17): ``ps_p2p.consensus`` imports nothing of
PlanetServe's application packages, and no two of the packages consensus, registry,
verification import each other (the layering engine <- application, no cycle).

Read from the source with :mod:`ast` (every ``import`` / ``from ... import`` anywhere in a
module, inside functions too; only blocks under ``if TYPE_CHECKING:`` are skipped, since they
never run), so a lazy import inside a function counts as a dependency as well."""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent / "ps_p2p"
ENGINE = "consensus"
APPLICATION = ("registry", "verification", "roles", "protocols", "node", "cli", "serving")


def _type_checking_blocks(tree: ast.AST) -> set[int]:
    """ids of the nodes inside ``if TYPE_CHECKING:`` blocks."""
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and (
                (isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING")
                or (isinstance(node.test, ast.Attribute) and node.test.attr == "TYPE_CHECKING")):
            for child in node.body:
                skip.update(id(n) for n in ast.walk(child))
    return skip


def imported_packages(package: str) -> dict[str, set[str]]:
    """ps_p2p sub-package (or top module) -> the modules of ``package`` that import it."""
    out: dict[str, set[str]] = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        skip = _type_checking_blocks(tree)
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            for name in names:
                parts = name.split(".")
                if parts[0] == "ps_p2p" and len(parts) > 1 and parts[1] != package:
                    out.setdefault(parts[1], set()).add(path.name)
    return out


def test_the_consensus_engine_imports_nothing_of_the_application():
    deps = imported_packages(ENGINE)
    assert {p: sorted(m) for p, m in deps.items() if p in APPLICATION} == {}
    # what it may use: the error tree and the signed-record helpers (canonical encoding, peer
    # IDs, signatures, limits), both below every package of PlanetServe's roles
    assert set(deps) <= {"errors", "records"}, sorted(deps)


def test_registry_and_verification_do_not_import_each_other_and_neither_is_imported_by_the_engine():
    graph = {p: set(imported_packages(p)) for p in (ENGINE, "registry", "verification")}
    cycles = [(a, b) for a in graph for b in graph
              if a < b and b in graph[a] and a in graph[b]]
    assert cycles == [], {a: sorted(graph[a] & set(graph)) for a in graph}
    assert "registry" in graph["verification"] or "verification" in graph["registry"]
