"""``argparse`` flags from the config dataclasses' ``metadata`` (``tandem.config.opt``), and
back; choices are checked by the dataclass, so a bad value gives the same one-line error from
the command line, a config file or a checkpoint.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import os
import re
import sys
import types
import typing
import warnings

from tandem.config import flag_for, flag_of, flagged
from tandem.distributed.env import Environment, in_torchrun, is_main_process
from tandem.errors import TandemError, first_line
from tandem.suggest import did_you_mean

_GIVEN = "given_fields"  # namespace attribute: the dests whose flag was typed
# argparse's words for a value outside an argument's choices, and the quoted names in them
_INVALID_CHOICE = re.compile(r"argument (.+?): invalid choice: '(.*?)' \(choose from (.*)\)$")
_QUOTED = re.compile(r"'([^']*)'")


class _Recorded(argparse.Action):
    """Store a flag's value and note that it was given (``--resume`` must know which were)."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, self.const if self.nargs == 0 else values)
        setattr(namespace, _GIVEN, set(getattr(namespace, _GIVEN, ())) | {self.dest})


class ShowDefaults:
    """Formatter mix-in: an option's help ends with ``(default: X)``, except for options without
    a value or a default, and help that says its default in words."""

    def _get_help_string(self, action):
        text = action.help or ""
        if (action.option_strings and action.nargs != 0 and action.default is not None
                and action.default is not argparse.SUPPRESS and "default" not in text):
            text += " (default: %(default)s)"
        return text


class TandemParser(argparse.ArgumentParser):
    """``ArgumentParser`` whose help shows every default and whose errors are one line."""

    def __init__(self, *args, formatter_class=argparse.HelpFormatter, **kwargs):
        if not issubclass(formatter_class, ShowDefaults):
            formatter_class = type(f"ShowDefaults{formatter_class.__name__}",
                                   (ShowDefaults, formatter_class), {})
        super().__init__(*args, formatter_class=formatter_class, **kwargs)

    def add_subparsers(self, **kwargs):
        """The subcommands' action, kept: a mistyped flag is then blamed on its subcommand."""
        self.commands = super().add_subparsers(**kwargs)
        return self.commands

    def parse_args(self, args=None, namespace=None):
        """argparse's, with unknown arguments refused by the subcommand that got them."""
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            commands = getattr(self, "commands", None)
            chosen = commands.choices.get(getattr(parsed, commands.dest, None), self) \
                if commands is not None else self
            chosen.unrecognized(extras)
        return parsed

    def unrecognized(self, extras: list[str]):
        """One line for unknown arguments, with the closest flag for each mistyped one."""
        options = [o for o in self._option_string_actions if o.startswith("--")]
        hints = [f"{flag}{hint}" if len(extras) > 1 else hint.removeprefix(": ")
                 for flag in (e.split("=", 1)[0] for e in extras if e.startswith("-"))
                 if (hint := did_you_mean(flag, options))]
        self.error(f"unrecognized arguments: {' '.join(extras)}"
                   + (f"; {'; '.join(hints)}" if hints else ""))

    def error(self, message: str):
        """One line (not argparse's usage block), with the hint a value starting with ``-``
        needs or the close names of a mistyped choice; exit status 2."""
        hint = ""
        if message.endswith("expected one argument"):
            hint = "; a value that starts with '-' is written --flag=VALUE (e.g. --split=-1,2)"
        choice = _INVALID_CHOICE.match(message)
        if choice:
            typed, choices = choice.group(2), _QUOTED.findall(choice.group(3))
            commands = getattr(self, "commands", None)
            if commands is not None and choice.group(1) == commands.metavar:
                message = f"unknown command {typed!r}"
            hint = did_you_mean(typed, choices) or f"; choose one of {', '.join(choices)}"
        self.exit(2, f"{self.prog}: error: {message}{hint} (see {self.prog} --help)\n")


def command_parser(modules: dict, *, version: str | None = None) -> TandemParser:
    """The ``tandem`` parser: a subcommand per module's ``add_parser(subparsers)``."""
    parser = TandemParser(prog="tandem",
                          description="Train convolutional networks on several devices at once.")
    if version is not None:
        parser.add_argument("--version", action="version", version=version)
    sub = parser.add_subparsers(dest="command", metavar="{" + ",".join(modules) + "}")
    sub.required = True
    for module in modules.values():
        module.add_parser(sub)
    return parser


def error_line(exc: TandemError) -> str:
    """``exc`` as the command line says it: one line, each parameter by its flag."""
    return first_line(flagged(exc), limit=None)


def error_lines(exc: TandemError, prog: str = "tandem") -> list[str]:
    """``PROG: error: ...`` and, where ``exc`` has a remedy, ``hint: ...``."""
    remedy = exc.hint(flag_for) if isinstance(exc, TandemError) else None
    return [f"{prog}: error: {error_line(exc)}"] + ([f"hint: {remedy}"] if remedy else [])


def given_fields(args: argparse.Namespace) -> frozenset[str]:
    """Names of the config fields whose flag appeared on the command line."""
    return frozenset(getattr(args, _GIVEN, ()))


def _value_type(annotation) -> type:
    """``int | None`` -> ``int``; ``tuple[str, ...]`` -> ``str`` (the dataclass splits it)."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) != 1:
            raise TypeError(f"cannot derive a flag for {annotation!r}")
        annotation = args[0]
    return str if typing.get_origin(annotation) is tuple else annotation


def add_config_arguments(parser: argparse.ArgumentParser, cls, *, title: str | None = None,
                         only: typing.Iterable[str] | None = None,
                         defaults: dict | None = None) -> None:
    """Add one flag per field of ``cls`` (or of ``only``); ``defaults`` overrides field defaults.
    Fields outside ``__init__`` get none; a bool field's flag sets the opposite of its default."""
    hints = typing.get_type_hints(cls)
    group = parser.add_argument_group(title) if title else parser
    wanted = set(only) if only is not None else None
    for f in dataclasses.fields(cls):
        if not f.init or (wanted is not None and f.name not in wanted):
            continue
        default = (defaults or {}).get(f.name, f.default)
        default = None if default is dataclasses.MISSING else default
        help_text = f.metadata.get("help", "")
        if callable(help_text):  # asked when the parser is built, as choices may be
            help_text = help_text()
        kind = _value_type(hints[f.name])
        if kind is bool:
            group.add_argument(*flag_of(f), dest=f.name, action=_Recorded, nargs=0,
                               const=not f.default, default=default, help=help_text)
            continue
        choices = f.metadata.get("choices")
        if callable(choices):  # asked when the parser is built (e.g. the strategy registry)
            choices = choices()
        metavar = f.metadata.get("metavar") or ("{" + ",".join(choices) + "}" if choices else None)
        extra = ({"nargs": f.metadata["nargs"], "const": f.metadata.get("const")}
                 if f.metadata.get("nargs") else {})
        group.add_argument(*flag_of(f), dest=f.name, type=kind, default=default,
                           metavar=metavar, help=help_text, action=_Recorded, **extra)


def config_from_args(cls, args: argparse.Namespace, **overrides):
    """Build ``cls`` from the attributes of ``args`` named like its fields (absent: default)."""
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)
              if hasattr(args, f.name)}
    return cls(**{**values, **overrides})


_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class _LogLines(logging.Handler):
    """tandem's log records as bare lines: INFO on stdout (or stderr) in the main process only;
    WARNING and above on stderr in every process."""

    def __init__(self, to_stderr: bool):
        super().__init__()
        self.to_stderr = to_stderr
        self.environ = Environment.read()

    def emit(self, record: logging.LogRecord) -> None:
        try:
            if record.levelno >= logging.WARNING:
                print(record.getMessage(), file=sys.stderr)
            elif not in_torchrun(self.environ) or is_main_process(self.environ):
                print(record.getMessage(), file=sys.stderr if self.to_stderr else sys.stdout,
                      flush=True)
        except Exception:
            self.handleError(record)


@contextlib.contextmanager
def tandem_warnings(*, notes_to_stderr: bool = False):
    """Meanwhile tandem's warnings as ``tandem: warning: ...`` and its log lines bare, on stdout
    unless ``notes_to_stderr``; other packages' warnings keep their file and line."""
    default = warnings.formatwarning

    def short(message, category, filename, lineno, line=None):
        if os.path.abspath(filename).startswith(_PACKAGE_DIR):
            return f"tandem: warning: {message}\n"
        return default(message, category, filename, lineno, line)

    warnings.formatwarning = short
    logger, handler = logging.getLogger("tandem"), _LogLines(notes_to_stderr)
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield
    finally:
        warnings.formatwarning = default
        logger.removeHandler(handler)
        logger.setLevel(level)
