"""Count the figures issue 47 sets for the house around the engine.

    .venv/bin/python scripts/house_figures.py [--detail]

Prints: import cycles among tandem modules (imports inside functions included),
modules outside tandem_bench/ and cli/ that import tandem_bench, files in train/,
imports of tandem modules inside functions, files that read the environment,
raised errors outside cli/ whose message names a --flag, and __all__ names.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src"
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]+")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def resolve(mod: str, is_pkg: bool, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = mod.split(".")
    if not is_pkg:
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports(path: Path, modules: set[str]):
    """(target, inside_function) for every import of a tandem module."""
    mod = module_name(path)
    tree = ast.parse(path.read_text())
    out = []

    def visit(node, in_fn):
        for child in ast.iter_child_nodes(node):
            fn = in_fn or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                for a in child.names:
                    if a.name.startswith("tandem"):
                        out.append((a.name, fn))
            elif isinstance(child, ast.ImportFrom):
                target = resolve(mod, path.name == "__init__.py", child)
                if not target.startswith("tandem"):
                    continue
                # one import statement is one import, however many names it takes
                seen = {f"{target}.{a.name}" if f"{target}.{a.name}" in modules else target
                        for a in child.names}
                out.extend((t, fn) for t in sorted(seen))
            elif isinstance(child, ast.If) and _type_checking(child):
                continue
            visit(child, fn)

    visit(tree, False)
    return out


def _type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING"
    )


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def strong(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in graph:
        if v not in index:
            strong(v)
    return out


def env_reads(tree: ast.AST) -> int:
    n = 0
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv", "environb"):
            if isinstance(node.value, ast.Name) and node.value.id == "os":
                n += 1
        elif isinstance(node, ast.ImportFrom) and node.module == "os":
            n += sum(a.name in ("environ", "getenv") for a in node.names)
    return n


def flag_errors(tree: ast.AST) -> int:
    n = 0
    for node in ast.walk(tree):
        if isinstance(node, ast.Raise) and node.exc is not None:
            text = " ".join(
                c.value for c in ast.walk(node.exc)
                if isinstance(c, ast.Constant) and isinstance(c.value, str)
            )
            if FLAG.search(text):
                n += 1
    return n


def main(detail: bool) -> None:
    files = sorted(SRC.rglob("*.py"))
    modules = {module_name(p) for p in files}
    graph: dict[str, set[str]] = {}
    inside, bench_users, env_files, flag_files, all_names = [], [], {}, {}, 0
    for p in files:
        mod = module_name(p)
        tree = ast.parse(p.read_text())
        for target, in_fn in imports(p, modules):
            if target == mod or target not in modules:
                continue
            graph.setdefault(mod, set()).add(target)
            if in_fn:
                inside.append(f"{mod} -> {target}")
            if (target == "tandem_bench" or target.startswith("tandem_bench.")) and not (
                mod.startswith("tandem_bench") or mod.startswith("tandem.cli")
            ):
                bench_users.append(f"{mod} -> {target}")
        if n := env_reads(tree):
            env_files[mod] = n
        if not mod.startswith("tandem.cli") and (n := flag_errors(tree)):
            flag_files[mod] = n
        for node in tree.body:
            if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
            ) and isinstance(node.value, (ast.List, ast.Tuple)):
                all_names += len(node.value.elts)
    # a package imports its submodules' package face; an edge to a package counts its __init__
    cyc = cycles(graph)
    train = [p for p in (SRC / "tandem" / "train").glob("*.py")]
    print(f"import cycles (imports inside functions included): {len(cyc)}")
    for c in cyc:
        print(f"  {len(c)} modules: {' '.join(c) if detail or len(c) < 8 else ' '.join(c[:8]) + ' ...'}")
    print(f"modules outside tandem_bench/ and cli/ importing tandem_bench: {len(bench_users)}")
    for b in bench_users:
        print(f"  {b}")
    print(f"files in train/: {len(train)}")
    print(f"imports of tandem modules inside functions: {len(inside)}")
    if detail:
        for i in inside:
            print(f"  {i}")
    print(f"files reading the environment: {len(env_files)} ({sum(env_files.values())} reads)")
    for m, n in sorted(env_files.items()):
        print(f"  {m}: {n}")
    print(f"raised errors outside cli/ naming a --flag: {sum(flag_files.values())}")
    if detail:
        for m, n in sorted(flag_files.items()):
            print(f"  {m}: {n}")
    print(f"__all__ names: {all_names}; modules: {len(files)}; lines: "
          f"{sum(len(p.read_text().splitlines()) for p in files)}")


if __name__ == "__main__":
    main("--detail" in sys.argv)
