"""Docs and comments point only at things in this repository: no section-sign references to a
spec that is not here (say which doc, or what the reference says), and every repository file
named by its path (a test file, a doc page, a script) exists."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from .conftest import ROOT

pytestmark = pytest.mark.timeout(30)

SECTION_SIGN = "\u00a7"  # spelled out: this file must pass its own test
_TEXT = {".py", ".md", ".toml", ".json", ".sh", ".sbatch", ".txt", ".html", ".cfg", ".yml", ".yaml"}
_NAMED = re.compile(r"\b(?:tests|docs|launch|bench|tools|examples|proto)/[A-Za-z0-9_./-]+\.(?:py|md|sh|sbatch|json)\b")


def tracked_text_files() -> list[Path]:
    """The repository's text files: git's list where there is one, else a walk that skips dot and build folders."""
    try:
        names = subprocess.run(
            ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
            timeout=20,
        ).stdout.split()
        paths = [ROOT / n for n in names]
    except (OSError, subprocess.SubprocessError):
        skip = {"build", "dist", "node_modules", "__pycache__"}
        paths = [p for p in ROOT.rglob("*") if not any(part.startswith(".") or part in skip for part in p.relative_to(ROOT).parts)]
    return [p for p in paths if p.suffix in _TEXT and p.is_file()]


@pytest.fixture(scope="module")
def texts() -> dict[str, str]:
    return {str(p.relative_to(ROOT)): p.read_text(encoding="utf-8", errors="replace") for p in tracked_text_files()}


def test_the_file_list_is_real(texts):
    assert "README.md" in texts and "tests/test_doc_refs.py" in texts


def test_no_section_references_to_a_spec_that_is_not_here(texts):
    hits = [f"{name}:{text.count(chr(10), 0, i) + 1}" for name, text in texts.items() for i in _positions(text, SECTION_SIGN)]
    assert not hits, f"'{SECTION_SIGN}' references a spec not in this repository; name the doc section instead: {hits}"


def test_every_named_repository_file_exists(texts):
    missing = sorted({f"{name}: {ref}" for name, text in texts.items() for ref in _NAMED.findall(text) if not (ROOT / ref).exists()})
    assert not missing, f"named files that do not exist: {missing}"


def _positions(text: str, needle: str) -> list[int]:
    return [m.start() for m in re.finditer(re.escape(needle), text)]
