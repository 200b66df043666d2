"""The embedded cache's parts form a DAG: no import loop (TYPE_CHECKING and function-level imports
included), shared state holds data only, and a finished transfer's outcome is applied in one place."""

from __future__ import annotations

import ast
import dataclasses
import pathlib
from typing import Dict, Set

from radixtier.testing.imports import cycles as _cycles
from radixtier.testing.imports import import_graph, imports_of

CACHE = pathlib.Path(__file__).resolve().parent.parent / "radixtier" / "cache"
PKG = "radixtier.cache"


def _modules() -> Dict[str, pathlib.Path]:
    return {(PKG if p.stem == "__init__" else f"{PKG}.{p.stem}"): p for p in sorted(CACHE.glob("*.py"))}


def _imports(name: str, path: pathlib.Path, mods: Set[str]) -> Set[str]:
    return imports_of(name, path, mods)


def _graph() -> Dict[str, Set[str]]:
    return import_graph(_modules())


def test_the_checker_sees_type_checking_and_function_level_imports(tmp_path):
    """The graph counts the imports that the old loop hid under `if TYPE_CHECKING:`."""
    src = ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from radixtier.cache.writer import Writer\n"
           "def f():\n    from radixtier.cache import evictor\n")
    path = tmp_path / "probe.py"
    path.write_text(src)
    mods = {f"{PKG}.probe", f"{PKG}.writer", f"{PKG}.evictor", PKG}
    assert _imports(f"{PKG}.probe", path, mods) == {f"{PKG}.writer", f"{PKG}.evictor"}
    assert _cycles({"a": {"b"}, "b": {"a"}, "c": set()}) == [["a", "b"]]


def test_the_cache_package_has_no_import_loop():
    assert _cycles(_graph()) == []


def test_no_two_cache_modules_import_each_other():
    graph = _graph()
    both = sorted({tuple(sorted((a, b))) for a, targets in graph.items() for b in targets if a in graph[b]})
    assert both == []


def test_shared_state_is_data_only():
    """CacheState holds what the parts share, never the parts: none is reachable through it."""
    from radixtier.cache.state import CacheState

    names = {f.name for f in dataclasses.fields(CacheState)}
    assert not names & {"writer", "evictor", "completions", "outcomes", "launcher", "planner", "transfers"}
    parts = {f"{PKG}.{m}" for m in ("writer", "evictor", "completions", "outcomes", "transfers", "planner", "facade")}
    assert not _graph()[f"{PKG}.state"] & parts


def test_the_parts_call_down_only():
    """The writer uses the evictor, both use the launcher; outcomes only report (they import no
    part that starts work), and the launcher imports no part above it."""
    graph = _graph()
    above_launcher = {f"{PKG}.{m}" for m in ("writer", "evictor", "outcomes", "planner", "facade")}
    assert not graph[f"{PKG}.transfers"] & above_launcher
    assert not graph[f"{PKG}.outcomes"] & {f"{PKG}.{m}" for m in ("writer", "evictor", "planner", "facade")}
    assert not graph[f"{PKG}.evictor"] & {f"{PKG}.{m}" for m in ("writer", "outcomes", "planner", "facade")}
    assert not graph[f"{PKG}.writer"] & {f"{PKG}.{m}" for m in ("outcomes", "planner", "facade")}
    assert not graph[f"{PKG}.handle"] & {f"{PKG}.planner"}


def test_cache_modules_are_small_and_documented():
    for name, path in _modules().items():
        src = path.read_text()
        assert len(src.splitlines()) < 600, name
        assert ast.get_docstring(ast.parse(src)), f"{name} has no module docstring"
