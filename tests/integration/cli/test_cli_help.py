"""`tandem SUBCOMMAND --help` against the parser itself: every option with a default says it."""

import argparse

import pytest
from conftest import run_in_process

from tandem.cli.main import SUBCOMMANDS, build_parser


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


def _entries(help_text: str) -> dict[str, str]:
    """Each option's entry in ``--help`` (its flags line and the indented lines below it),
    keyed by every flag it lists, with the wrapping undone."""
    entries, current = {}, None
    for line in help_text.splitlines():
        if line.startswith("  -"):
            current = [line]
            head = line.split("  ")[1]  # "-b N, --batch-size N"
            for flag in head.split(", "):
                entries[flag.split()[0]] = current
        elif current is not None and line.startswith("    "):
            current.append(line)
        else:
            current = None
    return {flag: " ".join(" ".join(lines).split()) for flag, lines in entries.items()}


@pytest.mark.parametrize("command", SUBCOMMANDS)
def test_every_option_with_a_default_shows_it(command):
    proc = run_in_process(command, "--help")
    assert proc.returncode == 0, proc.stderr
    entries = _entries(proc.stdout)
    checked = 0
    for action in _subparsers()[command]._actions:
        if not action.option_strings or action.nargs == 0:
            continue  # positionals, and switches such as --amp (off unless given)
        if action.default is None or action.default is argparse.SUPPRESS:
            continue
        entry = entries[action.option_strings[0]]
        assert "default" in entry and str(action.default) in entry, (command, entry)
        checked += 1
    assert checked  # the parser was really read


def test_the_defaults_the_issue_names():
    """eval's -b (the run's own) and bench's --seed and -j (0, which was hidden as 'False')."""
    eval_help = _entries(run_in_process("eval", "--help").stdout)
    assert "(default: the run's --batch-size; 32 for a file from elsewhere)" in eval_help["-b"]
    assert "(default: the file's 'arch'" in eval_help["-a"]
    bench_help = _entries(run_in_process("bench", "--help").stdout)
    assert bench_help["--seed"].endswith("(default: 0)")
    assert bench_help["-j"].endswith("(default: 0)")
    launch_help = _entries(run_in_process("launch", "--help").stdout)
    assert launch_help["--max-restarts"].endswith("(default: 0)")
    train_help = _entries(run_in_process("train", "--help").stdout)
    assert train_help["--augment"].count("default") == 1  # said once, in words
    assert train_help["-b"].endswith("(default: 32)")


@pytest.mark.parametrize("command", ["train", "eval"])
def test_data_help_says_how_a_flat_imagefolder_is_split(command):
    entry = _entries(run_in_process(command, "--help").stdout)["--data"]
    assert "without train/ and val/ is split 80/20 per class by a fixed shuffle, the same " \
           "whatever --seed" in entry
