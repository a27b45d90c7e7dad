"""The front page and the guide as a reader follows them (CI's link check): every relative link and
image in README.md, docs/*.md and bench/results/README.md reaches a file or folder that exists, and
every #anchor a heading of its page; the guide has its pages, each linked from docs/index.md; the
README stays a front page."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from conftest import REPO

DOCS = REPO / "docs"
README_LINES = 250
GUIDE_PAGES = 6

LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
"""An inline link or image: [text](target "title"), the text possibly holding [brackets]."""
DEFINITION = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$", re.M)
"""A reference-style link's definition: [name]: target."""
FENCE = re.compile(r"^ {0,3}(```|~~~).*?^ {0,3}\1[^\n]*$", re.M | re.S)
CODE = re.compile(r"(`+)(?:(?!\1).)+?\1", re.S)
HEADING = re.compile(r"^ {0,3}#{1,6}[ \t]+(.+?)[ \t#]*$", re.M)


def pages() -> list[Path]:
    """The Markdown a reader opens from the front page."""
    found = [REPO / "README.md", *sorted(DOCS.glob("*.md"))]
    index = REPO / "bench/results/README.md"
    return found + [index] if index.is_file() else found


def prose(text: str) -> str:
    """The text without code blocks and code spans, where brackets and #s are code, not links."""
    return CODE.sub("", FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its text as rendered (no code ticks, emphasis or link
    targets), lowercased, punctuation dropped but for - and _, spaces turned to -."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = re.sub(r"[`*]|(?<!\w)_|_(?!\w)", "", text)
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every heading's anchor on the page; a repeated heading's copies get -1, -2 ... as on GitHub."""
    seen: dict[str, int] = {}
    out = set()
    for heading in HEADING.findall(FENCE.sub("", page.read_text())):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def targets(page: Path) -> list[str]:
    text = prose(page.read_text())
    return LINK.findall(text) + DEFINITION.findall(text)


def broken(page: Path, root: Path = REPO) -> list[str]:
    """What is wrong with each of the page's relative links: a missing file or folder, or an
    anchor that no heading of a Markdown target has. Links to the web are not followed."""
    problems = []
    for target in targets(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        where = (page.parent / path).resolve() if path else page
        if not where.exists():
            problems.append(f"{page.relative_to(root)}: {target}: no such file or folder")
        elif anchor and where.suffix == ".md" and anchor not in anchors(where):
            problems.append(f"{page.relative_to(root)}: {target}: no heading #{anchor} in {where.relative_to(root)}")
    return problems


@pytest.mark.parametrize("heading, anchor", [
    ("Four ways to run it", "four-ways-to-run-it"),
    ("`rope_search`", "rope_search"),
    ("base, pretrain, sft: the training stages", "base-pretrain-sft-the-training-stages"),
    ("The tiny run: past the base's window, on a CPU", "the-tiny-run-past-the-bases-window-on-a-cpu"),
    ("Scale: the Llama-3-8B shape at 64K to 2.36M tokens", "scale-the-llama-3-8b-shape-at-64k-to-236m-tokens"),
    ("The [model](model.md) and *its* backends", "the-model-and-its-backends"),
])
def test_anchors_are_githubs(heading, anchor):
    assert slug(heading) == anchor


def test_a_broken_link_or_anchor_is_found(tmp_path):
    """The check itself: a missing file, a missing anchor, and a link inside code (not a link)."""
    (tmp_path / "guide.md").write_text("# Guide\n\n## Two words\n")
    page = tmp_path / "page.md"
    page.write_text("[ok](guide.md#two-words) ![ok](guide.md) [gone](missing.md) [no](guide.md#three)\n"
                    "[self](#page) [web](https://example.com/x.md) `[code](nowhere.md)`\n\n"
                    "```\n[block](nowhere.md)\n```\n\n# Page\n\n[ref]: other/\n")
    assert broken(page, tmp_path) == ["page.md: missing.md: no such file or folder",
                            "page.md: guide.md#three: no heading #three in guide.md",
                            "page.md: other/: no such file or folder"]


def test_every_relative_link_reaches_a_file_and_every_anchor_a_heading():
    problems = [p for page in pages() for p in broken(page)]
    assert not problems, "\n".join(problems)


def test_the_guide_has_its_pages_and_its_index_links_every_one():
    guide = sorted(p.name for p in DOCS.glob("*.md") if p.name != "index.md")
    assert len(guide) >= GUIDE_PAGES, guide
    linked = {(DOCS / t.partition("#")[0]).resolve() for t in targets(DOCS / "index.md")}
    assert [name for name in guide if (DOCS / name).resolve() not in linked] == []
    front = {(REPO / t.partition("#")[0]).resolve() for t in targets(REPO / "README.md")}
    assert (DOCS / "index.md").resolve() in front, "README.md does not link docs/index.md"


def test_the_readme_is_a_front_page():
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) <= README_LINES, f"README.md has {len(lines)} lines; the guide (docs/) takes the rest"
