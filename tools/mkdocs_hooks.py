"""MkDocs hook (named under ``hooks:`` in mkdocs.yml): the site's front page is README.md.

``docs/index.md`` holds one line; when the site builds, its text is replaced by the repository's
README, whose links point into ``docs/`` from the root (``docs/data.md``); on the site the front
page lies inside ``docs/``, so that prefix is dropped. One README, read on GitHub and on the site.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

README = Path(__file__).resolve().parents[1] / "README.md"


def front_page() -> str:
    """README.md with its ``](docs/...)`` links made relative to ``docs/``."""
    return re.sub(r"\]\(docs/", "](", README.read_text(encoding="utf-8"))


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    return front_page() if page.file.src_uri == "index.md" else markdown
