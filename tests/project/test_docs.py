"""Every relative link in README.md and docs/*.md leads to a file that exists and, with a `#fragment`, to a heading
of it, as GitHub renders them: a moved section or a renamed heading breaks here, not in a reader's browser."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)


def anchors(page: Path) -> set[str]:
    """The fragments GitHub gives a page's headings: lowercased, punctuation but `-` and `_` dropped, spaces to
    hyphens, a repeated one suffixed -1, -2, ...

    >>> sorted(anchors_of("# Kimi K3 (KDA + MLA + latent MoE)\\n## `bench_manifest.py`"))
    ['bench_manifestpy', 'kimi-k3-kda--mla--latent-moe']
    """
    return anchors_of(page.read_text())


def anchors_of(text: str) -> set[str]:
    seen: dict[str, int] = {}
    found = set()
    for line in FENCE.sub("", text).splitlines():
        heading = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not heading:
            continue
        slug = re.sub(r"[^\w\- ]", "", heading.group(1).lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        found.add(slug if count == 0 else f"{slug}-{count}")
    return found


def links(page: Path) -> list[str]:
    return LINK.findall(FENCE.sub("", page.read_text()))


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_relative_link_leads_to_a_file_and_heading_that_exist(page):
    broken = []
    for target in links(page):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, fragment = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target}: no file {file.relative_to(ROOT) if ROOT in file.parents else file}")
        elif fragment and file.suffix == ".md" and fragment not in anchors(file):
            broken.append(f"{target}: no heading #{fragment} in {file.name}")
    assert not broken, broken


def test_the_link_check_sees_a_broken_link(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Here\n[ok](#here) [gone](#there) [file](missing.md)\n")
    assert links(page) == ["#here", "#there", "missing.md"]
    assert anchors(page) == {"here"}
