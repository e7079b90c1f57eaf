"""The shape DESIGN.md gives the package: its import layers hold, no package's modules import each other
in a cycle, and nothing outside autotune/engines/ branches on an engine's name (an engine is its
adapter, its search space and its flag schema)."""
import ast
import subprocess
import sys

from autotune import PROJECT_ROOT
from autotune.engines import ENGINES, get_adapter
from autotune.space import load_space

PACKAGE = PROJECT_ROOT / "autotune"


def test_import_layers_and_no_cycles():
    # import-linter's own entry point through this interpreter: its console script need not sit next to it
    # (a venv over the system's site-packages has none)
    linter = "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"
    done = subprocess.run([sys.executable, "-c", linter], cwd=PROJECT_ROOT, capture_output=True, text=True,
                          timeout=300, check=False)
    assert done.returncode == 0, done.stdout[-3000:]
    assert "2 kept, 0 broken" in done.stdout


def engine_name_comparisons(tree: ast.AST) -> list[int]:
    """Lines that compare something with an engine's name, or test membership in a tuple of them."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            for operand in [node.left, *node.comparators]:
                values = operand.elts if isinstance(operand, (ast.Tuple, ast.List, ast.Set)) else [operand]
                if any(isinstance(v, ast.Constant) and v.value in ENGINES for v in values):
                    lines.append(node.lineno)
    return lines


def test_nothing_outside_engines_branches_on_an_engine_name():
    found = {}
    for path in PACKAGE.rglob("*.py"):
        if path.is_relative_to(PACKAGE / "engines"):
            continue
        if lines := engine_name_comparisons(ast.parse(path.read_text())):
            found[str(path.relative_to(PROJECT_ROOT))] = lines
    assert found == {}
    # the check itself sees such a branch
    assert engine_name_comparisons(ast.parse('if engine == "sglang" or kind in ("vllm", "x"):\n    pass')) == [1, 1]


def test_every_registered_engine_has_its_three_files():
    for name in ENGINES:
        adapter = get_adapter(name)
        assert adapter.name == name
        assert load_space(name).engine == name  # search_spaces/<name>.yaml
        if name != "embedded":  # its schema is built from EngineConfig's fields
            assert (PACKAGE / "engines" / "schemas" / f"{name}-{adapter.version}.json").exists()
