"""Imports go downward only: interface ← layers ← models ← core ← processing ← the Triton glue and the CLI; the
adapter uses nothing of the Triton side but the torch-free interface; kernels import nothing of ours; everything
is one import namespace, `tritonllm`."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "tritonllm"
ENGINE_PARTS = {"tritonllm.engine.config", "tritonllm.engine.layers", "tritonllm.engine.models",
                "tritonllm.engine.core", "tritonllm.engine.processing"}
# package → the packages of ours it may import (besides itself)
ALLOWED = {
    "tritonllm.interface": set(),
    "tritonllm.kernels": set(),
    "tritonllm.k_quants": set(),
    "tritonllm.gguf_blocks": {"tritonllm.k_quants", "tritonllm.kernels"},  # kernels: the super-blocks' layouts
    "tritonllm.gguf_file": set(),
    "tritonllm.model_files": {"tritonllm.gguf_blocks", "tritonllm.gguf_file"},
    "tritonllm.parent_death": set(),
    "tritonllm.engine.config": {"tritonllm.interface"},
    "tritonllm.engine.layers": {"tritonllm.kernels", "tritonllm.engine.config", "tritonllm.interface"},
    "tritonllm.engine.models": {"tritonllm.kernels", "tritonllm.engine.layers", "tritonllm.model_files",
                                # gguf_blocks, gguf_file: a GGUF read as it is
                                "tritonllm.gguf_blocks", "tritonllm.gguf_file", "tritonllm.interface"},
    "tritonllm.engine.core": {"tritonllm.kernels", "tritonllm.engine.config", "tritonllm.engine.layers",
                              "tritonllm.engine.models", "tritonllm.model_files", "tritonllm.interface"},
    "tritonllm.engine.processing": {"tritonllm.engine.config", "tritonllm.engine.core", "tritonllm.engine.layers",
                                    "tritonllm.interface"},
    # the glue over the parts (LLMEngine, Triton tensors and metrics): never the adapter or the CLI
    "tritonllm.engine": ENGINE_PARTS | {"tritonllm.kernels", "tritonllm.model_files", "tritonllm.interface"},
    "tritonllm.adapter": {"tritonllm.interface"},
}


def _package_of(module: str) -> str:
    for package in sorted(ALLOWED, key=len, reverse=True):
        if module == package or module.startswith(package + "."):
            return package
    return module


def _our_imports(path: Path) -> set[str]:
    """Every module (or module attribute) of ours that `path` imports, fully named."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found |= {f"{node.module}.{alias.name}" for alias in node.names}
    return {name for name in found if name.split(".")[0] == "tritonllm"}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        package = _package_of(_module_name(path))
        if package in ALLOWED:
            yield pytest.param(package, path, id=str(path.relative_to(ROOT)))


@pytest.mark.parametrize("package, path", list(_modules()))
def test_imports_go_downward(package, path):
    allowed = ALLOWED[package] | {package}
    wrong = sorted(name for name in _our_imports(path) if _package_of(name) not in allowed)
    assert not wrong, f"{path.relative_to(ROOT)} ({package}) imports {wrong}"


def test_every_layer_rule_names_real_modules():
    for package in ALLOWED:
        base = ROOT / package.replace(".", "/")
        assert base.is_dir() or base.with_suffix(".py").is_file(), package


def test_the_model_triton_loads_imports_only_from_the_namespace():
    model = PACKAGE / "model_repository" / "llm" / "1" / "model.py"
    ours = _our_imports(model)
    assert ours and all(_package_of(name) in ALLOWED or name.startswith("tritonllm.") for name in ours)
    tree = ast.parse(model.read_text())
    imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(tree)
                 if isinstance(node, ast.ImportFrom) and node.module and not node.level}
    assert not imported & {"backend", "kernels", "openai_adapter"}


def test_one_top_level_package_is_installed():
    """`pip install tritonllm` adds `tritonllm` alone to site-packages (a top-level `kernels` would shadow Hugging
    Face's, which transformers imports)."""
    find = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    assert find["include"] == ["tritonllm*"]
    stray = sorted(path.parent.name for path in ROOT.glob("*/__init__.py") if path.parent != PACKAGE)
    assert not stray, f"importable folders beside tritonllm/: {stray}"
