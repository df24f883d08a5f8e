"""The layer order of pyproject.toml's import-linter contract holds for the package, and
an import that runs up a layer breaks it (so the check in `make lint` can fail)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"


def lint_imports(root: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(root)}  # this copy of headroom, not the installed one
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache"], cwd=root, env=env, capture_output=True, text=True, timeout=300, check=False
    )


def copy_of_the_package(tmp_path: Path) -> Path:
    shutil.copytree(ROOT / "headroom", tmp_path / "headroom", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path


def test_the_package_keeps_its_layers(tmp_path):
    run = lint_imports(copy_of_the_package(tmp_path))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "One layer per package, no arrow up KEPT" in run.stdout


@pytest.mark.parametrize(
    ("module", "upward"),
    [
        ("models/llama.py", "from headroom.executor.sampler import Sampler"),  # models below executor
        ("contracts/request.py", "from headroom.config import Config"),  # contracts at the bottom
        ("observability/hol.py", "from headroom.admission.tenants import Tenant"),  # independent siblings
        ("prediction/train.py", "from headroom.admission.tenants import Tenant"),  # prediction below admission
    ],
)
def test_an_upward_import_breaks_the_contract(tmp_path, module, upward):
    root = copy_of_the_package(tmp_path)
    path = root / "headroom" / module
    path.write_text(path.read_text() + f"\n{upward}  # noqa\n")
    run = lint_imports(root)
    assert run.returncode != 0 and "One layer per package, no arrow up BROKEN" in run.stdout, run.stdout[-3000:]
    dotted = "headroom." + module.removesuffix(".py").replace("/", ".")
    assert dotted in run.stdout
