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
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest
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


def tandem_commands(lines: list[str]) -> list[tuple[str, list[str]]]:
    """(subcommand, flags) of each ``tandem SUBCOMMAND ...`` in shell lines (continuations
    joined, comments dropped; a launch's ``-- COMMAND`` counted as that command's)."""
    joined = " ".join(line.rstrip("\\") if line.endswith("\\") else line + "\n"
                      for line in lines)
    found = []
    for line in joined.splitlines():
        line = re.sub(r"(^|\s)#.*", "", line)
        m = re.search(r"\btandem (train|eval|bench|launch|models)\b(.*)", line)
        if not m:
            continue
        parts = [(m.group(1), m.group(2))]
        if m.group(1) == "launch" and " -- " in m.group(2):
            head, tail = m.group(2).split(" -- ", 1)
            sub, _, rest = tail.strip().partition(" ")
            parts = [("launch", head), (sub, rest)]
        for sub, rest in parts:
            flags = [t.split("=", 1)[0] for t in rest.split()
                     if re.fullmatch(r"--?[A-Za-z][\w-]*(=.*)?", t)]
            found.append((sub, flags))
    return found


def unknown_flags(lines: list[str]) -> list[str]:
    bad = []
    for sub, flags in tandem_commands(lines):
        parser = SUBCOMMANDS.get(sub)
        if parser is None:
            bad.append(f"tandem {sub}: no such subcommand")
            continue
        known = set(tandem_reference.visible_flags(parser)) | {"-h", "--help"}
        bad += [f"tandem {sub} {flag}" for flag in flags if flag not in known]
    return bad


def test_every_tandem_flag_in_a_bash_block_exists():
    bash = [(page, n, body) for page, n, kind, body in BLOCKS if kind == "bash"]
    assert len(bash) >= 10
    bad = [f"{page.relative_to(ROOT)}:{n}: {flag}"
           for page, n, body in bash for flag in unknown_flags(body)]
    assert not bad, bad


def test_a_mistyped_flag_in_a_bash_block_is_found():
    """Negative control: the check above names a flag that no parser has, in a launch's
    inner command and after a continuation line."""
    lines = ["tandem launch --nproc-per-node 2 -- train --strategy ddp \\",
             "    --sync-bm --data digits   # --not-a-flag in a comment is fine"]
    assert unknown_flags(lines) == ["tandem train --sync-bm"]
    assert unknown_flags(["tandem models --json resnet18"]) == []
    assert unknown_flags(["tandem bench --epochs 3"]) == ["tandem bench --epochs"]


def test_the_readme_is_a_front_door_whose_links_resolve():
    """At most 250 lines; every relative link of README.md and BENCHMARKS.md names a file
    that exists (the pages' own links are Sphinx's to check)."""
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    for name in ("README.md", "BENCHMARKS.md"):
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", (ROOT / name).read_text()):
            if "://" not in target:
                assert (ROOT / html.unescape(target)).exists(), f"{name}: {target}"
