"""The documentation site against the code: it builds without a warning, its CLI page holds
every flag that each subcommand's --help shows (with that flag's help and default), and every
code block of README.md and the docs pages is run by a test, marked as output, or uses only
flags that exist.

The site is built once per test process, into a temporary directory (Sphinx, ``-W``: a
warning is an error); the tests that need it are skipped, saying why, only where the ``docs``
extra is not installed (``make test`` installs it).
"""

import argparse
import html
import importlib.util
import re
import shlex
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest
import torch
from conftest import ROOT

DOCS = ROOT / "docs"
sys.path.insert(0, str(DOCS / "_ext"))
sys.path.insert(0, str(ROOT / "scripts"))
import readme_outputs  # noqa: E402
import tandem_reference  # noqa: E402

from tandem.cli.main import build_parser  # noqa: E402

SUBCOMMANDS = tandem_reference._subcommands(build_parser())
DOCS_EXTRA = ("sphinx", "myst_parser", "furo")
MISSING_EXTRA = [name for name in DOCS_EXTRA if importlib.util.find_spec(name) is None]
needs_docs_extra = pytest.mark.skipif(
    bool(MISSING_EXTRA), reason=f"the docs extra is not installed ({', '.join(MISSING_EXTRA)} "
    "missing): pip install -e '.[docs]', as make test and make docs do")


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The built site (its HTML directory); the build's output is in ``site.log``."""
    out = tmp_path_factory.mktemp("docs")
    result = subprocess.run(
        [sys.executable, "-m", "sphinx", "-b", "html", "-W", "--keep-going", "-q",
         "-d", str(out / "doctrees"), str(DOCS), str(out / "html")],
        capture_output=True, text=True, timeout=600, cwd=ROOT)
    (out / "html").mkdir(exist_ok=True)
    (out / "html" / "build.log").write_text(
        f"exit status {result.returncode}\n{result.stdout}\n{result.stderr}")
    return out / "html"


class _Text(HTMLParser):
    """The visible text of a page, by section: ``sections[id]`` is the text of the
    ``<section id=...>`` opened last before it (nested sections feed their parents too)."""

    def __init__(self):
        super().__init__()
        self.open: list[str | None] = []
        self.sections: dict[str, list[str]] = {}
        self.skip = 0

    def handle_starttag(self, tag, attrs):
        if tag in ("script", "style"):
            self.skip += 1
        if tag == "section":
            ident = dict(attrs).get("id")
            self.open.append(ident)
            self.sections.setdefault(ident, [])
        elif tag in ("p", "dt", "dd", "li", "pre", "br", "tr", "h1", "h2", "h3"):
            self._add("\n")

    def handle_endtag(self, tag):
        if tag in ("script", "style"):
            self.skip -= 1
        if tag == "section" and self.open:
            self.open.pop()

    def handle_data(self, data):
        if not self.skip:
            self._add(data)

    def _add(self, text):
        for ident in self.open:
            self.sections[ident].append(text)


def page_sections(page: Path) -> dict[str, str]:
    parser = _Text()
    parser.feed(page.read_text())
    return {ident: " ".join("".join(parts).split()) for ident, parts in parser.sections.items()}


def missing_from(sub: argparse.ArgumentParser, text: str) -> list[str]:
    """What of ``sub``'s --help is not in ``text`` (a subcommand's section of the CLI page):
    each visible flag, the start of its help, and its default."""
    shown = sub.format_help()
    missing = []
    for action in sub._actions:  # argparse has no public accessor for a parser's actions
        if action.help == argparse.SUPPRESS or isinstance(action, argparse._HelpAction):
            continue
        for flag in action.option_strings:
            assert flag in shown, f"{flag} is not in {sub.prog} --help"  # what the user sees
            if not re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", text):
                missing.append(flag)
        words = " ".join((action.help or "").replace("`", "").split()[:6])
        if "%(" not in words and words and words not in text:
            missing.append(f"{'/'.join(action.option_strings) or action.dest}'s help: {words}")
        default = tandem_reference._default_text(action).strip("`")
        if default and action.option_strings and f"Default: {default}" not in text:
            missing.append(f"{'/'.join(action.option_strings)}'s default {default}")
    return missing


@needs_docs_extra
def test_the_docs_build_without_a_warning(site):
    log = (site / "build.log").read_text()
    assert log.startswith("exit status 0"), log[-4000:]
    assert "WARNING" not in log, log[-4000:]
    for page in ("index", "reference/cli", "reference/api", "guides/runs", "benchmarks/index"):
        assert (site / f"{page}.html").is_file(), page


@needs_docs_extra
@pytest.mark.parametrize("name", list(SUBCOMMANDS))
def test_the_cli_page_holds_every_flag_of_the_subcommand_with_help_and_default(site, name):
    sections = page_sections(site / "reference" / "cli.html")
    text = sections.get(f"tandem-{name}")
    assert text, f"no section for tandem {name} on the CLI page"
    assert not (missing := missing_from(SUBCOMMANDS[name], text)), missing


@needs_docs_extra
def test_a_flag_taken_off_the_page_is_found_missing(site):
    """Negative control for the check above: the train section less one flag, one help text
    and one default fails it, each named."""
    text = page_sections(site / "reference" / "cli.html")["tandem-train"]
    assert not missing_from(SUBCOMMANDS["train"], text)
    cut = text.replace("--sync-bn", "--sync-bm").replace("learning-rate schedule", "schedule")
    cut = cut.replace("Default: 0.05", "Default: 0.5")
    missing = missing_from(SUBCOMMANDS["train"], cut)
    assert "--sync-bn" in missing
    assert "--lr/--learning-rate's default 0.05" in missing
    assert any(m.startswith("--lr-schedule's help") for m in missing), missing


@needs_docs_extra
def test_the_api_page_documents_the_package_faces(site):
    text = " ".join(page_sections(site / "reference" / "api.html").values())
    for name in ("tandem.fit", "DataParallel", "DataParallelModel", "DataParallelCriterion",
                 "SyncBatchNorm", "HybridParallel", "create_model", "tandem.checkpoint.save",
                 "tandem.checkpoint.load", "create_strategy", *tandem_strategy_classes()):
        assert name in text, name


@needs_docs_extra
def test_the_api_page_lists_every_parameter_of_tandem_fit(site):
    """Each parameter of tandem.fit's signature has its entry under "Parameters" (autodoc
    lists only the annotated ones unless the docstring names them all)."""
    import inspect

    import tandem

    text = page_sections(site / "reference" / "api.html")["tandem-fit"]
    listed = text.split("Parameters", 1)[1].split("Return", 1)[0]
    for name in inspect.signature(tandem.fit).parameters:
        assert re.search(rf"(?<![\w*]){re.escape(name)} ", listed), (name, listed[:600])


class _Anchors(HTMLParser):
    def __init__(self):
        super().__init__()
        self.ids, self.links = set(), []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if attrs.get("id"):
            self.ids.add(attrs["id"])
        if tag == "a" and attrs.get("href"):
            self.links.append(attrs["href"])


def broken_anchors(site: Path) -> list[str]:
    """The site's links to an anchor (``page.html#id``, ``#id``) that its page does not have
    (the source view's ``[docs]`` links too)."""
    pages = {}
    for page in site.rglob("*.html"):
        parsed = _Anchors()
        parsed.feed(page.read_text())
        pages[page.resolve()] = parsed
    bad = []
    for page, parsed in pages.items():
        for link in parsed.links:
            target, _, anchor = link.partition("#")
            if not anchor or "://" in target:
                continue
            where = (page.parent / target).resolve() if target else page
            if where in pages and anchor not in pages[where].ids:
                bad.append(f"{page.relative_to(site.resolve())}: {link}")
    return bad


@needs_docs_extra
def test_every_anchor_the_site_links_to_exists(site):
    assert not (bad := broken_anchors(site)), bad


def tandem_strategy_classes() -> list[str]:
    from tandem.strategies import strategy_class, strategy_names

    return [strategy_class(n).__qualname__ for n in strategy_names()]


# -- code blocks ----------------------------------------------------------------------------
KINDS = {"python", "console", "text", "bash"}  # and MyST directives: {include}, {toctree}, ...


def fences(page: Path):
    """(line number, kind, lines) of every fenced block of ``page``."""
    lines, i = page.read_text().splitlines(), 0
    while i < len(lines):
        opening = lines[i].strip()
        if opening.startswith("```"):
            end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
            yield i + 1, opening[3:].strip(), [x.strip() for x in lines[i + 1:end]]
            i = end
        i += 1


PAGES = readme_outputs.pages()
BLOCKS = [(page, n, kind, body) for page in PAGES for n, kind, body in fences(page)]


def test_every_code_block_says_what_it_is():
    """python (run by tests/integration/cli/test_readme.py), console or text (output), bash
    (commands whose flags are checked below), or a MyST directive; nothing bare."""
    bare = [f"{page.relative_to(ROOT)}:{n}" for page, n, kind, _ in BLOCKS
            if kind not in KINDS and not kind.startswith("{")]
    assert not bare, f"code blocks without a kind ({', '.join(sorted(KINDS))}): {bare}"
    assert {kind for *_, kind, _ in BLOCKS} >= KINDS


# -- every `tandem ...` command line, through the real parser ------------------------------------
# What stands for a value in a page's command (an argument the reader fills in), and what a
# parse takes instead: `R` and `HOST0` of the several-machines guide, `DIR` of an ImageFolder.
PLACEHOLDERS = {"DIR": "/data/photos", "ARCH": "resnet18", "N": "2", "R": "0",
                "HOST0": "192.0.2.1", "PATH": "out.json", "K": "1"}


def command_lines(page: Path) -> list[tuple[int, str]]:
    """(line number, command) of each shell command a reader may type on ``page``: a bash
    block's lines (continuations joined, comments dropped) and a console block's ``$ `` lines
    whose output shows no error (those show a refusal on purpose, and scripts/readme_outputs.py
    runs them)."""
    found = []
    for n, kind, body in fences(page):
        if kind == "bash":
            joined, first = "", None
            for i, line in enumerate(body):
                first = n + 1 + i if first is None else first
                line = re.sub(r"(^|\s)#.*", "", line)
                if line.endswith("\\"):
                    joined += line[:-1] + " "
                    continue
                if (joined + line).strip():
                    found.append((first, joined + line))
                joined, first = "", None
        elif kind == "console":
            commands = [i for i, line in enumerate(body) if line.startswith("$ ")]
            for i, j in zip(commands, commands[1:] + [len(body)]):
                if not any("error:" in line for line in body[i + 1:j]):
                    found.append((n + 1 + i, body[i][2:]))
    return found


def tandem_argvs(command: str) -> list[list[str]]:
    """The arguments of each ``tandem ...`` (or ``python -m tandem`` / ``torchrun ... -m
    tandem``) in a shell ``command``, each placeholder filled in (``...`` and ``[--flag X]``:
    left out, and the flag taken)."""
    argvs = []
    for part in re.split(r"[;|&]+", command):
        words = shlex.split(part)
        for i, word in enumerate(words):
            if word == "tandem" and (i == 0 or words[i - 1] in ("-m", "srun") or
                                     words[i - 1].endswith("/tandem")):
                argv = [w for w in words[i + 1:] if w != "..."]
                argvs.append([PLACEHOLDERS.get(w.strip("[]"), w.strip("[]")) for w in argv])
                break
    return argvs


def parse_problem(argv: list[str]) -> str | None:
    """What the real command line says of ``argv`` before it runs anything (its parser, then
    the checks of the config it derives: a train's, a bench's, a launch's spec and the command
    it launches), or ``None`` when it takes it."""
    import contextlib
    import io

    from tandem_bench import BenchConfig
    from tandem.cli import launch
    from tandem.cli.common import config_from_args, error_line
    from tandem.cli.train import config_from_namespace
    from tandem.errors import TandemError

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            args = build_parser().parse_args(argv)
        command = argv[0]  # (launch's own `command` is what it launches)
        if command == "train":
            config_from_namespace(args)
        elif command == "bench" and args.arch is not None and (
                torch.cuda.is_available() or "cuda" not in (args.devices or "")):
            config_from_args(BenchConfig, args)  # (it resolves its devices: CUDA ones need one)
        elif command == "launch":
            return parse_problem(launch.spec_of(args).command)
    except SystemExit:
        return err.getvalue().strip() or "exit"
    except TandemError as exc:
        return error_line(exc)
    return None


def test_every_tandem_command_line_in_the_pages_parses_with_the_real_parser():
    """Each command a reader may copy from README.md or a docs page (bash blocks, and the
    console blocks' commands that show no refusal) is taken by `tandem`'s own parser and the
    checks it makes before running anything; a launch line's own flags (its spec) and the
    command it launches too. The prose's inline `tandem ...` are fragments, not lines."""
    checked, bad = [], []
    for page in PAGES:
        for n, command in command_lines(page):
            for argv in tandem_argvs(command):
                checked.append(argv)
                problem = parse_problem(argv)
                if problem is not None:
                    bad.append(f"{page.relative_to(ROOT)}:{n}: tandem {' '.join(argv)}\n"
                               f"    {problem}")
    assert not bad, "\n".join(bad)
    assert len(checked) >= 60
    launches = [argv for argv in checked if argv[0] == "launch"]
    assert any("--nnodes" in argv for argv in launches) and len(launches) >= 8


def test_a_command_line_the_parser_refuses_is_found():
    """Negative control: a launch across machines without --master-port, a mistyped flag in
    a launch's inner command after a continuation line, a bad value, a mistyped subcommand."""
    def problems(lines):
        return [parse_problem(argv) for n, command in _commands(["```bash", *lines, "```"])
                for argv in tandem_argvs(command)]

    def _commands(text_lines):
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            page = Path(tmp) / "page.md"
            page.write_text("\n".join(text_lines) + "\n")
            return command_lines(page)

    [missing_port] = problems(["tandem launch --nnodes 2 --node-rank 0 --master-addr 192.0.2.1 "
                               "--nproc-per-node 8 -- train --strategy ddp"])
    assert "--nnodes 2 needs --master-addr and a non-zero --master-port" in missing_port
    [typo] = problems(["tandem launch --nproc-per-node 2 -- train --strategy ddp \\",
                       "    --sync-bm --data digits   # --not-a-flag in a comment is fine"])
    assert "unrecognized arguments: --sync-bm" in typo
    assert problems(["tandem train --strategy dpp"]) == [
        "unknown --strategy 'dpp': did you mean dp?"]
    assert "unknown command 'trian'" in problems(["tandem trian --data digits"])[0]
    taken = ["tandem models --json resnet18", "tandem eval --resume runs/x [--data DIR]",
             "torchrun --nproc-per-node 2 -m tandem train --strategy ddp ..."]
    assert problems(taken) == [None] * 3


def test_the_readme_is_a_front_door_whose_links_resolve():
    """At most 250 lines; every relative link of README.md and BENCHMARKS.md names a file
    that exists (the pages' own links are Sphinx's to check)."""
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    for name in ("README.md", "BENCHMARKS.md"):
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", (ROOT / name).read_text()):
            if "://" not in target:
                assert (ROOT / html.unescape(target)).exists(), f"{name}: {target}"
