"""The manual: `make docs`'s build passes with warnings as errors (a broken link or anchor, a page outside
the navigation), the README stays a short entry point to it, and the generated CLI reference is what
the parsers print."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from moe_rl.cli import CLI_REGENERATE, markdown_reference

ROOT = Path(__file__).resolve().parents[3]


def test_the_site_builds_with_warnings_as_errors(tmp_path):
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                       cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, NO_MKDOCS_2_WARNING="1"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert (tmp_path / "site" / "index.html").is_file()
    assert (tmp_path / "site" / "reference" / "cli" / "index.html").is_file()


def test_the_readme_is_short_and_every_page_it_links_exists():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 200
    links = re.findall(r"\]\((docs/[^)#]+)", text)
    assert len(links) >= 15
    missing = [link for link in links if not (ROOT / link).is_file()]
    assert not missing, missing


def test_the_cli_reference_is_what_the_parsers_print():
    docs = ROOT / "docs" / "reference" / "cli.md"
    assert docs.read_text() == markdown_reference(), f"docs/reference/cli.md is stale; regenerate it with `{CLI_REGENERATE}`"
