"""Sphinx configuration for tandem's documentation (``make docs``; see docs/README.md).

Pages are MyST Markdown; the API reference is autodoc on the installed package's docstrings
(reStructuredText, with Sphinx cross-references); the CLI and strategy references are written
from the code at each build by ``_ext/tandem_reference.py``.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent / "_ext"))

project = "tandem"
author = "the tandem authors"
copyright = "the tandem authors"

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.viewcode",
    "tandem_reference",
]

source_suffix = {".md": "markdown"}
root_doc = "index"
# flags stay as typed: no "--resume" turned into an en dash, no curly quotes in commands
smartquotes = False
exclude_patterns = ["_build", "_generated", "README.md", "Thumbs.db", ".DS_Store"]

myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3  # [text](page.md#a-heading) links to headings up to ###

autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"show-inheritance": True}

html_theme = "furo"
html_title = "tandem"
html_theme_options = {
    "source_edit_link": None,
    "navigation_with_keys": True,
}
html_static_path = ["_static"]
html_css_files = ["tandem.css"]
