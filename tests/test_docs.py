"""README.md and docs/: the README is an overview that starts with its quick start and stays short, every
relative link in it and between the pages (and their #anchors) resolves, the generated blocks (config keys,
protocol messages) match the code they are generated from, and what the code cites of docs/design.md is
there."""

from __future__ import annotations

import ast
import re
import subprocess
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


README_MAX_LINES = 420


def test_the_readme_is_an_overview_that_starts_with_its_quick_start():
    """The README is the overview (the reference, the performance tables and operations live in docs/): at
    most README_MAX_LINES lines, its first section the quick start of exactly two commands, `make demo` and
    the test command CI runs."""
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= README_MAX_LINES, f"README.md has {len(text.splitlines())} lines"
    sections = re.findall(r"^## (.+)$", text, re.M)
    assert sections[0] == "Quick start", sections[:3]
    quick = text[text.index("\n## Quick start\n"):]
    quick = quick[: quick.index("\n## ", 1)]
    block = re.search(r"```sh\n(.*?)```", quick, re.S)
    assert block is not None, "the quick start has no sh block"
    commands = [line.split("#")[0].strip() for line in block.group(1).splitlines()]
    assert commands == ["make demo", "make test"]
    assert re.search(r"^make test\b", (ROOT / ".ci" / "run").read_text(), re.M), ".ci/run does not run `make test`"


def test_every_relative_link_in_the_readme_and_docs_resolves():
    """Every relative link of README.md and docs/*.md names a file or folder that exists, and every #anchor
    (into a page, or within the same page) names one of that page's headings."""
    pages = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]
    checked = 0
    for page in pages:
        for target in LINK.findall(page.read_text()):
            if re.match(r"[a-z]+:", target):
                continue
            file, _, anchor = target.partition("#")
            path = (page.parent / file).resolve() if file else page
            where = f"{page.relative_to(ROOT)} links {target}"
            assert path.exists(), f"{where}: {path.relative_to(ROOT)} does not exist"
            if anchor:
                assert path.suffix == ".md", f"{where}: an anchor into a file that is not a page"
                assert anchor in _anchors(path), f"{where}: no such heading in {path.name}"
            checked += 1
    assert checked


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


def _tracked_text() -> dict[str, str]:
    names = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.split()
    suffixes = (".py", ".md", ".c", ".h", ".cuh", ".cu", ".pyx", ".sh", ".toml", ".service", "Makefile")
    return {n: (ROOT / n).read_text(errors="replace") for n in names
            if n.endswith(suffixes) and (ROOT / n).is_file()}


def test_design_rules_are_cited_from_the_projects_own_docs():
    """Docstrings, skip messages and docs cite docs/design.md by heading; a DESIGN.md outside the project is
    never cited, and every cited heading exists."""
    headings = set(re.findall(r"^## (.+)$", (DOCS / "design.md").read_text(), re.M))
    cited: set[tuple[str, str]] = set()
    for name, text in _tracked_text().items():
        if name == "tests/test_docs.py":  # this test names what it looks for
            continue
        assert not re.search(r"\bDESIGN(\.md)?\s+section\b|\bDESIGN\.md\b", text), f"{name} cites DESIGN.md"
        cited |= {(name, " ".join(h.split())) for h in
                  re.findall(r'docs/design\.md,\s*\\?"((?:[^"\\]|\\.)+?)\\?"', text)}
    assert cited, "nothing cites docs/design.md"
    for name, heading in cited:
        assert heading.replace("\\", "") in headings, f"{name} cites docs/design.md, {heading!r}: no such heading"


OUR_PACKAGES = ("transportd", "transportd_cli", "transportd_models", "gpuclient", "cmd_ring", "softverbs", "ib", "efa",
                "ibgda")


def test_the_imports_in_the_docs_python_examples_work():
    """Each import statement of a ```python block in the README and docs/ (the README's `from transportd
    import verbs` raised ImportError); one that needs an optional package not installed here is left out."""
    checked = 0
    for page in [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]:
        for block in re.findall(r"```python\n(.*?)```", page.read_text(), re.S):
            for node in ast.parse(block).body:
                if not isinstance(node, ast.Import | ast.ImportFrom):
                    continue
                try:
                    exec(compile(ast.Module([node], []), page.name, "exec"), {})
                except ModuleNotFoundError as exc:
                    if (exc.name or "").split(".")[0] in OUR_PACKAGES:
                        raise AssertionError(f"{page.name}: {ast.unparse(node)}: {exc}") from None
                    continue  # an optional dependency (triton, torch) not installed here
                except ImportError as exc:
                    raise AssertionError(f"{page.name}: {ast.unparse(node)}: {exc}") from None
                checked += 1
    assert checked


def _required_options(command, path=()):
    import click

    out = [(path, opt) for p in command.params if isinstance(p, click.Option) and p.required for opt in p.opts[:1]]
    for name, sub in getattr(command, "commands", {}).items():
        out += _required_options(sub, (*path, name))
    return out


def test_the_readme_shows_required_options_as_required():
    """`trace start`'s --out is required; the README's command table showed it in brackets."""
    from transportd_cli.cli import main
    from transportd_cli.ctl import main as ctl_main

    spans = [s for line in (ROOT / "README.md").read_text().splitlines() if not line.startswith("```")
             for s in re.findall(r"`([^`]+)`", line)]
    required = [(program, path, opt) for program, group in (("transportd", main), ("transportctl", ctl_main))
                for path, opt in _required_options(group)]
    assert ("transportctl", ("trace", "start"), "--out") in required
    for program, path, opt in required:
        usage = [s for s in spans if s.startswith(" ".join((program, *path)) + " ")]
        assert usage, f"the README does not show `{program} {' '.join(path)}`"
        for span in usage:
            assert f"[{opt}" not in span and opt in span, f"README: `{span}` shows {opt} as optional or not at all"


def test_the_device_api_costs_quote_the_performance_page():
    """docs/device-api.md's costs had fallen behind the measurements: each measured cell, up to its first
    parenthesis, must be docs/performance.md's own words."""
    page = (DOCS / "device-api.md").read_text()
    section = page[page.index("## Costs measured on the H200"):]
    section = section[: section.find("\n## ", 1) if "\n## " in section[1:] else len(section)]
    readme = " ".join((DOCS / "performance.md").read_text().split())
    rows = [line.split(" | ") for line in section.splitlines() if line.startswith("| ") and "---" not in line]
    assert len(rows) > 5
    source = ""
    for row in rows[1:]:
        files = re.findall(r"`([\w.-]+\.json)`", row[2])
        source = files[-1] if files else source if row[2].startswith("same") else ""
        if source and source not in readme and (ROOT / "benchmarks" / "results" / source).is_file():
            continue  # a measurement only this page reports, from its results file
        quoted = " ".join(row[1].split("(")[0].split()).rstrip(" ;,")
        assert quoted in readme, f"device-api.md costs, {row[0].lstrip('| ')}: {quoted!r} is not in performance.md"
