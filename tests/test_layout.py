"""The tree's dependency rules (docs/design.md, "Layout"): layers that import only
downwards, no import cycles (at module level or inside functions), dspark_jax never
imports converters, torch or speculators, and the repository cites only itself."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("dspark_jax", "converters", "launch")
# Bottom to top: a module imports only from its own layer or those below. The members
# of a layer may import each other (the cycle tests keep that one-way). eval sits below
# convert (the exported model card shows eval's tables; evaluating a checkpoint never
# goes through the converter).
LAYERS = (
    (
        "dspark_jax",
        "dspark_jax.config",
        "dspark_jax.anchors",
        "dspark_jax.losses",
        "dspark_jax.parallel",
        "dspark_jax.cli",
        "dspark_jax.file_mode",
        "dspark_jax.run_file",
        "dspark_jax.hf_folder",
    ),
    ("dspark_jax.model", "dspark_jax.verifier", "dspark_jax.data", "dspark_jax.optim"),
    ("dspark_jax.checkpoint",),
    ("dspark_jax.eval",),
    ("dspark_jax.convert",),
    ("dspark_jax.train",),
    ("converters", "launch"),
)


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


def layer(name: str) -> int | None:
    """The index in LAYERS of the longest entry that ``name`` is or lies under (the
    package ``dspark_jax`` itself is only its own ``__init__``)."""
    best = None
    for index, members in enumerate(LAYERS):
        for member in members:
            under = member != "dspark_jax" and name.startswith(member + ".")
            if name == member or under:
                if best is None or len(member) > len(best[1]):
                    best = (index, member)
    return None if best is None else best[0]


def find_cycle(module_level: bool) -> list[str] | None:
    mods = modules()
    graph = {
        m: {i for i in imports(p, module_level=module_level) if i in mods} for m, p in mods.items()
    }
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
            if cycle:
                return cycle
    return None


def test_no_module_level_import_cycles():
    cycle = find_cycle(module_level=True)
    assert cycle is None, " -> ".join(cycle)


def test_no_import_cycles_inside_functions_either():
    # An import inside a function ties the two modules together for a reader all the same.
    cycle = find_cycle(module_level=False)
    assert cycle is None, " -> ".join(cycle)


def test_layers_import_only_downwards():
    mods = modules()
    unplaced = sorted(m for m in mods if layer(m) is None)
    assert not unplaced, f"modules in no layer (add them to LAYERS): {unplaced}"
    bad = []
    for name, path in mods.items():
        for imp in imports(path, module_level=False):
            target = layer(imp)
            if target is not None and target > layer(name):
                bad.append(f"{path.relative_to(ROOT)} imports {imp} (a layer above it)")
    assert not bad, "\n".join(sorted(bad))


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


def test_the_layer_check_finds_a_planted_upward_import(tmp_path, monkeypatch):
    # convert reaching up into train from inside a function, and a module in no layer.
    for d in ("dspark_jax/convert", "dspark_jax/train", "converters", "launch"):
        (tmp_path / d).mkdir(parents=True)
    (tmp_path / "dspark_jax/train/flags.py").write_text("X = 1\n")
    (tmp_path / "dspark_jax/convert/export.py").write_text(
        "def card():\n    from dspark_jax.train import flags\n    return flags.X\n"
    )
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    try:
        test_layers_import_only_downwards()
    except AssertionError as e:
        assert "dspark_jax/convert/export.py imports dspark_jax.train" in str(e), e
    else:
        raise AssertionError("a planted upward import went unnoticed")
    (tmp_path / "dspark_jax/extra.py").write_text("")
    try:
        test_layers_import_only_downwards()
    except AssertionError as e:
        assert "dspark_jax.extra" in str(e), e
    else:
        raise AssertionError("a module outside the layers went unnoticed")


def test_the_cycle_check_sees_imports_inside_functions(tmp_path, monkeypatch):
    pkg = tmp_path / "dspark_jax"
    pkg.mkdir()
    (pkg / "a.py").write_text("from dspark_jax import b\n")
    (pkg / "b.py").write_text("def f():\n    import dspark_jax.a\n")
    for p in ("converters", "launch"):
        (tmp_path / p).mkdir()
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    test_no_module_level_import_cycles()  # at module level, b imports nothing
    try:
        test_no_import_cycles_inside_functions_either()
    except AssertionError as e:
        assert "dspark_jax.a" in str(e) and "dspark_jax.b" in str(e)
    else:
        raise AssertionError("a cycle through a function-level import went unnoticed")


def test_code_cites_only_this_repository():
    needle = "shared" + "/"  # spelled so that this file does not match itself
    offenders = [
        str(p.relative_to(ROOT))
        for d in (*PACKAGES, "tests", "bench")
        for p in (ROOT / d).rglob("*.py")
        if needle in p.read_text()
    ]
    assert not offenders, f"files citing a path outside the repository: {offenders}"


def test_the_exporter_imports_the_checkpoint_format_not_the_trainers_machinery():
    # One owner per format: reading a checkpoint (export) pulls neither the trainer's
    # Checkpointer (and Grain with it) nor the trainer's flags.
    code = (
        "import sys, dspark_jax.convert.export\n"
        "print(sorted(m for m in ('grain', 'dspark_jax.checkpoint.checkpointer',"
        " 'dspark_jax.train.flags', 'dspark_jax.train') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    )
    assert out.stdout.strip() == "[]", out.stdout
