"""Every file the README and docs/ name exists, the README's layout names real modules, and no page cites an issue."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# A path in backticks: a top-level folder, then names, ending in a file's suffix or a folder's slash.
_TOP = r"(?:bench|client|cli|compose[\w.]*|deploy|docker|docs|examples|proto|qcore|server|tests)"
_PATH = re.compile(rf"`({_TOP}/[\w./-]*?(?:\.(?:py|md|yaml|yml|sh|proto|png|json|c|txt|toml|sbatch)|/))`")
# Files a documented command creates: named as where they will be, not as what the tree holds.
_MADE_BY_A_COMMAND = {"docker/certs/"}
# "issue 42", "issue #42", "(#42)", a bare "#42": the tracker's numbers, which the project never cites.
_ISSUE = re.compile(r"\bissues?\s+#?\d+|\(#\d+\)|(?<![\w/&#])#\d+\b", flags=re.IGNORECASE)


def _named_paths(page: Path) -> list[str]:
    return sorted({path for path in _PATH.findall(page.read_text()) if "*" not in path})


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_every_path_a_page_names_exists(page: Path) -> None:
    missing = [path for path in _named_paths(page) if path not in _MADE_BY_A_COMMAND and not (ROOT / path).exists()]
    assert not missing, f"{page.relative_to(ROOT)} names paths the tree lacks: {missing}"


def test_the_path_pattern_finds_paths_and_only_paths() -> None:
    text = "`client/ddp/hook.py`, `bench/results/x.md`, `client/session/`, `GradqHookState`, `a/b.py`, `gradq serve`"
    found = _PATH.findall(text)
    assert found == ["client/ddp/hook.py", "bench/results/x.md", "client/session/"]


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_no_page_cites_an_issue_number(page: Path) -> None:
    cited = _ISSUE.findall(page.read_text())
    assert not cited, f"{page.relative_to(ROOT)} cites the issue tracker: {cited}"


@pytest.mark.parametrize(
    ("text", "cited"),
    [
        *[("before issue 44", True), ("Issue #7", True), ("fixed (#42)", True), ("see #12", True)],
        *[("operating.md#cluster", False), ("## Heading", False), ("issue44-side-by-side.md", False), ("C#", False)],
    ],
)
def test_the_issue_pattern(text: str, cited: bool) -> None:
    assert bool(_ISSUE.search(text)) is cited


def test_every_module_the_readme_layout_names_exists() -> None:
    """The layout table's cells name modules by their bare names (`worker`); each is a module of its row's folder."""
    readme = (ROOT / "README.md").read_text()
    layout = readme.split("## Layout", 1)[1].split("\n## ", 1)[0]
    missing = []
    for folder, cell in re.findall(r"^\| `([\w/]+/)`[^|]*\| ([^|]*) \|", layout, flags=re.MULTILINE):
        for name in re.findall(r"`([a-z_]+)`", cell):
            if not ((ROOT / folder / f"{name}.py").exists() or (ROOT / folder / name).is_dir()):
                missing.append(f"{folder}{name}")
    assert not missing, f"README.md's layout names modules that do not exist: {missing}"
