"""The user's guide stays true to the tree: its links resolve, its commands exist, every benchmark is listed."""
import re
from pathlib import Path

import pytest
import typer

from autotune.cli import app

ROOT = Path(__file__).resolve().parent.parent
LINKED_DOCS = ("README.md", "benchmarks/RESULTS.md", "benchmarks/README.md")
MARKDOWN_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
# What the README shows a user typing: fenced blocks and `inline code`.
FENCED = re.compile(r"^```.*?^```", re.DOTALL | re.MULTILINE)
INLINE = re.compile(r"`([^`\n]+)`")
# `autotune run`, `python3 -m autotune.cli run`; not `autotune/engines` or `autotune.predict`.
COMMAND = re.compile(r"(?:^|[\s;&|(])(?:autotune|-m autotune\.cli)[ \t]+([a-z][\w-]*)(?:[ \t]+([a-z][\w-]*))?")


def heading_anchors(doc: Path) -> set[str]:
    """GitHub's anchors of a markdown file's headings: lower case, punctuation dropped, spaces as hyphens."""
    headings = re.findall(r"^#+ (.+)$", FENCED.sub("", doc.read_text()), re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def relative_links(doc: Path) -> list[str]:
    targets = (m.group(1) for m in MARKDOWN_LINK.finditer(doc.read_text()))
    return [t for t in targets if not re.match(r"[a-z][a-z0-9+.-]*:|#", t)]


@pytest.mark.parametrize("name", LINKED_DOCS)
def test_every_relative_link_points_to_an_existing_path(name):
    doc = ROOT / name
    links = relative_links(doc)
    assert links, f"{name} links nothing: the test would prove nothing"
    broken = [t for t in links if not (doc.parent / t.split("#")[0]).exists()]
    assert not broken, f"{name}: links to missing paths {broken}"
    anchored = [t.split("#") for t in links if "#" in t and t.split("#")[0].endswith(".md")]
    dangling = [f"{path}#{anchor}" for path, anchor in anchored if anchor not in heading_anchors(doc.parent / path)]
    assert not dangling, f"{name}: links to headings that do not exist {dangling}"


def test_the_readme_shows_the_two_set_up_commands_ci_runs():
    # .ci/run runs these two lines on a clean clone: the README must show them as they are
    readme, ci = (ROOT / "README.md").read_text(), (ROOT / ".ci/run").read_text()
    for line in ("bash setup.sh && autotune run --gpu auto", "bash setup.sh dev && python3 -m pytest -q"):
        assert f"\n{line}\n" in readme, f"README.md lost the set-up command {line!r}"
    assert "bash setup.sh dev && python3 -m pytest -q" in ci


def test_every_benchmark_script_is_listed_in_the_benchmarks_readme():
    readme = (ROOT / "benchmarks/README.md").read_text()
    scripts = sorted(p.name for p in (ROOT / "benchmarks").glob("*.py"))
    assert scripts
    missing = [s for s in scripts if not re.search(rf"(?<![\w/]){re.escape(s)}\b", readme)]
    assert not missing, f"benchmarks/README.md does not list {missing}"


def named_commands(text: str) -> set[tuple[str, str | None]]:
    code = [m.group(0) for m in FENCED.finditer(text)]
    code += [m.group(1) for m in INLINE.finditer(FENCED.sub("", text))]
    return {(m.group(1), m.group(2)) for snippet in code for line in snippet.splitlines()
            for m in COMMAND.finditer(line)}


def test_every_autotune_subcommand_the_readme_names_exists():
    cli = typer.main.get_command(app)
    named = named_commands((ROOT / "README.md").read_text())
    assert {"run", "probe", "ci"} <= {first for first, _ in named}, named
    unknown = []
    for first, second in sorted(named, key=str):
        command = cli.commands.get(first)
        if command is None:
            unknown.append(first)
        elif hasattr(command, "commands") and second and second not in command.commands:
            unknown.append(f"{first} {second}")
    assert not unknown, f"README.md names subcommands the CLI does not have: {unknown}"
