"""The front page and the manual: every relative link resolves (a file, and a heading where the link
names one), the front page stays short, and every figure it shows names the command, the machine
and the date that produced it."""

from __future__ import annotations

import pathlib
import re
from typing import List, Set

REPO = pathlib.Path(__file__).resolve().parent.parent
PAGES = [REPO / "README.md"] + sorted((REPO / "docs").glob("*.md"))
LINK = re.compile(r"(?<!\!)\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def anchors(page: pathlib.Path) -> Set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    out = set()
    for line in FENCE.sub("", page.read_text()).splitlines():
        m = re.match(r"^#{1,6}\s+(.*)$", line)
        if m:
            text = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower())
            out.add(text.replace(" ", "-"))
    return out


def links(page: pathlib.Path) -> List[str]:
    return LINK.findall(FENCE.sub("", page.read_text()))


def test_every_relative_link_in_readme_and_docs_resolves():
    assert len(PAGES) > 5, PAGES
    broken = []
    for page in PAGES:
        for target in links(page):
            if re.match(r"^[a-z]+:", target):  # http:, https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                broken.append(f"{page.relative_to(REPO)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{page.relative_to(REPO)}: {target} (no heading #{anchor})")
    assert not broken, "\n".join(broken)


def test_the_link_check_can_fail(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("# Title\n\n[a](missing.md) [b](#title) [c](#nope)\n```\n[d](in-code.md)\n```\n")
    assert links(page) == ["missing.md", "#title", "#nope"]
    assert anchors(page) == {"title"}


def test_the_front_page_is_short_and_each_figure_names_its_command_machine_and_date():
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) <= 200, "README.md: the manual belongs in docs/"
    assert "each issue's closing note" not in text
    table = [[c.strip() for c in ln.strip().strip("|").split("|")] for ln in text.splitlines()
             if ln.startswith("| ") and "---" not in ln]
    assert table and table[0] == ["figure", "value", "command", "machine", "date"], table[:1]
    rows = table[1:]
    assert rows, "README.md: the results table is missing"
    for figure, value, command, machine, date in rows:
        assert value and "TBD" not in value, f"{figure}: no value"
        assert command.startswith("`"), f"{figure}: no command"
        assert machine, f"{figure}: no machine"
        assert re.fullmatch(r"20\d\d-\d\d-\d\d", date), f"{figure}: no date"
