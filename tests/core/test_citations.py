"""Every document the code and the docs cite is in the repository, and every `§N` it cites is a section there.

A citation is a Markdown file name or path (`docs/architecture.md`, `../docs/patches.md`), optionally followed by
sections (`docs/architecture.md §2.3–2.5, §13`). It resolves against the repository root or the citing file's
folder and must stay inside the repository; a section resolves to a heading of the cited file whose number is N
(`## 2. Forward dataflow`, `### 2.3 Attention`). Text only, no imports of the package.
"""

from __future__ import annotations

import re
from functools import lru_cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCANNED = ("dsv4flash", "bridge", "tests", "recipes", "patches", "ci", "docs", "README.md")
SUFFIXES = {".py", ".md", ".yaml", ".yml", ".toml", ".txt", ".sh", ".cfg", ".ini"}

# Files the study commands write into their `out=` folder (named in docs and docstrings, never in the tree).
STUDY_OUTPUTS = ("table2.md", "image_swap.md", "gradient_energy.md", "zeroing.md")

SECTION = r"§\s*\d+(?:\.\d+)*(?:\s*[–-]\s*\d+(?:\.\d+)*)?"
CITATION = re.compile(
    r"(?<![\w./-])(?P<path>/?(?:\.\.?/|[\w-][\w.-]*/)*[\w-][\w.-]*\.md)(?![\w/-])"
    rf"(?P<sections>(?:\s*,?\s*(?:and\s+)?{SECTION})*)"
)
NUMBER = re.compile(r"\d+(?:\.\d+)*")
HEADING = re.compile(r"^#{1,6}\s+§?(\d+(?:\.\d+)*)\.?(?:\s|$)", re.M)


def scanned_files() -> list[Path]:
    """Text files of the scanned trees, in a stable order."""
    files = []
    for name in SCANNED:
        root = REPO / name
        found = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
        files += [p for p in found if p.suffix in SUFFIXES and "__pycache__" not in p.parts]
    return [p for p in files if p != Path(__file__).resolve()]  # this file's examples are broken on purpose


def read(path: Path) -> str:
    """A scanned file's text."""
    return path.read_text(encoding="utf-8", errors="replace")


def citations(path: Path, text: str) -> list[tuple[int, str, list[str]]]:
    """(line, cited path, cited section numbers) of every document citation in the text of the file `path`."""
    found = []
    for m in CITATION.finditer(text):
        cited = m.group("path")
        start, end = m.span("path")
        before, after = text[start - 1:start], text[end:end + 1]
        if path.suffix == ".py" and before and before in "\"'" and after == before:
            continue  # a string literal naming a file the code opens or writes, not a citation
        if Path(cited).name in STUDY_OUTPUTS:
            continue
        sections = []
        for ref in re.findall(SECTION, m.group("sections")):
            sections += NUMBER.findall(ref)
        found.append((text.count("\n", 0, start) + 1, cited, sections))
    return found


def resolve(citing: Path, cited: str) -> Path | None:
    """The repository file a citation names, or None."""
    if cited.startswith("/"):
        return None
    bases = [REPO, citing.parent]
    if citing.suffix == ".py" and cited.startswith("../"):
        # a link the code writes into a generated document one folder down (patches/README.md, by patchseries)
        bases.append(REPO / "patches")
    for base in bases:
        target = (base / cited).resolve()
        if target.is_file() and target.is_relative_to(REPO):
            return target
    return None


@lru_cache(maxsize=None)
def section_numbers(doc: Path) -> frozenset[str]:
    """The numbers of a Markdown file's numbered headings."""
    return frozenset(HEADING.findall(doc.read_text(encoding="utf-8")))


def broken_citations(files: list[tuple[Path, str]]) -> list[str]:
    """One line per citation of a missing document or a missing section, over (path, text) pairs."""
    problems = []
    for path, text in files:
        for line, cited, sections in citations(path, text):
            where = f"{path.relative_to(REPO)}:{line}"
            doc = resolve(path, cited)
            if doc is None:
                problems.append(f"{where}: `{cited}` is not a file of this repository")
                continue
            missing = [n for n in sections if n not in section_numbers(doc)]
            if missing:
                problems.append(f"{where}: `{cited}` has no section {', '.join('§' + n for n in missing)}")
    return problems


def test_every_cited_document_and_section_exists():
    files = scanned_files()
    assert len(files) > 100, "the scan found almost nothing: wrong repository root?"
    problems = broken_citations([(p, read(p)) for p in files])
    assert not problems, "citations that do not resolve:\n" + "\n".join(problems)


def test_no_file_points_into_the_private_reference_folder():
    hits = [f"{p.relative_to(REPO)}:{n}" for p in scanned_files()
            for n, line in enumerate(read(p).splitlines(), 1)
            if "shared/" + "reference" in line]
    assert not hits, "paths outside the repository:\n" + "\n".join(hits)


def test_no_problem_ids_of_a_register_the_repository_does_not_have():
    """`P17`-style ids named entries of a private pitfall register; the repository cites its own sections."""
    pid = re.compile(r"(?<![\w./-])P(?:[1-9]|[1-2][0-9])(?![\w-])")
    hits = [f"{p.relative_to(REPO)}:{n}: {m.group(0)}" for p in scanned_files()
            for n, line in enumerate(read(p).splitlines(), 1) for m in pid.finditer(line)]
    assert not hits, "problem ids without a document:\n" + "\n".join(hits)


def test_study_outputs_are_what_the_study_writes():
    """The exempted names are files `dsv4flash/study` writes, so the exemption cannot hide a missing doc."""
    study = "\n".join(p.read_text() for p in (REPO / "dsv4flash" / "study").glob("*.py"))
    for name in STUDY_OUTPUTS:
        stem = name.removesuffix(".md")
        assert f'"{name}"' in study or f'"{stem}"' in study or f"{stem}.md" in study, name


@pytest.mark.parametrize("text, problem", [
    ("see architecture.md §2", "`architecture.md` is not a file"),
    ("see docs/architecture.md §99", "has no section §99"),
    ("see docs/architecture.md §2.3–2.99", "has no section §2.99"),
    ("see docs/architecture.md §2.3, §98", "has no section §98"),
    ("see /elsewhere/notes.md", "`/elsewhere/notes.md` is not a file"),
    ("see ../../outside.md", "`../../outside.md` is not a file"),
])
def test_the_scan_catches_a_broken_citation(text, problem):
    found = broken_citations([(REPO / "dsv4flash" / "model" / "engram.py", f'"""Docstring: {text}."""\n')])
    assert len(found) == 1 and problem in found[0], found


def test_good_citations_pass_and_literals_are_not_citations():
    text = "docs/architecture.md §2.3–2.5, §13 and docs/upstream.md §1.2; lifecycle.md, ../docs/patches.md\n"
    found = citations(REPO / "docs" / "service.md", text)
    assert [(c, s) for _, c, s in found] == [("docs/architecture.md", ["2.3", "2.5", "13"]),
                                            ("docs/upstream.md", ["1.2"]), ("lifecycle.md", []),
                                            ("../docs/patches.md", [])]
    assert broken_citations([(REPO / "docs" / "service.md", text)]) == []
    assert citations(REPO / "tests" / "x.py", 'DOC = ROOT / "docs" / "lifecycle.md"\n') == []

