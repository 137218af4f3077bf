"""The README and docs/ as a reader follows them (no Ray): every relative link reaches a file and every
anchor a heading, as GitHub names headings; the picture is an SVG that parses; the README's first
screen leads to training on your own data, and its contents list every section."""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
PAGES = [README, *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def prose_lines(text: str) -> list[tuple[int, str]]:
    """The lines outside fenced code blocks, numbered from 1 (a `# comment` in a bash block is no heading)."""
    lines, fenced = [], False
    for number, line in enumerate(text.split("\n"), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced:
            lines.append((number, line))
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation (backticks, dots, colons) dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    for _, line in prose_lines(page.read_text()):
        match = re.match(r"#{1,6} (.+)", line)
        if match:
            base = slug(match.group(1))
            count = seen.get(base, 0)
            seen[base] = count + 1
            if count:
                seen[f"{base}-{count}"] = 1  # a repeated heading: GitHub appends -1, -2, ...
    return set(seen)


def links(page: Path) -> list[tuple[int, str]]:
    found = []
    for number, line in prose_lines(page.read_text()):
        for target in LINK.findall(re.sub(r"`[^`]*`", "", line)):
            if not re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto: are not checked here
                found.append((number, target))
    return found


def test_the_slugs_follow_github():
    assert slug("Continuous training: `failure.mode: continue`") == "continuous-training-failuremode-continue"
    assert slug("`python -m cluster cost [--hours H]`") == "python--m-cluster-cost---hours-h"


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(REPO)))
def test_every_relative_link_and_anchor_resolves(page):
    broken = []
    for number, target in links(page):
        path, _, anchor = target.partition("#")
        goal = (page.parent / path).resolve() if path else page
        if not goal.exists():
            broken.append(f"{page.name}:{number}: {target}: no such file")
        elif anchor and (goal.suffix != ".md" or anchor not in anchors(goal)):
            broken.append(f"{page.name}:{number}: {target}: no such heading in {goal.name}")
    assert not broken, "\n".join(broken)


def test_the_architecture_picture_is_an_svg_the_readme_shows():
    root = ET.parse(REPO / "docs" / "architecture.svg").getroot()
    assert root.tag == "{http://www.w3.org/2000/svg}svg"
    assert root.find("{http://www.w3.org/2000/svg}title") is not None  # (read aloud where the picture is not seen)
    assert "](docs/architecture.svg)" in README.read_text()


def test_the_first_screen_leads_to_your_own_data_and_the_contents_list_every_section():
    lines = prose_lines(README.read_text())
    own = [number for number, line in lines if line == "## Train your own model on your own data"]
    assert own and own[0] <= 100, own
    sections = [slug(line[3:]) for _, line in lines if line.startswith("## ") and line != "## Contents"]
    text = README.read_text()
    contents = text[text.index("## Contents"):text.index("\n## ", text.index("## Contents") + 1)]
    listed = {target[1:] for target in LINK.findall(contents) if target.startswith("#")}
    assert not [name for name in sections if name not in listed]


def test_the_benchmark_table_keeps_its_markers():
    """`make bench` rewrites the README's table between these two markers, and leaves a README without them as it is."""
    from bench.report import END, START

    text = README.read_text()
    assert text.count(START) == 1 and text.count(END) == 1 and text.index(START) < text.index(END)
