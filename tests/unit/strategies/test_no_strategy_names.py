"""Outside ``src/tandem/strategies/`` no code compares against a strategy's name or lists names.

Compared against the registry itself: every string constant in the source (docstrings aside)
that equals a registered strategy name is a name check or a hand-kept list creeping back, and
so is a list joined in one string (``"single,dp,balanced"``, ``"ddp/torch_ddp"``,
``"(single, ddp)"``) that holds one.
"""

import ast
import pathlib
import re

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


# Words joined by commas, slashes or bars (spaces around them allowed): a list in one string.
_JOINED = re.compile(r"[\w.-]+(?:\s*[,/|]\s*[\w.-]+)+")
_SEPARATOR = re.compile(r"\s*[,/|]\s*")


def _names_in(text: str, names: set[str]) -> list[str]:
    """``text`` itself if it is a name, else every joined list in it that holds a name."""
    if text in names:
        return [text]
    return [m.group() for m in _JOINED.finditer(text)
            if any(item in names for item in _SEPARATOR.split(m.group()))]


def name_constants(path: pathlib.Path, root: pathlib.Path = SRC) -> list[str]:
    """``file:line: 'text'`` for every string constant in ``path`` that is a strategy name or
    holds one in a joined list (``text`` is the name or the list)."""
    names = set(strategy_names())
    tree = ast.parse(path.read_text())
    docstrings = _docstring_nodes(tree)
    return [f"{path.relative_to(root)}:{node.lineno}: {hit!r}"
            for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str)
            and id(node) not in docstrings
            for hit in _names_in(node.value, names)]


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


def test_the_check_sees_names_joined_in_one_string(tmp_path):
    """Lists in one string: a flag's default, a help text, an f-string's text; prose that only
    mentions a name (and lists of other words) passes."""
    probe = tmp_path / "probe.py"
    probe.write_text('"""single,dp in a docstring is fine."""\n'
                     'DEFAULT = "single,dp,balanced"\n'
                     'HELP = f"compile with torch.compile (single, ddp) on {3} devices"\n'
                     'NOTE = "ddp/torch_ddp ran apart"\n'
                     'CHOICES = "a|hybrid"\n'
                     'PROSE = "--strategy ddp needs torchrun; cpu,cuda or auto"\n')
    hits = [h.split(": ", 1)[1] for h in name_constants(probe, tmp_path)]
    assert sorted(hits) == sorted(["'single,dp,balanced'", "'single, ddp'", "'ddp/torch_ddp'",
                                   "'a|hybrid'"])
