"""The shape DESIGN.md gives the package: its import layers hold, no package's modules import each other
in a cycle, and nothing outside autotune/engines/ branches on an engine's name (an engine is its
adapter, its search space and its flag schema)."""
import ast
import re
import subprocess
import sys
from pathlib import Path

import typer

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


# What an adapter may take of the memory and speed model: the record it fills in (knobs.py) and GGUF headers.
PREDICT_FOR_ENGINES = {"autotune.predict.knobs", "autotune.predict.gguf_types"}


def imported_modules(tree: ast.AST) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            names |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
    return names


def test_engines_import_only_the_records_of_predict():
    """The arithmetic of prediction (kernel counts, memory pools, speed) stays in autotune/predict/: an adapter
    reads its config into predict's Knobs record and imports nothing else of it."""
    found = {}
    for path in (PACKAGE / "engines").rglob("*.py"):
        names = {n for n in imported_modules(ast.parse(path.read_text())) if n.startswith("autotune.predict")}
        modules = {n for n in names if (PROJECT_ROOT / (n.replace(".", "/") + ".py")).exists()}
        if modules - PREDICT_FOR_ENGINES:
            found[path.name] = sorted(modules - PREDICT_FOR_ENGINES)
    assert found == {}
    # the check itself sees an adapter reaching into the speed model
    tree = ast.parse("from autotune.predict.speed import KERNELS_PER_LAYER\nimport autotune.predict.memory")
    assert imported_modules(tree) >= {"autotune.predict.speed", "autotune.predict.memory"}


# -- docs/architecture.md and docs/contributing.md, checked against the code ---------------------------
ARCHITECTURE, CONTRIBUTING = PROJECT_ROOT / "docs" / "architecture.md", PROJECT_ROOT / "docs" / "contributing.md"
FENCED = re.compile(r"^```.*?^```", re.DOTALL | re.MULTILINE)
INLINE = re.compile(r"`([^`\n]+)`")
MARKDOWN_LINK = re.compile(r"\[[^\]]*\]\(([^)\s#]+)\)")
# A repository path as the docs write one: relative, slash-separated, optionally a test (path::name).
REPO_PATH = re.compile(r"[\w-][\w.-]*(?:/[\w.-]*)+(?:::\w+)?")
# What a study writes under its own folder: named in the docs, never in the repository.
STUDY_OUTPUTS = ("best/", "logs/", "requests/", "validation/", "studies/", "ci/", "estimator-eval/")


def inline_code(text: str) -> list[str]:
    return INLINE.findall(FENCED.sub("", text))


def repository_paths(text: str) -> list[str]:
    """The repository paths (and tests, path::name) a doc names in inline code."""
    return [t for t in inline_code(text) if REPO_PATH.fullmatch(t) and not t.startswith(STUDY_OUTPUTS)]


def defines(file: Path, function: str) -> bool:
    return function in {f.name for f in ast.parse(file.read_text()).body if isinstance(f, ast.FunctionDef)}


def missing_paths(doc: Path) -> list[str]:
    """What the doc names that is not there: a path, a test in its file, a relative link's target."""
    text = doc.read_text()
    missing = [link for link in MARKDOWN_LINK.findall(text) if not (doc.parent / link).exists()]
    for named in repository_paths(text):
        path, _, test = named.partition("::")
        file = PROJECT_ROOT / path
        if not (file.exists() and (not test or defines(file, test))):
            missing.append(named)
    return missing


def test_every_path_and_test_the_docs_name_exists():
    for doc in (ARCHITECTURE, CONTRIBUTING):
        assert len(repository_paths(doc.read_text())) >= 20, f"{doc.name} names almost nothing: the test would prove nothing"
        assert missing_paths(doc) == [], doc.name
    # the check sees what is not there, and leaves commands, URLs and a study's outputs alone
    assert repository_paths("`autotune/engines/nope.py` `tests/test_cli.py::test_nope` `best/launch.sh` "
                            "`/admin/runtime` `bash setup.sh vllm` `https://x.org/a`") == [
        "autotune/engines/nope.py", "tests/test_cli.py::test_nope"]


def contract_layers() -> list[set[str]]:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10: import-linter's own TOML reader
        import tomli as tomllib
    contracts = tomllib.loads((PROJECT_ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    layers = next(c["layers"] for c in contracts if c["type"] == "layers")
    return [{name.strip() for name in layer.split(":")} for layer in layers]


def test_the_layers_architecture_md_names_are_the_import_contracts():
    text = ARCHITECTURE.read_text()
    section = text.split("## Layers", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if re.match(r"\|\s*\d+\s*\|", line)]
    named = [set(re.findall(r"`(autotune(?:\.\w+)?)`", row.split("|")[2])) for row in rows]
    assert named == contract_layers()


def test_every_package_and_module_of_autotune_is_in_architecture_md():
    named = set(inline_code(ARCHITECTURE.read_text()))
    parts = [f"autotune/{p.name}/" for p in PACKAGE.iterdir() if (p / "__init__.py").exists()]
    parts += [f"autotune/{p.name}" for p in PACKAGE.glob("*.py") if p.name != "__init__.py"]
    assert len(parts) >= 15
    assert sorted(p for p in parts if p not in named) == []


def test_the_engines_named_are_the_registered_adapters():
    line = next(line for line in ARCHITECTURE.read_text().splitlines() if line.startswith("Registered engines:"))
    assert set(re.findall(r"`(\w+)`", line)) == set(ENGINES)
    # contributing.md tells a new engine to add itself to --engine's help: every registered one is there
    from autotune.cli import app

    commands = typer.main.get_command(app).commands
    for command in ("run", "estimate"):
        engine_help = next(p.help for p in commands[command].params if p.name == "engine")
        assert set(re.findall(r"\w+", engine_help)) >= set(ENGINES), command


def test_contributing_names_every_file_of_an_engine():
    """contributing.md's "Add an engine" names every file that holds something of vLLM's: its adapter module, the
    registry, its captured schemas, its space, and every other module of the package that spells its name."""
    from autotune.engines import REGISTRY
    from autotune.engines.vllm import SCHEMA_VERSIONS

    section = CONTRIBUTING.read_text().split("## Add an engine", 1)[1].split("\n## ", 1)[0]
    named = set(repository_paths(section))
    files = {REGISTRY["vllm"].split(":")[0].replace(".", "/") + ".py", "autotune/engines/__init__.py",
             "search_spaces/vllm.yaml", *(f"autotune/engines/schemas/vllm-{v}.json" for v in SCHEMA_VERSIONS)}
    for path in PACKAGE.rglob("*.py"):
        if any(isinstance(n, ast.Constant) and n.value == "vllm" for n in ast.walk(ast.parse(path.read_text()))):
            files.add(str(path.relative_to(PROJECT_ROOT)))
    assert len(files) >= 6
    assert sorted(files - named) == []


def test_tests_mirror_the_package():
    """tests/<package>/ holds the tests of autotune/<package>/; tests/ itself only the top-level modules' tests and
    the whole-repository checks (a package's test dropped at the top would fail here)."""
    tests = PROJECT_ROOT / "tests"
    folders = {p.name for p in tests.iterdir() if p.is_dir() and p.name not in ("fixtures", "__pycache__")}
    packages = {p.parent.name for p in PACKAGE.glob("*/__init__.py")}
    assert folders and folders <= packages, sorted(folders - packages)
    top = {p.stem.removeprefix("test_") for p in tests.glob("test_*.py")}
    modules = {p.stem for p in PACKAGE.glob("*.py")}
    assert top - modules == {"architecture", "docs", "package", "results_hygiene"}
