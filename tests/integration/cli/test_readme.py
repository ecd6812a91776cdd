"""README.md's and the docs pages' python snippets against themselves: each runs as shown, in a
fresh interpreter.

Every ```python block of README.md and of the pages under docs/ is run on its own (its own
imports and tiny data) in a subprocess, in an empty directory, with a hard timeout, so a
snippet that stops working fails here. A block that cannot run alone says why in the comment
just above it (``<!-- not run by tests/integration/cli/test_readme.py: REASON -->``); nothing is
skipped silently. A page that shows a README snippet through ``{include}`` runs nothing twice: the
snippet is the README's. The output blocks are scripts/readme_outputs.py's.
"""

import re
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import ROOT, cli_env, run_bounded

README = ROOT / "README.md"
NOT_RUN = "<!-- not run by tests/integration/cli/test_readme.py: "

sys.path.insert(0, str(ROOT / "scripts"))
import readme_outputs  # noqa: E402

PAGES = readme_outputs.pages()


def python_blocks(page: Path) -> list[tuple[int, str, str | None]]:
    """(line number, code, the reason it is not run or None) of every ```python block."""
    lines = page.read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        if lines[i].strip() == "```python":
            end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
            above = lines[i - 1].strip() if i else ""
            reason = above[len(NOT_RUN):-len("-->")].strip() if above.startswith(NOT_RUN) else None
            code = textwrap.dedent("\n".join(lines[i + 1:end]) + "\n")  # a list item's block
            blocks.append((i + 1, code, reason))
            i = end
        i += 1
    return blocks


BLOCKS = [(page.relative_to(ROOT).as_posix(), n, code, reason)
          for page in PAGES for n, code, reason in python_blocks(page)]
RUN = [(where, n, code) for where, n, code, reason in BLOCKS if reason is None]


def test_the_pages_have_snippets_and_say_why_any_is_not_run():
    assert sum(where == "README.md" for where, _, _ in RUN) >= 5  # one per strategy, and fit
    assert len(RUN) >= 8
    assert all(reason for *_, reason in BLOCKS if reason is not None)


@pytest.mark.parametrize("where, line, code", RUN, ids=[f"{w}:{n}" for w, n, _ in RUN])
def test_snippet_runs_as_shown(where, line, code, tmp_path):
    (tmp_path / "snippet.py").write_text(code)
    result = run_bounded([sys.executable, "snippet.py"], 300, cli_env(), cwd=tmp_path)
    assert result.returncode == 0, f"{where} line {line}:\n{code}\n{result.stderr[-3000:]}"
    assert not re.search(r"^Traceback", result.stderr, re.M), result.stderr[-3000:]


def test_every_output_block_has_its_commands_in_the_regenerating_script():
    """scripts/readme_outputs.py --check: each output marker has commands, and back."""
    script = ROOT / "scripts" / "readme_outputs.py"
    result = run_bounded([sys.executable, str(script), "--check"], 60, cli_env())
    assert result.returncode == 0, result.stderr
    assert "demo\n  make demo" in result.stdout


# Blocks that run in seconds. The others train for minutes (demo, flowers at 224 px, ...) or,
# as the auto race, say in words what a timing decided; scripts/readme_outputs.py makes them.
QUICK = ("short", "hot", "typo")


@pytest.mark.parametrize("name", QUICK)
def test_a_quick_output_block_has_the_shape_its_commands_print(name, tmp_path):
    """The block's commands, run as scripts/readme_outputs.py runs them: the same lines, the
    same words, whatever the numbers (readme_outputs.shape)."""
    printed = readme_outputs.run_block(readme_outputs.BLOCKS[name], tmp_path,
                                       readme_outputs.scratch(tmp_path))
    shown = {where: blocks[name] for where in PAGES
             if name in (blocks := readme_outputs.shown(where.read_text()))}
    assert shown, f"no page shows the output block {name!r}"
    for where, lines in shown.items():
        assert readme_outputs.shape(printed) == readme_outputs.shape(lines), \
            "\n".join([f"{where.name} shows:", *lines, "the commands print:", *printed])
