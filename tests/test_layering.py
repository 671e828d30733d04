"""The layering contract in pyproject's [tool.importlinter] holds, and an import that breaks it fails the check.

grimp (import-linter's graph builder) finds a package by walking the folder its ``__init__.py`` lives in, so
it cannot see ``specjax.backends`` / ``specjax.kernels`` / ``specjax.configs``, which pyproject's package-dir
maps from ``backends/``, ``kernels/``, ``configs/``. The tests therefore lay the Python sources out as one plain
tree in a temporary folder (the layout the wheel installs) and run ``lint-imports`` there. Every import counts,
the ones inside functions too: a lazy import is still an upward import.

Run by hand: ``python tests/test_layering.py`` prints lint-imports' report for the working tree.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

try:
    import tomllib
except ImportError:  # Python 3.10: import-linter depends on tomli there
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
LAYERS = "specjax layers: a module imports only from below it"
INFERENCE = "inference never imports training"
LOW = "backends and kernels import nothing above them"
KERNELS = "kernels never import backends"


def _python_only(folder: str, names: list[str]) -> list[str]:
    """shutil.copytree ignore hook: keep folders and .py files, drop caches, weights, data."""
    return [
        n for n in names
        if n == "__pycache__" or (os.path.isfile(os.path.join(folder, n)) and not n.endswith(".py"))
    ]


def plain_tree(dest: Path) -> Path:
    """Copy the package's Python sources into dest as the wheel installs them; returns dest.

    The folder mapping comes from pyproject's [tool.setuptools] package-dir, so a new mapped folder is
    picked up without editing this file.
    """
    pyproject = ROOT / "pyproject.toml"
    package_dir = tomllib.loads(pyproject.read_text())["tool"]["setuptools"]["package-dir"]
    # Parents before children: specjax.kernels is copied before specjax.kernels.pallas lands inside it.
    for package, folder in sorted(package_dir.items(), key=lambda kv: kv[0].count(".")):
        target = dest.joinpath(*package.split("."))
        if target.exists():
            continue  # a nested mapping (kernels/pallas) already came with its parent's folder
        shutil.copytree(ROOT / folder, target, ignore=_python_only)
    shutil.copy(pyproject, dest / "pyproject.toml")
    return dest


def lint_imports(tree: Path) -> subprocess.CompletedProcess:
    """Run lint-imports on a plain tree (its pyproject's contracts, its sources), without a cache."""
    exe = Path(sys.executable).with_name("lint-imports")
    if not exe.exists():
        raise FileNotFoundError(
            f"lint-imports not found next to {sys.executable}: pip install import-linter (the test extra)"
        )
    env = dict(os.environ, PYTHONPATH=str(tree))
    return subprocess.run(
        [str(exe), "--no-cache"], cwd=tree, env=env, capture_output=True, text=True, timeout=300
    )


def _status(output: str, contract: str) -> str:
    """'KEPT' or 'BROKEN' for one contract, read from lint-imports' summary line."""
    for line in output.splitlines():
        if line.startswith(contract + " "):
            return line.rsplit(" ", 1)[-1]
    raise AssertionError(f"contract {contract!r} missing from lint-imports output:\n{output}")


def test_contract_holds(tmp_path):
    result = lint_imports(plain_tree(tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr
    for contract in (LAYERS, INFERENCE, LOW, KERNELS):
        assert _status(result.stdout, contract) == "KEPT"
    # The analysed graph held the mapped folders (an empty graph would keep every contract).
    assert (tmp_path / "specjax" / "kernels" / "reference.py").exists()
    assert (tmp_path / "specjax" / "backends" / "registry.py").exists()


LAZY_TRAIN = "\n\ndef _planted():\n    import specjax.train.loop  # noqa: F401\n"


@pytest.mark.parametrize(
    "path, planted, broken",
    [
        # api reaches backends.registry, so the indirect chain kernels -> api -> backends counts too.
        ("kernels/reference.py", "\nimport specjax.api  # noqa: E402,F401\n", {LAYERS, LOW, KERNELS}),
        ("backends/registry.py", "\nimport specjax.runners  # noqa: E402,F401\n", {LAYERS, LOW}),
        ("kernels/validation.py", "\nimport specjax.backends.registry  # noqa: E402,F401\n", {LAYERS, KERNELS}),
        ("engine.py", LAZY_TRAIN, {LAYERS, INFERENCE}),
        ("models/llama.py", "\nimport specjax.drafters  # noqa: E402,F401\n", {LAYERS}),
    ],
    ids=["kernels->api", "backends->runners", "kernels->backends", "engine->train(lazy)", "models->drafters"],
)
def test_planted_upward_import_breaks_contract(tmp_path, path, planted, broken):
    tree = plain_tree(tmp_path)
    target = tree / "specjax" / path
    target.write_text(target.read_text() + planted)
    result = lint_imports(tree)
    assert result.returncode != 0, result.stdout
    for contract in (LAYERS, INFERENCE, LOW, KERNELS):
        expected = "BROKEN" if contract in broken else "KEPT"
        assert _status(result.stdout, contract) == expected, (contract, result.stdout)


def test_new_module_must_take_a_layer(tmp_path):
    """exhaustive: a new top-level module that no layer declares breaks the contract."""
    tree = plain_tree(tmp_path)
    (tree / "specjax" / "newroom.py").write_text("")
    result = lint_imports(tree)
    assert result.returncode != 0
    assert _status(result.stdout, LAYERS) == "BROKEN"
    assert "specjax.newroom" in result.stdout


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        done = lint_imports(plain_tree(Path(tmp)))
    sys.stdout.write(done.stdout + done.stderr)
    sys.exit(done.returncode)
