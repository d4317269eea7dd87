"""Every Python package of the source tree is in pyproject's package list, so a
non-editable install (the Docker image) carries all of it."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_package_folder_is_listed_in_pyproject() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    found = set()
    for name, folder in config["package-dir"].items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            found.add(".".join([name, *rel.parts]))
    # a folder of data only is a package of its own (listed, with its package-data), so
    # setuptools installs it without a warning per folder
    for package in config["package-data"]:
        root = max((n for n in config["package-dir"] if package.startswith(n)), key=len)
        folder = ROOT / config["package-dir"][root] / package[len(root) + 1 :].replace(".", "/")
        assert folder.is_dir(), package
        if not (folder / "__init__.py").exists():
            found.add(package)
    assert found - listed == set(), "add these to [tool.setuptools] packages"
    assert listed - found == set(), "these listed packages have no folder"


def test_the_image_builds_from_every_folder_the_install_needs() -> None:
    # a folder of pyproject's package-dir that the image does not copy fails its install,
    # and without setup.py the wheel would lack the compiled partial states
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    copied = set()
    for line in (ROOT / "Dockerfile").read_text().splitlines():
        if line.startswith("COPY ") and "--from" not in line:
            copied.update(line.split()[1:-1])
    assert set(config["package-dir"].values()) | {"pyproject.toml", "setup.py"} <= copied
