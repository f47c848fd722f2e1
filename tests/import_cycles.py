"""The import-cycle check: no module of a package may import itself back, by any path.

Every import counts, those under ``if TYPE_CHECKING:`` and those inside functions too: a loop that only exists
for the type checker, or only at run time, still ties the modules together. Run by ``make lint`` and by the tests:

    python -m tests.import_cycles switchboard
"""

from __future__ import annotations

import sys

import grimp


def import_cycles(package: str) -> list[list[str]]:
    """The groups of modules of ``package`` that import each other in a loop (strongly connected components with
    more than one module, or a module importing itself), each sorted, largest group first."""
    graph = grimp.build_graph(package, cache_dir=None)
    edges = {m: sorted(graph.find_modules_directly_imported_by(m)) for m in sorted(graph.modules)}
    cycles = [sorted(c) for c in _components(edges) if len(c) > 1 or c[0] in edges[c[0]]]
    return sorted(cycles, key=lambda c: (-len(c), c))


def _components(edges: dict[str, list[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components, iterative (a deep import chain must not hit the recursion limit)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(edges[root]))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, targets = work[-1]
            for target in targets:
                if target not in edges:
                    continue
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(edges[target])))
                    break
                if target in on_stack:
                    low[node] = min(low[node], index[target])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    found.append(component)
    return found


def main(argv: list[str]) -> int:
    packages = argv or ["switchboard"]
    failed = False
    for package in packages:
        for cycle in import_cycles(package):
            failed = True
            print(f"import cycle in {package}: {' <-> '.join(cycle)}", file=sys.stderr)
    if not failed:
        print(f"no import cycles in {', '.join(packages)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
