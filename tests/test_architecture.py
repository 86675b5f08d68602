"""The package structure ARCHITECTURE.md describes, checked on the source: layering, private
modules, jax internals, class names, the one step definition, data-only results."""
import ast
import collections
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
PACKAGES = ("pallas_kernels", "ckv_jax", "interop")
# a package may import only the packages after it in this order
MAY_IMPORT = {"pallas_kernels": set(), "ckv_jax": {"pallas_kernels"}, "interop": {"ckv_jax", "pallas_kernels"}}


def modules(package):
    return sorted((ROOT / package).rglob("*.py"))


def imported(path):
    """Every module name an import statement of `path` names (`from a.b import c` gives a.b and
    a.b.c: c may be a module)."""
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
            names += [f"{node.module}.{alias.name}" for alias in node.names]
    return names


def test_layering():
    for package in PACKAGES:
        for path in modules(package):
            for name in imported(path):
                top = name.split(".")[0]
                if top in PACKAGES and top != package:
                    assert top in MAY_IMPORT[package], f"{path.relative_to(ROOT)} imports {name}"


def test_no_package_imports_another_packages_private_module():
    for package in PACKAGES:
        for path in modules(package):
            for name in imported(path):
                parts = name.split(".")
                if parts[0] in PACKAGES and parts[0] != package:
                    assert not any(p.startswith("_") for p in parts[1:]), f"{path.relative_to(ROOT)} imports {name}"


def test_jax_internals_in_at_most_one_module_per_package():
    for package in PACKAGES:
        users = {path.relative_to(ROOT) for path in modules(package) for name in imported(path)
                 if name.startswith("jax._src") or (name.startswith("jaxlib.") and not name.startswith("jaxlib.version"))}
        assert len(users) <= 1, f"{package}: jax internals in {sorted(map(str, users))}"


def test_no_two_classes_share_a_name():
    where = collections.defaultdict(list)
    for package in PACKAGES:
        for path in modules(package):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ClassDef):
                    where[node.name].append(str(path.relative_to(ROOT)))
    shared = {name: paths for name, paths in where.items() if len(paths) > 1}
    assert not shared, shared


@pytest.mark.parametrize("runner", ["ckv_jax/prefetch.py", "ckv_jax/pipelined_prefill.py"])
def test_runners_reach_the_kernels_only_through_the_step_definition(runner):
    names = imported(ROOT / runner)
    assert not [n for n in names if n.split(".")[0] == "pallas_kernels"], names
    assert "ckv_jax.dcp_step" in names


def test_results_hold_data_only():
    code = [p.relative_to(ROOT) for p in (ROOT / "benchmarks" / "results").rglob("*") if p.suffix in (".py", ".sh")]
    assert not code, code


def test_tuned_tables_ship_as_package_data():
    """The tables are read from the installed package: pyproject names them as package data."""
    text = (ROOT / "pyproject.toml").read_text()
    assert 'pallas_kernels = ["tuned/*.json"]' in text
    assert list((ROOT / "pallas_kernels" / "tuned").glob("*.json"))
