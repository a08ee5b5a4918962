"""Every link of README.md and docs/*.md resolves inside the repository (file and, for ``#anchor``,
a heading of that file), and no doc points a reader at a path outside it (research notes, ``../``)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REF_DEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*(\S+)(?:\s+\"[^\"]*\")?\s*$", re.M)
#: Paths a doc must not name: the session's notes, anything above the repository, absolute host paths.
OUTSIDE = re.compile(r"(?<![\w.-])(?:shared/notes/|notes/[\w.-]+\.md|\.\./[\w.-]|/work/|/home/)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but ``-`` / ``_`` dropped, spaces -> ``-``."""
    text = re.sub(r"`", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set:
    out, seen = set(), {}
    for line in FENCE.sub("", path.read_text()).splitlines():
        m = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            slug = _slug(m.group(1))
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def links(text: str) -> list:
    text = FENCE.sub("", text)
    return [m.group(1) for m in LINK.finditer(text)] + REF_DEF.findall(text)


def broken(doc: Path) -> list:
    bad = []
    for target in links(doc.read_text()):
        if re.match(r"[a-zA-Z][a-zA-Z0-9+.-]*:", target):  # http(s), mailto: not a repository path
            continue
        path, _, anchor = target.partition("#")
        dest = (doc.parent / path).resolve() if path else doc
        if ROOT not in dest.parents and dest != ROOT:
            bad.append(f"{target} (outside the repository)")
        elif not dest.exists():
            bad.append(f"{target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{target} (no heading #{anchor} in {dest.name})")
    return bad


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_links_resolve_inside_the_repo(doc):
    assert not broken(doc), f"{doc.relative_to(ROOT)}: {broken(doc)}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_reference_outside_the_repo(doc):
    hits = [(n + 1, line.strip()) for n, line in enumerate(doc.read_text().splitlines()) if OUTSIDE.search(line)]
    assert not hits, f"{doc.relative_to(ROOT)} names paths outside the repository: {hits}"


def test_checker_catches_what_it_should(tmp_path, monkeypatch):
    monkeypatch.setitem(globals(), "ROOT", tmp_path)
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "b.md").write_text("# B title\n\n## Two `words`, here\n")
    a = tmp_path / "docs" / "a.md"
    a.write_text("[ok](b.md#two-words-here) [ok2](#a) [bad](c.md) [anchor](b.md#nope) [up](../../x.md)\n"
                 "[web](https://example.com)\n# A\n```\n[in code](nowhere.md)\n```\n"
                 "[split stages]: WG 1 issues dP first (prose, not a link definition)\n[def]: gone.md\n")
    assert broken(a) == ["c.md (no such file)", "b.md#nope (no heading #nope in b.md)",
                         "../../x.md (outside the repository)", "gone.md (no such file)"]
    for line in ("see `shared/notes/hysparse.md`", "notes/training.md", "[x](../shared/a.md)", "/work/main/x"):
        assert OUTSIDE.search(line), line
    for line in ("docs/api.md", "`paddle_fa4/_cute/x.py`", "release notes are in git"):
        assert not OUTSIDE.search(line), line
