"""README.md and docs/ hold together: relative links land, no page cites what the project lacks, tables are true."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# [text](target) and ![alt](target); the target stops at the first space or closing parenthesis.
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^```.*?^```", flags=re.MULTILINE | re.DOTALL)
_HEADING = re.compile(r"^#{1,6} (.+)$", flags=re.MULTILINE)


def _prose(page: Path) -> str:
    """The page without its fenced code blocks, where brackets are code, not links."""
    return _FENCE.sub("", page.read_text())


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    return {_anchor(heading) for heading in _HEADING.findall(_prose(page))}


def _relative_links(page: Path) -> list[str]:
    return [target for target in _LINK.findall(_prose(page)) if not re.match(r"^[a-z]+:", target)]


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_every_relative_link_points_to_a_file_and_heading_that_exist(page: Path) -> None:
    broken = []
    for target in _relative_links(page):
        path, _, anchor = target.partition("#")
        destination = (page.parent / path).resolve() if path else page
        if not destination.exists():
            broken.append(f"{target}: no file {destination}")
        elif anchor and destination.suffix == ".md" and anchor not in _anchors(destination):
            broken.append(f"{target}: no heading #{anchor} in {destination.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)} links to what does not exist: {broken}"


def test_every_docs_page_is_linked_from_the_readme_and_has_a_title_and_an_intro() -> None:
    readme_links = {target.partition("#")[0] for target in _relative_links(ROOT / "README.md")}
    for page in PAGES[1:]:
        assert f"docs/{page.name}" in readme_links, f"README.md does not link docs/{page.name}"
        title, blank, intro = page.read_text().split("\n")[:3]
        assert title.startswith("# ") and blank == "" and intro.strip(), (
            f"{page.name}: expected '# Title', then a paragraph"
        )


@pytest.mark.parametrize(
    "page",
    [*PAGES, *sorted((ROOT / "bench" / "results").glob("*.md"))],
    ids=lambda page: str(page.relative_to(ROOT)),
)
def test_no_page_cites_a_document_the_project_lacks_or_a_path_on_one_machine(page: Path) -> None:
    text = page.read_text()
    assert "DESIGN.md" not in text, f"{page.relative_to(ROOT)} cites DESIGN.md, which the project does not contain"
    assert not re.search(r"(?<![\w.])/work/", text), f"{page.relative_to(ROOT)} names a path under /work/"


def test_the_worker_variables_table_lists_every_variable_and_its_true_default() -> None:
    from gradq.client.bit_policy import BIT_POLICIES, DEFAULT_AVERAGE_BITS
    from gradq.client.chunks import DEFAULT_CHUNK_ELEMENTS
    from gradq.client.env import DEFAULT_CONNECT_TIMEOUT_S, HOOK_ENVIRONMENT, quantized_scheme_names
    from gradq.qcore import QuantConfig

    page = (ROOT / "docs" / "integrations.md").read_text()
    rows = dict(re.findall(r"^\| `(GRADQ_[A-Z_]+)` \| (.*) \|$", page, flags=re.MULTILINE))
    table = {name: row.rsplit(" | ", 1) for name, row in rows.items() if name in HOOK_ENVIRONMENT}
    assert sorted(table) == sorted(HOOK_ENVIRONMENT)
    unset = {name: default for name, (_, default) in table.items()}
    assert unset["GRADQ_BITS"] == str(QuantConfig().bits)
    assert unset["GRADQ_SCHEME"] == f"`{QuantConfig().scheme.name.lower()}`"
    assert unset["GRADQ_CHUNK_ELEMENTS"] == str(DEFAULT_CHUNK_ELEMENTS)
    assert unset["GRADQ_CONNECT_TIMEOUT"] == f"{DEFAULT_CONNECT_TIMEOUT_S:g}"
    names = quantized_scheme_names()
    assert table["GRADQ_SCHEME"][0].count("`") == 2 * len(names)
    assert all(f"`{name}`" in table["GRADQ_SCHEME"][0] for name in names)
    assert unset["GRADQ_BIT_POLICY"] == f"`{BIT_POLICIES[0]}`"
    assert unset["GRADQ_AVERAGE_BITS"] == f"{DEFAULT_AVERAGE_BITS:g}"
