"""The documentation site (issue 46.4): ``mkdocs build --strict`` of mkdocs.yml succeeds, so no
page links to a missing page or anchor, every page under docs/ is in the nav, and every docstring
of the API reference renders; the front page is the README."""

import os
import subprocess
import sys

from conftest import REPO


def test_site_builds_strictly_with_the_readme_as_front_page(tmp_path):
    site = tmp_path / "site"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # Material's banner, not a warning of ours
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(site)],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    front = (site / "index.html").read_text()
    assert "Quick start" in front and 'href="configuration/"' in front  # README links made relative
    api = (site / "api" / "trainer" / "index.html").read_text()
    assert "build_datamodule" in api and "LLMModule" in api  # rendered from the docstrings
    pages = {(p.parent if p.stem in ("index", "README") else p.with_suffix("")).as_posix()
             for p in (p.relative_to(REPO / "docs") for p in (REPO / "docs").rglob("*.md"))}
    built = {p.parent.relative_to(site).as_posix() for p in site.rglob("index.html")}
    assert len(pages) >= 30 and pages - built == set()  # every page of docs/ is on the site
