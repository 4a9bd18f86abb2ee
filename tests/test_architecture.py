"""Fitness of the layout: imports point one way, and no package reaches another's private names.

- ``spec`` imports neither ``impl`` nor ``conformance`` (in its source and at run time);
- ``impl`` imports no ``conformance``;
- the backend-facing part of ``conformance`` imports no ``impl``: only the reference adapter
  (``conformance/adapters/reference*.py``) and the maintainer tools (``conformance/tools``) do;
- no module imports a private name (``_name``) of another top-level package, or reaches one
  as an attribute of a module it imported from there.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("spec", "impl", "conformance")


def _sources(package: str) -> list[Path]:
    found = sorted((ROOT / package).rglob("*.py"))
    assert len(found) >= 5, f"{package}: found only {len(found)} modules; is the layout moved?"
    return found


def _module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path, root: Path = ROOT) -> list[tuple[str, str | None, int]]:
    """``(module, imported name or None, line)`` for every import, relative ones resolved."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    name = _module_name(path, root)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found: list[tuple[str, str | None, int]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.extend((alias.name, None, node.lineno) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            found.extend((base, alias.name, node.lineno) for alias in node.names)
    return found


def _top(module: str) -> str:
    return module.split(".", maxsplit=1)[0]


def _may_import_impl(path: Path) -> bool:
    relative = path.relative_to(ROOT / "conformance")
    return relative.parts[0] == "tools" or (
        relative.parts[0] == "adapters" and relative.name.startswith(("reference", "emulated"))
    )


@pytest.mark.parametrize(
    ("package", "forbidden"),
    [("spec", {"impl", "conformance"}), ("impl", {"conformance"})],
)
def test_dependencies_point_one_way(package: str, forbidden: set[str]) -> None:
    wrong = [
        f"{path.relative_to(ROOT)}:{line} imports {module}"
        for path in _sources(package)
        for module, _, line in _imports(path)
        if _top(module) in forbidden
    ]
    assert wrong == []


def test_the_backend_facing_suite_imports_no_implementation() -> None:
    checked = [path for path in _sources("conformance") if not _may_import_impl(path)]
    assert len(checked) >= 15
    wrong = [
        f"{path.relative_to(ROOT)}:{line} imports {module}"
        for path in checked
        for module, _, line in _imports(path)
        if _top(module) == "impl"
    ]
    assert wrong == []


def _private_reaches(path: Path, root: Path = ROOT) -> list[str]:
    """Private names of other packages this module imports or reads off their modules."""
    own = _top(_module_name(path, root))
    where = path.relative_to(root)
    tree = ast.parse(path.read_text(encoding="utf-8"))
    foreign_aliases: dict[str, str] = {}
    found = []
    for module, name, line in _imports(path, root):
        if _top(module) not in PACKAGES or _top(module) == own:
            continue
        if name is not None and name.startswith("_"):
            found.append(f"{where}:{line} imports {module}.{name}")
        if name is None:
            foreign_aliases[module.split(".")[0]] = module
        elif name != "*":
            foreign_aliases[name] = f"{module}.{name}"
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
            and isinstance(node.value, ast.Name)
            and node.value.id in foreign_aliases
        ):
            found.append(
                f"{where}:{node.lineno} reads {foreign_aliases[node.value.id]}.{node.attr}"
            )
    return found


def test_no_package_reaches_a_private_name_of_another() -> None:
    wrong = [
        reach
        for package in PACKAGES
        for path in _sources(package)
        for reach in _private_reaches(path)
    ]
    assert wrong == []


def test_the_private_name_check_sees_a_reach(tmp_path: Path) -> None:
    """The check itself: both forms of reaching in are found, and a package's own are not."""
    sample = tmp_path / "conformance" / "tools" / "sample.py"
    sample.parent.mkdir(parents=True)
    sample.write_text(
        "from impl.kernels.fused import _matrix_products\nfrom impl import ops\nops._secret\n"
        "from conformance.tools import _own\nfrom . import _sibling\n"
    )
    found = _private_reaches(sample, tmp_path)
    assert len(found) == 2 and "_matrix_products" in found[0] and "impl.ops._secret" in found[1]


@pytest.mark.parametrize(
    ("package", "forbidden"), [("spec", "impl conformance"), ("impl", "conformance")]
)
def test_importing_a_package_loads_nothing_it_must_not_import(package: str, forbidden: str) -> None:
    probe = (
        "import sys, importlib, pkgutil\n"
        f"import {package}\n"
        f"for info in pkgutil.walk_packages({package}.__path__, '{package}.'):\n"
        "    importlib.import_module(info.name)\n"
        f"print(sorted(m for m in sys.modules if m.split('.')[0] in {forbidden.split()!r}))"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, cwd=ROOT
    )
    assert loaded.stdout.strip() == "[]"


def test_every_source_folder_is_a_package() -> None:
    """setuptools' find_packages skips a folder without ``__init__.py``: a plain install
    (``pip install .``) would leave it out."""
    folders = {path.parent for package in PACKAGES for path in _sources(package)}
    assert sorted(f for f in folders if not (f / "__init__.py").exists()) == []
