"""Imports go downward only: interface ← layers ← models ← engine ← processing ← the Triton glue and the CLI; the
adapter uses nothing of the Triton side but the torch-free interface; kernels import nothing of ours."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# package → the packages of ours it may import (besides itself)
ALLOWED = {
    "backend.interface": set(),
    "backend.config": {"backend.interface"},
    "backend.layers": {"kernels", "backend.config", "backend.interface"},
    "backend.models": {"kernels", "backend.layers", "backend.model_files", "backend.interface"},
    "backend.engine": {"kernels", "backend.config", "backend.layers", "backend.models", "backend.model_files",
                       "backend.interface"},
    "backend.processing": {"backend.config", "backend.engine", "backend.layers", "backend.interface"},
    "kernels": set(),
    "openai_adapter": {"backend.interface"},
}


def _package_of(module: str) -> str:
    for package in sorted(ALLOWED, key=len, reverse=True):
        if module == package or module.startswith(package + "."):
            return package
    return module


def _our_imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else \
            [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else []
        found |= {name for name in names if name.split(".")[0] in ("backend", "kernels", "openai_adapter", "tritonllm")}
    return found


def _modules():
    for package in ALLOWED:
        base = ROOT / package.replace(".", "/")
        files = sorted(base.rglob("*.py")) if base.is_dir() else [base.with_suffix(".py")]
        for path in files:
            yield pytest.param(package, path, id=str(path.relative_to(ROOT)))


@pytest.mark.parametrize("package, path", list(_modules()))
def test_imports_go_downward(package, path):
    allowed = ALLOWED[package] | {package}
    wrong = sorted(name for name in _our_imports(path) if _package_of(name) not in allowed)
    assert not wrong, f"{path.relative_to(ROOT)} ({package}) imports {wrong}"
