"""docs/: every page the README links exists, links between pages (and their #anchors) resolve, and the
generated blocks (config keys, protocol messages) match the code they are generated from."""

from __future__ import annotations

import re
from pathlib import Path

from transportd.config import describe_keys
from transportd.ops.docs import DOCS, stale_blocks

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _anchors(path: Path) -> set[str]:
    """GitHub's heading slugs: lower case, punctuation dropped, spaces to hyphens."""
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
            for h in re.findall(r"^#+ (.+)$", path.read_text(), re.M)}


def _relative_links(path: Path) -> list[tuple[Path, str]]:
    out = []
    for target in LINK.findall(path.read_text()):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        file, _, anchor = target.partition("#")
        out.append(((path.parent / file).resolve(), anchor))
    return out


def test_every_docs_page_the_readme_links_exists():
    linked = [(p, a) for p, a in _relative_links(ROOT / "README.md") if DOCS in p.parents or p == DOCS]
    assert (DOCS / "README.md").resolve() in {p for p, _ in linked}, "the README must link docs/README.md"
    for path, anchor in linked:
        assert path.exists(), f"README links {path.relative_to(ROOT)}, which does not exist"
        if anchor:
            assert anchor in _anchors(path), f"README links {path.name}#{anchor}: no such heading"


def test_links_between_docs_pages_resolve():
    pages = sorted(DOCS.glob("*.md"))
    assert pages
    index = (DOCS / "README.md").read_text()
    for page in pages:
        if page.name != "README.md":
            assert f"]({page.name})" in index, f"docs/README.md does not list {page.name}"
        for path, anchor in _relative_links(page):
            assert path.exists(), f"{page.name} links {path}, which does not exist"
            if anchor and path.suffix == ".md":
                assert anchor in _anchors(path), f"{page.name} links {path.name}#{anchor}: no such heading"


def test_generated_blocks_match_the_code():
    assert stale_blocks() == [], "regenerate with: python -m transportd.ops.docs"
    assert describe_keys() in (DOCS / "config.md").read_text()
