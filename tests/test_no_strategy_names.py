"""Outside ``src/tandem/strategies/`` no code compares against a strategy's name or lists names.

Compared against the registry itself: every string constant in the source (docstrings aside)
that equals a registered strategy name is a name check or a hand-kept list creeping back.
"""

import ast
import pathlib

import tandem
from tandem.strategies import strategy_names

SRC = pathlib.Path(tandem.__file__).parent


def _docstring_nodes(tree: ast.AST) -> set[int]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                found.add(id(body[0].value))
    return found


def name_constants(path: pathlib.Path, root: pathlib.Path = SRC) -> list[str]:
    """``file:line: 'name'`` for every string constant in ``path`` equal to a strategy name."""
    names = set(strategy_names())
    tree = ast.parse(path.read_text())
    docstrings = _docstring_nodes(tree)
    return [f"{path.relative_to(root)}:{node.lineno}: {node.value!r}"
            for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str)
            and node.value in names and id(node) not in docstrings]


def test_no_strategy_name_outside_strategies():
    offenders = [hit for path in sorted(SRC.rglob("*.py"))
                 if "strategies" not in path.relative_to(SRC).parts
                 for hit in name_constants(path)]
    assert offenders == []


def test_the_check_sees_a_name_comparison(tmp_path):
    """The check itself must fail on code that asks for a name."""
    probe = tmp_path / "probe.py"
    probe.write_text('"""dp in a docstring is fine."""\n'
                     'def f(s):\n    return s.name == "ddp" or s in ("single", "dp")\n')
    hits = name_constants(probe, tmp_path)
    assert [h.split(": ")[1] for h in hits] == ["'ddp'", "'single'", "'dp'"]
