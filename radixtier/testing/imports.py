"""The package's import graph, read from source: what tests/test_layering.py and
tests/test_cache_layering.py check the layering with.

Every import counts, wherever it stands: at the top, inside a function, or under
`if TYPE_CHECKING:` (a loop the type checker needs is a loop in the design).
"""

from __future__ import annotations

import ast
import pathlib
from typing import Dict, List, Mapping, Set

REPO = pathlib.Path(__file__).resolve().parent.parent.parent
# the package's folder in the repository (folders match import names)
ROOTS = {"radixtier": REPO / "radixtier"}


def modules(roots: Mapping[str, pathlib.Path] = ROOTS) -> Dict[str, pathlib.Path]:
    """Import name -> source path of every module under the given package folders."""
    mods: Dict[str, pathlib.Path] = {}
    for pkg, folder in roots.items():
        for path in sorted(folder.rglob("*.py")):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            mods[".".join([pkg] + parts)] = path
    return mods


def imports_of(name: str, path: pathlib.Path, known: Set[str]) -> Set[str]:
    """The modules in `known` that module `name` (at `path`) imports anywhere in its text. An
    import of one of its own packages is not an edge (the package runs first anyway)."""
    is_pkg = path.name == "__init__.py"
    out: Set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = name.split(".")
                base = base[:len(base) - node.level + (1 if is_pkg else 0)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            targets = [target] + [f"{target}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            continue
        out.update(t for t in targets if t in known and t != name and not name.startswith(t + "."))
    return out


def import_graph(mods: Mapping[str, pathlib.Path]) -> Dict[str, Set[str]]:
    known = set(mods)
    return {name: imports_of(name, path, known) for name, path in mods.items()}


def cycles(graph: Mapping[str, Set[str]]) -> List[List[str]]:
    """Strongly connected components of more than one module, or a module importing itself
    (Tarjan's algorithm, iterative: no recursion limit on a deep package)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on: Set[str] = set()
    found: List[List[str]] = []
    for start in graph:
        if start in index:
            continue
        index[start] = low[start] = len(index)
        stack.append(start)
        on.add(start)
        work = [(start, iter(sorted(graph[start])))]
        while work:
            v, children = work[-1]
            for w in children:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1 or v in graph[v]:
                        found.append(sorted(comp))
    return found
