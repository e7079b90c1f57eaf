"""Results hygiene (issue 32 point 5): every folder of benchmarks/results says which commit and which command made
it, and git keeps no model weights, databases or large files there (MANIFEST.json lists what left)."""
import json
import re
import subprocess
from pathlib import Path, PurePosixPath

ROOT = Path(__file__).resolve().parents[1]
RESULTS = "benchmarks/results"
BINARY_SUFFIXES = {".db", ".gguf", ".safetensors", ".bin", ".pt"}
MAX_BYTES = 512 * 1024
MAX_LOG_BYTES = 16 * 1024  # a log stays only when it is short and its README cites it
HEX = re.compile(r"\b[0-9a-f]{7,40}\b")
# A command as a README quotes it: in a code span or a fenced block, after any VAR=value assignments.
COMMAND = re.compile(r"^\s*(?:\$\s+)?(?:[A-Z_]+=\S*\s+)*(?:python3?|autotune|bash)\s+\S+")


def git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=False)


def tracked() -> list[PurePosixPath]:
    listing = git("ls-files", "-z", RESULTS)
    assert listing.returncode == 0, listing.stderr
    return [PurePosixPath(p) for p in listing.stdout.split("\0") if p]


def folders() -> set[str]:
    return {p.parts[2] for p in tracked() if len(p.parts) > 3}


def is_commit(name: str) -> bool:
    return git("cat-file", "-e", f"{name}^{{commit}}").returncode == 0


FENCED = re.compile(r"^```[^\n]*\n(.*?)^```", re.MULTILINE | re.DOTALL)
INDENTED = re.compile(r"^(?: {4}|\t)(.+)$", re.MULTILINE)
SPAN = re.compile(r"`([^`\n]+)`")


def quoted_code(markdown: str) -> list[str]:
    """The README's code: the lines of fenced and indented blocks, and its code spans."""
    fenced = [line for block in FENCED.findall(markdown) for line in block.splitlines()]
    prose = FENCED.sub("", markdown)
    return fenced + INDENTED.findall(prose) + SPAN.findall(prose)


def test_every_results_folder_names_its_commit_and_command():
    files = set(tracked())
    missing, no_commit, no_command = [], [], []
    for folder in sorted(folders()):
        readme = PurePosixPath(RESULTS, folder, "README.md")
        if readme not in files:
            missing.append(folder)
            continue
        text = (ROOT / readme).read_text()
        if not any(is_commit(h) for h in set(HEX.findall(text))):
            no_commit.append(folder)
        if not any(COMMAND.match(code) for code in quoted_code(text)):
            no_command.append(folder)
    assert len(folders()) >= 20  # the listing saw the results, not an empty tree
    assert (missing, no_commit, no_command) == ([], [], [])


def test_no_binaries_or_large_files_are_tracked_under_results():
    too_big, binary = [], []
    for path in tracked():
        size = (ROOT / path).stat().st_size
        limit = MAX_LOG_BYTES if path.suffix == ".log" else MAX_BYTES
        if size > limit:
            too_big.append(f"{path} ({size} bytes)")
        if path.suffix in BINARY_SUFFIXES:
            binary.append(str(path))
    assert (too_big, binary) == ([], [])


def test_each_manifest_lists_files_git_no_longer_holds():
    files = set(tracked())
    manifests = [p for p in files if p.name == "MANIFEST.json" and len(p.parts) == 4]
    assert manifests
    for manifest in manifests:
        removed = json.loads((ROOT / manifest).read_text())["removed"]
        for entry in removed:
            assert manifest.parent / entry["path"] not in files, entry["path"]
            assert re.fullmatch(r"[0-9a-f]{64}", entry["sha256"]) and entry["bytes"] >= 0, entry
