"""README.md is a front page and the pages under docs/ hold the rest. Here: the README's size, its
two set-up commands (.ci/run runs the test one as written), links that lead somewhere, and no
issue numbers in any page (a reader cannot follow them). The figures are tests/test_figures.py's."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
README = ROOT / "README.md"
PAGES = [README] + sorted((ROOT / "docs").rglob("*.md"))
MAX_LINES = 150          # the README is a front page: what it is, the two commands, the layers, links
MAX_WIDTH = 180          # table rows included; prose is wrapped near 100


def _name(page: Path) -> str:
    return page.relative_to(ROOT).as_posix()


def _prose(text: str) -> str:
    """The text without fenced code blocks and inline code, where a `[x](y)` or `#12` is code."""
    text = re.sub(r"^(```|~~~).*?^\1", "", text, flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "", text)


def _setup_block() -> list[str]:
    """The commands of the README's one bash block, comments and blank lines left out."""
    blocks = re.findall(r"^```bash\n(.*?)^```", README.read_text(), re.S | re.M)
    assert len(blocks) == 1, f"README.md has {len(blocks)} bash blocks; only the two set-up commands belong there"
    return [line.strip() for line in blocks[0].splitlines() if line.strip() and not line.strip().startswith("#")]


def test_the_readme_is_a_front_page():
    lines = README.read_text().splitlines()
    assert len(lines) <= MAX_LINES, f"README.md has {len(lines)} lines; move detail into docs/"
    wide = [f"line {i}: {len(line)} characters" for i, line in enumerate(lines, 1) if len(line) > MAX_WIDTH]
    assert not wide, "README.md lines too wide:\n" + "\n".join(wide)
    assert "## Two commands" in README.read_text()


def test_the_readme_has_two_setup_commands_and_ci_runs_its_test_command():
    commands = _setup_block()
    assert len(commands) == 2, f"README.md should show exactly two set-up commands, has: {commands}"
    demo = [c for c in commands if re.search(r"\bckptflow demo\b", c)]
    tests = [c for c in commands if "pytest" in c]
    assert len(demo) == 1 and len(tests) == 1 and demo != tests, commands
    assert all(c.startswith("./scripts/setup.sh && ") for c in commands), commands
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert tests[0] in ci, f".ci/run should run the README's test command as written: {tests[0]!r}"


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    heading = re.sub(r"[`*_]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", heading).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"^(```|~~~).*?^\1", "", page.read_text(), flags=re.S | re.M)
    return {_slug(h) for h in re.findall(r"^#{1,6} (.+)$", text, re.M)}


def _links(page: Path) -> list[str]:
    return re.findall(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", _prose(page.read_text()))


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_every_relative_link_points_to_an_existing_file(page):
    broken = []
    for target in _links(page):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):          # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest}")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target}: {_name(dest)} has no heading #{anchor}")
    assert not broken, f"{_name(page)}: broken links:\n" + "\n".join(broken)


# Upstream references are sources and stay: a pull request ("PR #1", "PRs #1, #2", "PRs: #1/#2"), an
# RFC, or owner/repo#N. Anything else with an issue number points into this project's tracker.
_UPSTREAM = re.compile(r"\b(?:PRs?|RFC):?\s+#\d+(?:(?:,\s*|/|\s+and\s+)#\d+)*|[\w.-]+/[\w.-]+#\d+")
_ISSUE = re.compile(r"(?<![\w&/])#\d+\b|\b(?:issues?|findings?|items?)\s+#?\d+\b", re.I)


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_no_page_names_an_issue_number(page):
    text = _UPSTREAM.sub("", _prose(page.read_text()))
    found = [f"{m.group(0)!r} in …{text[max(0, m.start() - 40):m.end() + 20]!r}…" for m in _ISSUE.finditer(text)]
    assert not found, f"{_name(page)} names issue numbers; say what the work does instead:\n" + "\n".join(found)


def test_the_upstream_exemption_is_narrow():
    assert _ISSUE.search(_UPSTREAM.sub("", "see issue #25 item 1")) and _ISSUE.search("(#31)")
    assert _ISSUE.search("issue 22, items 1 and 5") and not _ISSUE.search(_UPSTREAM.sub("", "PRs: #14994, #21848"))
    assert not _ISSUE.search(_UPSTREAM.sub("", "checkpoint-restore/criu#2705 and PR #51485"))
