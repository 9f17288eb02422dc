"""The tree's dependency rules (docs/design.md, "Layout"): no import cycles, dspark_jax
never imports converters, torch or speculators, and the repository cites only itself."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("dspark_jax", "converters", "launch")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def imports(path: Path, *, module_level: bool) -> set[str]:
    """Absolute module names ``path`` imports (``from a import b`` yields a and a.b)."""
    tree = ast.parse(path.read_text(), str(path))
    nodes = tree.body if module_level else ast.walk(tree)
    out: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
    return out


def test_no_module_level_import_cycles():
    mods = modules()
    graph = {m: {i for i in imports(p, module_level=True) if i in mods} for m, p in mods.items()}
    state: dict[str, int] = {}  # 1: on the stack, 2: done

    def visit(m: str, stack: list[str]) -> list[str] | None:
        state[m] = 1
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return [*stack[stack.index(n) :], n] if n in stack else [m, n]
            if n not in state:
                cycle = visit(n, [*stack, n])
                if cycle:
                    return cycle
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state:
            cycle = visit(m, [m])
            assert cycle is None, " -> ".join(cycle)


def test_dependencies_run_one_way():
    forbidden = ("converters", "torch", "speculators", "transformers", "launch", "tests", "bench")
    bad = []
    for name, path in modules().items():
        if not name.startswith("dspark_jax"):
            continue
        for imp in imports(path, module_level=False):
            if imp.split(".")[0] in forbidden:
                bad.append(f"{path.relative_to(ROOT)} imports {imp}")
    assert not bad, "\n".join(bad)


def test_the_cycle_check_finds_a_planted_cycle(tmp_path, monkeypatch):
    # The checker itself must be able to fail: two modules importing each other.
    pkg = tmp_path / "dspark_jax"
    pkg.mkdir()
    (pkg / "a.py").write_text("from dspark_jax import b\n")
    (pkg / "b.py").write_text("import dspark_jax.a\n")
    for p in ("converters", "launch"):
        (tmp_path / p).mkdir()
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    try:
        test_no_module_level_import_cycles()
    except AssertionError as e:
        assert "dspark_jax.a" in str(e) and "dspark_jax.b" in str(e)
    else:
        raise AssertionError("a planted cycle went unnoticed")


def test_code_cites_only_this_repository():
    needle = "shared" + "/"  # spelled so that this file does not match itself
    offenders = [
        str(p.relative_to(ROOT))
        for d in (*PACKAGES, "tests", "bench")
        for p in (ROOT / d).rglob("*.py")
        if needle in p.read_text()
    ]
    assert not offenders, f"files citing a path outside the repository: {offenders}"
