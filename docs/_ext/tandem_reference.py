"""Reference pages written from the code at each build: the CLI and the strategies.

``cli_markdown()`` walks ``tandem.cli.main.build_parser()``: every subcommand, every argument
group, every flag with its help (as ``--help`` prints it) and its default. ``strategies_markdown()``
lists the registered strategies (``tandem.strategies.strategy_names()``) and documents each
class with autodoc wherever it lives. Both are written into ``docs/_generated/`` when the
builder starts, and pages pull them in with ``{include}`` (and ``:heading-offset:``, as their
headings start at ``#``); so a flag or a strategy added to
the code is on the pages at the next ``make docs``, and a moved module breaks no page.
``python docs/_ext/tandem_reference.py`` prints the CLI page (tests/integration/cli/test_docs.py
uses the same functions).
"""

from __future__ import annotations

import argparse
import os
import re
from pathlib import Path

GENERATED = Path(__file__).resolve().parents[1] / "_generated"


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """The subcommand parsers, in the order ``tandem --help`` lists them."""
    for action in parser._actions:  # argparse has no public accessor for a parser's actions
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def visible_flags(parser: argparse.ArgumentParser) -> list[str]:
    """Every option string that ``--help`` shows (``-a``, ``--arch``, ...)."""
    return [flag for action in parser._actions if action.help != argparse.SUPPRESS
            for flag in action.option_strings]


def _help_text(action: argparse.Action, prog: str) -> str:
    text = action.help or ""
    if "%" in text:
        text = text % {**vars(action), "prog": prog}
    return _markdown_escape(text)


def _markdown_escape(text: str) -> str:
    """Help text as Markdown: `code` stays code; outside it, characters that Markdown would
    read as emphasis or HTML are escaped."""
    parts = re.split(r"(`[^`]*`)", text)
    return "".join(p if p.startswith("`") else re.sub(r"([*<>_\\[\]])", r"\\\1", p)
                   for p in parts)


def _default_text(action: argparse.Action) -> str:
    if action.nargs == 0:  # a switch
        return "off" if not action.default else "on"
    if action.default is None or action.default == argparse.SUPPRESS:
        return ""
    if isinstance(action.default, (list, tuple)):
        value = ",".join(map(str, action.default))
    else:
        value = str(action.default)
    return f"`{value}`" if value else "`''` (empty)"


def _term(action: argparse.Action) -> str:
    if not action.option_strings:  # positional
        return f"`{action.metavar or action.dest}` (positional)"
    if action.nargs == 0:
        return ", ".join(f"`{flag}`" for flag in action.option_strings)
    metavar = action.metavar
    if metavar is None:
        metavar = "{" + ",".join(map(str, action.choices)) + "}" if action.choices \
            else action.dest.upper()
    if isinstance(metavar, tuple):
        metavar = " ".join(metavar)
    if action.nargs == "?":
        metavar = f"[{metavar}]"
    elif action.nargs in ("*", "+"):
        metavar = f"{metavar} ..."
    return ", ".join(f"`{flag} {metavar}`" for flag in action.option_strings)


def _action_markdown(action: argparse.Action, prog: str) -> list[str]:
    lines = [_term(action), f": {_help_text(action, prog) or '(no help text)'}"]
    facts = []
    if action.choices and not isinstance(action, argparse._SubParsersAction):
        facts.append("Choices: " + ", ".join(f"`{c}`" for c in action.choices))
    default = _default_text(action)
    if default:
        facts.append(f"Default: {default}")
    if action.required:
        facts.append("Required")
    if facts:
        lines += ["", "  " + ". ".join(facts) + "."]
    return lines + [""]


def _groups(parser: argparse.ArgumentParser):
    """(title, description, actions) of each argument group with a visible action."""
    for group in parser._action_groups:
        actions = [a for a in group._group_actions
                   if a.help != argparse.SUPPRESS and not isinstance(a, argparse._HelpAction)]
        if actions:
            yield group.title, group.description, actions


def _usage(parser: argparse.ArgumentParser) -> str:
    """``--help``'s usage lines, without the ``usage:`` before them (the continuation lines
    lose as many columns, so that they stay aligned under the first)."""
    lines = parser.format_usage().strip().splitlines()
    cut = len("usage: ")
    return "\n".join([lines[0][cut:], *(line[cut:] for line in lines[1:])])


def cli_markdown() -> str:
    """The CLI reference as MyST Markdown, one section per subcommand."""
    from tandem.cli.main import build_parser

    parser = build_parser()
    out = ["<!-- written by docs/_ext/tandem_reference.py from the argparse parsers -->", ""]
    for name, sub in _subcommands(parser).items():
        out += [f"# tandem {name}", "", (sub.description or "").strip(), "",
                "```text", _usage(sub), "```", ""]
        for title, description, actions in _groups(sub):
            heading = {"options": "options", "optional arguments": "options"}.get(title, title)
            out += [f"## {name}: {heading}", ""]
            if description:
                out += [_markdown_escape(description), ""]
            for action in actions:
                out += _action_markdown(action, sub.prog)
    return "\n".join(out).rstrip() + "\n"


def strategies_markdown() -> str:
    """Each registered strategy's class, documented where it is defined."""
    from tandem.strategies import strategy_class, strategy_names

    out = ["<!-- written by docs/_ext/tandem_reference.py from the strategy registry -->", ""]
    for name in strategy_names():
        cls = strategy_class(name)
        # autodoc's output is reStructuredText: MyST reads it only inside eval-rst
        out += [f"# `{name}`", "", "```{eval-rst}",
                f".. autoclass:: {cls.__module__}.{cls.__qualname__}", "   :members:",
                "   :exclude-members: name", "```", ""]
    return "\n".join(out)


def write_generated(app=None) -> None:
    """Write docs/_generated/*.md, leaving a file that would not change untouched (so Sphinx
    does not re-read the pages that include it)."""
    GENERATED.mkdir(exist_ok=True)
    for name, text in (("cli.md", cli_markdown()), ("strategies.md", strategies_markdown())):
        path = GENERATED / name
        if not path.exists() or path.read_text() != text:
            # whole or not at all: two builds at once (two test workers) never read half a file
            side = path.with_name(f".{name}.{os.getpid()}")
            side.write_text(text)
            os.replace(side, path)


def setup(app):
    app.connect("builder-inited", write_generated)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}


if __name__ == "__main__":
    print(cli_markdown())
