"""The docs live in the repository: no tracked file points outside it (a clone has no notes
folder beside it), and the README's layout and docs/architecture.md name every package and doc."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# NOTE: built from pieces so this file does not match itself
OUTSIDE_POINTERS = (".." + "/shared", "shared" + "/research", "/work" + "/shared")


def tracked_text_files() -> list[Path]:
    out = subprocess.run(["git", "ls-files", "-z"], capture_output=True, text=True, cwd=ROOT, check=False)
    if out.returncode != 0:
        pytest.skip(f"not a git checkout: {out.stderr.strip()}")
    return [ROOT / name for name in out.stdout.split("\0") if name and (ROOT / name).is_file()]


def outside_pointers(path: Path, root: Path = ROOT) -> list[str]:
    """`path:line: text` for every line of a text file that points outside the repository."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError:
        return []
    return [
        f"{path.relative_to(root)}:{number}: {line.strip()}"
        for number, line in enumerate(lines, 1)
        if any(pointer in line for pointer in OUTSIDE_POINTERS)
    ]


def packages() -> list[str]:
    return sorted(p.parent.name for p in (ROOT / "kvscope").glob("*/__init__.py"))


def docs() -> list[str]:
    return sorted(p.name for p in (ROOT / "docs").iterdir() if p.is_file())


def readme_layout() -> str:
    match = re.search(r"^## Layout\n+```\n(.*?)^```", (ROOT / "README.md").read_text(), re.M | re.S)
    assert match, "README.md has no ## Layout code block"
    return match.group(1)


def test_no_tracked_file_points_outside_the_repository() -> None:
    found = [hit for path in tracked_text_files() for hit in outside_pointers(path)]
    assert not found, "pointers to files a clone does not have:\n" + "\n".join(found)


def test_the_pointer_check_sees_a_pointer(tmp_path: Path) -> None:
    """Guard against a check that cannot fail."""
    doc = tmp_path / "doc.md"
    doc.write_text("fine\nsee " + OUTSIDE_POINTERS[0] + "/DESIGN.md\n" + OUTSIDE_POINTERS[1] + "/x.md\n")
    assert [hit.split(": ")[0] for hit in outside_pointers(doc, tmp_path)] == ["doc.md:2", "doc.md:3"]


def test_the_readme_layout_lists_every_package_and_doc() -> None:
    layout = readme_layout()
    missing = [f"kvscope/{p}/" for p in packages() if f"kvscope/{p}/" not in layout]
    missing += [d for d in docs() if d not in layout]
    assert not missing, f"README.md's layout omits {missing}"


def test_the_architecture_doc_maps_every_package() -> None:
    text = (ROOT / "docs" / "architecture.md").read_text()
    missing = [p for p in packages() if f"`kvscope/{p}/`" not in text]
    assert not missing, f"docs/architecture.md's package map omits {missing}"


def test_the_readme_page_table_lists_every_dashboard_page() -> None:
    """The page table in the README names each page the dashboard's navigation has, in its order."""
    from kvscope.dashboard.frame import PAGE_FILES

    readme = (ROOT / "README.md").read_text()
    table = re.search(r"^\| page \| shows \|\n\|---\|---\|\n((?:\|.*\n)+)", readme, re.M)
    assert table, "README.md has no page table"
    rows = [line.split("|")[1].strip() for line in table.group(1).splitlines()]
    assert rows == list(PAGE_FILES), rows
