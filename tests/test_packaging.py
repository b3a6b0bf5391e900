"""Packaging: the README's install section in agreement with pyproject.toml (the extras it offers) and with
what a fresh Debian needs."""

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


def test_the_readme_offers_the_extras_pyproject_has() -> None:
    section = _install_section()
    assert set(re.findall(r"'\.\[(\w+)\]'", section)) == set(PYPROJECT["project"]["optional-dependencies"])


def test_install_works_on_a_distro_with_an_externally_managed_python() -> None:
    section = _install_section()
    venv = section.index("python3 -m venv")
    assert venv < section.index("pip install .")  # the first install command runs in a virtualenv
    assert "externally-managed-environment" in section
    assert "python3-dev" in section  # Python.h, which the compiled data path needs
