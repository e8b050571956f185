"""The front page and docs/ point at things that exist: every relative link resolves, every repository path
a page names in backticks exists, and every `args:` snippet of a Serve config is read by the real config
reader (ServerConfig.from_args), so a renamed setting fails here rather than for a reader."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest
import yaml

from rayllm.serve.config import ServerConfig

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
TOP = ("rayllm/", "tests/", "benchmarks/", "deploy/", "docs/", "constraints/")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_links_and_paths_exist(page):
    text = page.read_text()
    missing = []
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
        if "://" not in target and not (page.parent / target).exists():
            missing.append(target)
    if page.name == "benchmarks.md":  # a log of past runs: it names result files that runs wrote locally
        return assert_none(missing)
    for path in re.findall(r"`((?:" + "|".join(map(re.escape, TOP)) + r")[\w./-]*\w)`", text):
        if "*" not in path and not (ROOT / path).exists():
            missing.append(path)
    assert_none(missing)


def assert_none(missing: list[str]) -> None:
    assert missing == [], f"missing: {missing}"


def _serve_args(text: str) -> list[dict]:
    out = []
    for block in re.findall(r"```yaml\n(.*?)```", text, re.S):
        doc = yaml.safe_load(textwrap.dedent(block))
        if isinstance(doc, dict) and isinstance(doc.get("args"), dict):
            out.append(doc["args"])
    return out


def test_serve_config_snippets_are_read_by_the_config_reader():
    snippets = [args for page in PAGES for args in _serve_args(page.read_text())]
    assert snippets, "the docs show at least one `args:` snippet"
    for args in snippets:
        ServerConfig.from_args(args)
