"""README.md's python snippets against themselves: each runs as shown, in a fresh interpreter.

Every ```python block of the README is run on its own (its own imports and tiny data) in a
subprocess, in an empty directory, with a hard timeout, so a snippet that stops working fails
here. A block that cannot run alone says why in the comment just above it
(``<!-- not run by tests/test_readme.py: REASON -->``); nothing is skipped silently.
"""

import re
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import cli_env, run_bounded

README = Path(__file__).resolve().parents[1] / "README.md"
NOT_RUN = "<!-- not run by tests/test_readme.py: "


def python_blocks() -> list[tuple[int, str, str | None]]:
    """(line number, code, the reason it is not run or None) of every ```python block."""
    lines = README.read_text().splitlines()
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


BLOCKS = python_blocks()


def test_the_readme_has_snippets_and_says_why_any_is_not_run():
    assert len(BLOCKS) >= 8
    assert all(reason for _, _, reason in BLOCKS if reason is not None)
    assert sum(reason is None for _, _, reason in BLOCKS) >= 8


@pytest.mark.parametrize("line, code", [(n, c) for n, c, r in BLOCKS if r is None],
                         ids=[f"line{n}" for n, _, r in BLOCKS if r is None])
def test_readme_snippet_runs_as_shown(line, code, tmp_path):
    (tmp_path / "snippet.py").write_text(code)
    result = run_bounded([sys.executable, "snippet.py"], 300, cli_env(), cwd=tmp_path)
    assert result.returncode == 0, f"README.md line {line}:\n{code}\n{result.stderr[-3000:]}"
    assert not re.search(r"^Traceback", result.stderr, re.M), result.stderr[-3000:]


def test_every_output_block_has_its_commands_in_the_regenerating_script():
    """scripts/readme_outputs.py --check: each README output marker has commands, and back."""
    script = README.parent / "scripts" / "readme_outputs.py"
    result = run_bounded([sys.executable, str(script), "--check"], 60, cli_env())
    assert result.returncode == 0, result.stderr
    assert "demo\n  make demo" in result.stdout


sys.path.insert(0, str(README.parent / "scripts"))
import readme_outputs  # noqa: E402

# Blocks that run in seconds. The others train for minutes (demo, flowers at 224 px, ...) or,
# as the auto race, say in words what a timing decided; scripts/readme_outputs.py makes them.
QUICK = ("short", "hot", "typo")


@pytest.mark.parametrize("name", QUICK)
def test_a_quick_output_block_has_the_shape_its_commands_print(name, tmp_path):
    """The block's commands, run as scripts/readme_outputs.py runs them: the same lines, the
    same words, whatever the numbers (readme_outputs.shape)."""
    printed = readme_outputs.run_block(readme_outputs.BLOCKS[name], tmp_path,
                                       readme_outputs.scratch(tmp_path))
    shown = readme_outputs.shown(README.read_text())[name]
    assert readme_outputs.shape(printed) == readme_outputs.shape(shown), \
        "\n".join(["README.md shows:", *shown, "the commands print:", *printed])
