"""No file of the repository refers to a document that is not in it: team notes that users do not
have, relative Markdown links (and `path#anchor` references) to missing files or headings, and
backticked repository paths that do not exist. Also: no development-history "issue N" wording in
the product (tsp_trainer/, docs/, tests/, README.md).

Scans the tracked text files (git ls-files), ~300 files, in well under a second."""

from __future__ import annotations

import functools
import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCANNED_SUFFIXES = (".md", ".py", ".yaml", ".sh", ".sbatch")
THIS_FILE = Path(__file__).resolve().relative_to(REPO).as_posix()

# Notes kept outside the repository; written in pieces so that this file does not name them.
OUTSIDE_NOTES = re.compile(r"\b(?:DESIGN|TSP_PAPER|STYLE|ENV_NOTES|ANCHORS)\.md\b|\.\./" + "shared")
ISSUE_WORDING = re.compile(r"\b[Ii]ssue #?\d+|\b[Ii]ssues #?\d+(?:,? (?:and|or) #?\d+)+")
ISSUE_SCOPE = ("tsp_trainer/", "docs/", "tests/", "README.md")

MD_LINK = re.compile(r"\[[^\]\n]*\]\(([^)\s]+)\)")
BARE_ANCHOR = re.compile(r"(?<![\w/.(-])((?:[\w.-]+/)*[\w.-]+\.md)#([\w-]+)")
BACKTICKED = re.compile(r"`([^`\s]+)`")
# Top-level folders of the repository and the package's subpackages (paths inside the package are
# often written from tsp_trainer/, e.g. `parallel/comm.py`).
PATH_ROOTS = ("docs", "tsp_trainer", "experiments", "bench", "tests", "recipes", "launch",
              "scripts", "data", "parallel", "model", "config", "checkpoint", "engine", "plan",
              "run", "eval", "observability", "tools")
REPO_PATH = re.compile(r"^(?:%s)/[\w./-]*\.(?:md|py|yaml|sh|sbatch|json|png|txt|jsonl)$"
                       % "|".join(PATH_ROOTS))


@functools.lru_cache(maxsize=1)
def tracked_files() -> tuple[str, ...]:
    out = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True)
    return tuple(sorted(out.stdout.splitlines()))


@functools.lru_cache(maxsize=1)
def scanned_texts() -> dict[str, str]:
    """Relative path -> text of every tracked text file this test reads (itself excluded)."""
    texts = {}
    for rel in tracked_files():
        if rel.endswith(SCANNED_SUFFIXES) and rel != THIS_FILE and (REPO / rel).is_file():
            texts[rel] = (REPO / rel).read_text(encoding="utf-8", errors="replace")
    return texts


def prose_lines(text: str):
    """(line number, line) of a Markdown text outside fenced code blocks."""
    fenced = False
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
            continue
        if not fenced:
            yield number, line


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: link text kept, lower case, punctuation but '-' and '_'
    dropped, spaces -> '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip()).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


@functools.lru_cache(maxsize=None)
def anchors_of(path: Path) -> frozenset[str]:
    seen: dict[str, int] = {}
    anchors = set()
    for _, line in prose_lines(path.read_text(encoding="utf-8")):
        match = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if match:
            slug = github_slug(match.group(1))
            anchors.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
            seen[slug] = seen.get(slug, 0) + 1
    return frozenset(anchors)


def broken_target(source: str, target: str) -> str | None:
    """Why `target` (a relative link written in `source`) points nowhere, or None."""
    path_part, _, anchor = target.partition("#")
    base = (REPO / source).parent
    candidates = [base / path_part, REPO / path_part] if path_part else [REPO / source]
    found = next((c for c in candidates if c.exists()), None)
    if found is None:
        return f"{path_part}: no such file"
    if anchor and found.suffix == ".md" and anchor not in anchors_of(found.resolve()):
        return f"{path_part or source}#{anchor}: no such heading"
    return None


def is_external(target: str) -> bool:
    return re.match(r"^[a-z][a-z0-9+.-]*:", target) is not None


def link_problems() -> list[str]:
    problems = []
    for rel, text in scanned_texts().items():
        if rel.endswith(".md"):
            lines = prose_lines(text)
        elif ".md#" in text:
            lines = enumerate(text.splitlines(), 1)
        else:
            continue
        for number, line in lines:
            targets = [m.group(1) for m in MD_LINK.finditer(line)] if rel.endswith(".md") else []
            targets += [f"{m.group(1)}#{m.group(2)}" for m in BARE_ANCHOR.finditer(line)]
            for target in dict.fromkeys(targets):
                if is_external(target):
                    continue
                why = broken_target(rel, target)
                if why:
                    problems.append(f"{rel}:{number}: {why}")
    return problems


def matches(pattern: re.Pattern, text: str):
    """(line number, match) of every match of `pattern` in `text` (none spans a line)."""
    for match in pattern.finditer(text):
        yield text.count("\n", 0, match.start()) + 1, match


def path_problems() -> list[str]:
    problems = []
    for rel, text in scanned_texts().items():
        base = (REPO / rel).parent
        for number, match in matches(BACKTICKED, text):
            path = match.group(1).split("::")[0].rstrip(".,;:")
            if not REPO_PATH.match(path):
                continue
            if not any((root / path).exists() for root in (REPO, REPO / "tsp_trainer", base)):
                problems.append(f"{rel}:{number}: `{path}` does not exist")
    return problems


def outside_note_problems() -> list[str]:
    return [f"{rel}:{number}: {m.group(0)}" for rel, text in scanned_texts().items()
            for number, m in matches(OUTSIDE_NOTES, text)]


def issue_wording_problems() -> list[str]:
    return [f"{rel}:{number}: {m.group(0)}" for rel, text in scanned_texts().items()
            if rel.startswith(ISSUE_SCOPE) for number, m in matches(ISSUE_WORDING, text)]


def test_no_file_cites_notes_kept_outside_the_repository():
    assert outside_note_problems() == []


def test_relative_links_and_anchors_point_at_files_and_headings_that_exist():
    assert link_problems() == []


def test_backticked_repository_paths_exist():
    assert path_problems() == []


def test_no_issue_numbers_in_the_product():
    assert issue_wording_problems() == []


@pytest.mark.parametrize("heading, slug", [
    ("5b. The longest context (`tsp-plan --max-seq-len`)", "5b-the-longest-context-tsp-plan---max-seq-len"),
    ("`parallel.tsp_recompute`: full, selective or none", "paralleltsp_recompute-full-selective-or-none"),
    ("Embedding, vocab-ring head and loss", "embedding-vocab-ring-head-and-loss"),
])
def test_anchors_are_githubs(heading, slug):
    assert github_slug(heading) == slug


def test_the_checks_can_fail(tmp_path, monkeypatch):
    """Each check reports a planted problem (so an empty list means something)."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# Title\n\n## Real heading\n")
    planted = {
        "docs/b.md": "See [a](a.md#no-such-heading), [c](c.md) and [ok](a.md#real-heading).\n"
                     "Notes in STYLE" + ".md; `docs/missing.md`; `docs/a.md` exists; " + "issue" + " 12.\n",
    }
    monkeypatch.setattr("tests.unit.test_docs_references.REPO", tmp_path)
    monkeypatch.setattr("tests.unit.test_docs_references.scanned_texts", lambda: planted)
    anchors_of.cache_clear()
    try:
        assert link_problems() == ["docs/b.md:1: a.md#no-such-heading: no such heading",
                                   "docs/b.md:1: c.md: no such file"]
        assert path_problems() == ["docs/b.md:2: `docs/missing.md` does not exist"]
        assert outside_note_problems() == ["docs/b.md:2: STYLE" + ".md"]
        assert issue_wording_problems() == ["docs/b.md:2: " + "issue" + " 12"]
    finally:
        anchors_of.cache_clear()
