"""The package face: the model, the ring, the kernels and the data pipeline import with
torch alone; the Lightning wing loads on demand and registers the strategy name."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python < 3.11
    import tomli as tomllib


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_model_and_ring_import_without_lightning():
    proc = _run(
        "import sys, longctx, longctx.models, longctx.kernels, longctx.data\n"
        "from longctx import ring_attention, parallelize, ParallelPlan\n"
        "from longctx.models import GPT, GPTConfig, TransformerBlock\n"
        "heavy = [m for m in ('lightning', 'pytorch_lightning', 'torchmetrics') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_strategy_name_registered_whatever_the_import_order():
    check = (
        "from lightning.pytorch.strategies import StrategyRegistry\n"
        "import longctx\n"
        "assert 'context_parallel' in StrategyRegistry, sorted(StrategyRegistry)\n"
        "assert StrategyRegistry['context_parallel']['strategy'] is longctx.ContextParallelStrategy\n"
    )
    for first in ("import longctx\n", "import lightning\n"):
        proc = _run(first + check)
        assert proc.returncode == 0, (first, proc.stderr[-2000:])


# ---- no two files import each other ---------------------------------------------------------

REPO = Path(__file__).resolve().parents[2]


def _package_dirs() -> dict[str, str]:
    """Import name -> folder, from pyproject.toml's package-dir table (models/ is longctx.models)."""
    table = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    return {package: folder for package, folder in table.items()}


def _modules() -> dict[str, Path]:
    """Every module of the library by its dotted import name."""
    modules = {}
    for package, folder in _package_dirs().items():
        for path in (REPO / folder).rglob("*.py"):
            parts = list(path.relative_to(REPO / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join([package, *parts])] = path
    return modules


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The library modules ``name`` imports anywhere in its file (function-local imports too)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            # ``from pkg import mod`` imports the module mod; ``from mod import name`` imports mod.
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for target in targets:
            # The top-level folders are also importable from the repository root as
            # ``models``/``kernels``: the same files as longctx.models/longctx.kernels.
            for package_name, folder in _package_dirs().items():
                if target == folder or target.startswith(folder + "."):
                    if package_name != folder:
                        target = package_name + target[len(folder) :]
            while target and target not in known:
                target = target.rpartition(".")[0]  # ``import a.b.name`` of a non-module name
            if target and target != name:
                found.add(target)
    return found


def test_no_two_modules_import_each_other():
    modules = _modules()
    graph = {name: _imports(name, path, set(modules)) for name, path in modules.items()}
    assert "longctx.kernels.triton_attention" in graph and "longctx.models.gpt" in graph  # the scan sees them
    assert "longctx.layouts" in graph["longctx.models.gpt"]  # and resolves their imports
    pairs = sorted({tuple(sorted((a, b))) for a, targets in graph.items() for b in targets if a in graph[b]})
    assert not pairs, f"modules that import each other: {pairs}"
