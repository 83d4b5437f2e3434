"""The layout DESIGN.md asks for, held by the code: one folder per phase under components/, each with the same entry
file; what phases share lives in core/ (built on the data contracts), so no phase folder imports another and core
imports none of them; no two modules share a name."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "components"
PHASES = sorted(p.name for p in ROOT.iterdir() if p.is_dir() and p.name not in ("core", "__pycache__"))


def _imports(path: Path) -> set[str]:
    """The components.<folder> every import statement of a file names (module level or inside functions)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        for name in names:
            parts = name.split(".")
            if parts[0] == "components" and len(parts) > 1:
                out.add(parts[1])
    return out


def test_every_phase_folder_has_its_recipe_and_component():
    assert set(PHASES) == {"dpo", "evaluation", "grpo", "prepare", "rejection_sampling", "sandbox", "sft"}
    for phase in PHASES:
        assert (ROOT / phase / "recipe.py").is_file(), f"components/{phase}/recipe.py: the phase's entry file"
        assert (ROOT / phase / "component.py").is_file(), f"components/{phase}/component.py: its KFP wrapper"


def test_no_phase_imports_another_and_core_imports_no_phase():
    crossing = []
    for folder in [*PHASES, "core"]:
        for path in sorted((ROOT / folder).rglob("*.py")):
            for target in _imports(path) - {folder, "core"}:
                crossing.append(f"{path.relative_to(ROOT)} imports components.{target}")
    assert crossing == []


def test_no_two_modules_share_a_name():
    by_name = defaultdict(list)
    for path in ROOT.rglob("*.py"):
        if path.name not in ("__init__.py", "__main__.py", "recipe.py", "component.py"):
            by_name[path.name].append(str(path.relative_to(ROOT)))
    assert {n: p for n, p in by_name.items() if len(p) > 1} == {}
