"""Count the figures issue 58 (restraint) sets for the package.

    .venv/bin/python scripts/restraint_figures.py [--detail]

Prints: lines in src/tandem; lines of the benchmark harness inside the package; call sites of
distributed/env.py's readers outside the plan (train/plan.py), cli/ and tandem.fit (api.py);
the sites that decide the precision (calls of amp_precision); the files that handle a lost peer; the files over 300
lines; message templates over 160 characters (the text of a raised error's or a printed
line's string, f-string parts counted as written); and the names in every __all__.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src" / "tandem"
LOST_PEER = ("PeerLost", "lost_peer", "save_at_failure", "after_loss", "peer_loss")


def files() -> list[Path]:
    return sorted(p for p in SRC.rglob("*.py"))


def rel(path: Path) -> str:
    return str(path.relative_to(SRC))


def env_readers() -> set[str]:
    """The functions distributed/env.py defines that read the environment (they take
    ``environ``), and Environment.read."""
    tree = ast.parse((SRC / "distributed" / "env.py").read_text())
    names = {"read"}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
            if any(a.arg == "environ" for a in node.args.args):
                names.add(node.name)
    return names


def calls(tree: ast.AST, names: set[str]):
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) \
                else None
            if name in names and (name != "read" or getattr(f, "value", None) is not None
                                  and getattr(f.value, "id", None) == "Environment"):
                yield node  # "read": Environment.read only, not a file's or a log's


def template(node: ast.AST) -> str:
    """The text a message's string argument is written as (f-string fields as ``{}``)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return template(node.left) + template(node.right)
    return ""


def messages(tree: ast.AST):
    """(line, text) of each raised error's first argument and each print's first argument."""
    for node in ast.walk(tree):
        call = None
        if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call):
            call = node.exc
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
                node.func.id == "print":
            call = node
        if call is not None and call.args:
            text = template(call.args[0])
            if text:
                yield call.lineno, text


def main(detail: bool) -> None:
    readers = env_readers()
    lines = bench = 0
    reader_sites, precision_sites, lost, long_files, long_messages = [], [], [], [], []
    all_names = 0
    for path in files():
        text = path.read_text()
        n = text.count("\n")
        lines += n
        name = rel(path)
        if name.startswith("bench/"):
            bench += n
        if n > 300:
            long_files.append(f"{name} ({n})")
        tree = ast.parse(text)
        # the plan, and the entries that read the environment once: the CLI and tandem.fit
        outside = not (name == "train/plan.py" or name.startswith("cli/")
                       or name == "distributed/env.py" or name == "api.py")
        if outside:
            reader_sites += [f"{name}:{c.lineno}" for c in calls(tree, readers)]
        precision_sites += [f"{name}:{c.lineno}" for c in calls(tree, {"amp_precision"})]
        if any(word in text for word in LOST_PEER):
            lost.append(name)
        long_messages += [f"{name}:{ln} ({len(t)})" for ln, t in messages(tree) if len(t) > 160]
        for node in tree.body:
            if isinstance(node, ast.Assign) and any(
                    isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
                all_names += len(getattr(node.value, "elts", []))
    rows = [("lines in src/tandem", lines, None),
            ("lines of bench inside the package", bench, None),
            ("env.py reader call sites outside the plan and cli/", len(reader_sites),
             reader_sites),
            ("sites that decide the precision (amp_precision calls)", len(precision_sites),
             precision_sites),
            ("files that handle a lost peer", len(lost), lost),
            ("files over 300 lines", len(long_files), long_files),
            ("message templates over 160 characters", len(long_messages), long_messages),
            ("__all__ names", all_names, None)]
    for label, value, where in rows:
        print(f"{label}: {value}")
        if detail and where:
            for w in where:
                print(f"    {w}")


if __name__ == "__main__":
    main("--detail" in sys.argv[1:])
