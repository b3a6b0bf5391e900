"""Packaging: pyproject.toml's metadata in the form current setuptools takes without a warning, and the
README's install section in agreement with it (the extras it offers, what a fresh Debian needs)."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def _install_section() -> str:
    text = (ROOT / "README.md").read_text()
    start = text.index("\n## Install\n")
    return text[start : text.index("\n## ", start + 1)]


def test_license_is_an_spdx_string_with_a_setuptools_that_reads_it() -> None:
    assert PYPROJECT["project"]["license"] == "Apache-2.0"  # a table is deprecated (a banner per build)
    floor = [r for r in PYPROJECT["build-system"]["requires"] if r.startswith("setuptools")]
    assert floor and tuple(map(int, re.search(r">=([\d.]+)", floor[0]).group(1).split("."))) >= (77,)
    assert "'setuptools>=77'" in (ROOT / "Makefile").read_text()


def test_the_readme_offers_the_extras_pyproject_has() -> None:
    section = _install_section()
    assert set(re.findall(r"'\.\[(\w+)\]'", section)) == set(PYPROJECT["project"]["optional-dependencies"])


def test_install_works_on_a_distro_with_an_externally_managed_python() -> None:
    section = _install_section()
    venv = section.index("python3 -m venv")
    assert venv < section.index("pip install .")  # the first install command runs in a virtualenv
    assert "externally-managed-environment" in section
    assert "python3-dev" in section  # Python.h, which the compiled data path needs


def test_the_top_level_packages_are_explained() -> None:
    section = _install_section()
    for package in ("ib", "efa", "cmd_ring", "softverbs"):
        assert f"`{package}`" in section
