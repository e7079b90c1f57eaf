"""install.sh: reassemble the parts, decompress what travelled compressed, check every sha256, install the wheels
with pip (no index, no dependency resolution: the bundle is the resolution), then check the requirements the
bundle left to the machine."""
import shlex
from dataclasses import dataclass
from pathlib import Path

from autotune.bundle.split import Part

TEMPLATE = r'''#!/usr/bin/env bash
# {title}
#   bash install.sh [--check] [--target DIR] [FOLDER...]
# FOLDER: where the parts lie (searched below it; default: parts/ beside this script). Every part is checked
# against its sha256 before anything is installed, and every wheel joined from them again. --target DIR installs
# there (then PYTHONPATH=DIR) instead of into the environment of $PYTHON (default python3). --check installs
# nothing: it says whether the packages the bundle expects on this machine are there.
set -euo pipefail
here=$(cd "$(dirname "${{BASH_SOURCE[0]}}")" && pwd)
python=${{PYTHON:-python3}}
target="" check_only=0 folders=()
while [ $# -gt 0 ]; do
  case $1 in
    --check) check_only=1 ;;
    --target) [ $# -ge 2 ] || {{ echo "install.sh: --target needs a folder" >&2; exit 2; }}; target=$2; shift ;;
    -*) echo "install.sh: unknown option $1" >&2; exit 2 ;;
    *) folders+=("$1") ;;
  esac
  shift
done
[ ${{#folders[@]}} -gt 0 ] || folders=("$here/parts")

# name<TAB>specifier of each requirement the bundle left to this machine (it has the package, the freeze it was
# made from said which version, or did not)
requirements=$(cat <<'REQUIREMENTS'
{requirements}
REQUIREMENTS
)
check_requirements() {{
  PYTHONPATH="${{target:+$target:}}${{PYTHONPATH:-}}" "$python" - "$requirements" <<'PY'
import sys
from importlib import metadata
try:
    from packaging.specifiers import SpecifierSet
except ImportError:  # pip's own copy, wherever pip runs
    from pip._vendor.packaging.specifiers import SpecifierSet
unmet = []
for line in sys.argv[1].splitlines():
    if not line.strip():
        continue
    name, _, spec = line.partition("\t")
    try:
        have = metadata.version(name)
    except metadata.PackageNotFoundError:
        unmet.append(f"{{name}}: not installed (wanted {{spec or 'any version'}})")
        continue
    if spec and not SpecifierSet(spec).contains(have, prereleases=True):
        unmet.append(f"{{name}} {{have}} does not meet {{spec}}")
print("\n".join(f"unmet: {{u}}" for u in unmet) or "every requirement left to this machine is met")
sys.exit(1 if unmet else 0)
PY
}}
if [ $check_only = 1 ]; then check_requirements; exit; fi

# sha256 and name of every part
parts=$(cat <<'PARTS'
{parts}
PARTS
)
# sha256 and name of every wheel as pip installs it, the name of the file that carries it (the wheel, or the wheel
# stored and zstd-compressed: NAME.zst) and that file's piece count (0: the part is the file itself)
wheels=$(cat <<'WHEELS'
{wheels}
WHEELS
)
# the same for the bundle's own zstandard wheel, which decompresses where this machine has no zstd (not installed)
zstd_wheel="{zstd_wheel}"
find_part() {{ find "${{folders[@]}}" -type f -name "$1" -print -quit 2>/dev/null; }}
while read -r sha name; do
  path=$(find_part "$name")
  [ -n "$path" ] || {{ echo "install.sh: part $name is missing (looked under ${{folders[*]}})" >&2; exit 1; }}
  echo "$sha  $path" | sha256sum --check --status || {{ echo "install.sh: part $name is corrupted (its sha256 differs)" >&2; exit 1; }}
done <<< "$parts"

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# rebuild DIR SHA WHEEL CARRIED PIECES: the wheel in DIR, joined from its pieces, decompressed, checked
rebuild() {{
  local dir=$1 sha=$2 wheel=$3 carried=$4 pieces=$5
  if [ "$pieces" = 0 ]; then
    cp "$(find_part "$carried")" "$dir/$carried"
  else
    for i in $(seq 0 $((pieces - 1))); do cat "$(find_part "$(printf '%s.part%03d' "$carried" "$i")")"; done > "$dir/$carried"
  fi
  if [ "$carried" != "$wheel" ]; then decompress "$dir/$carried" "$dir/$wheel"; rm "$dir/$carried"; fi
  echo "$sha  $dir/$wheel" | sha256sum --check --status || {{ echo "install.sh: $wheel joined from its parts is corrupted" >&2; exit 1; }}
}}
decompress() {{
  if command -v zstd >/dev/null; then zstd -d -q -f --long=31 -o "$2" "$1"; return; fi
  if ! "$python" -c 'import zstandard' 2>/dev/null && [ ! -d "$work/zstd" ]; then
    mkdir "$work/helper"
    rebuild "$work/helper" $zstd_wheel
    "$python" -m zipfile -e "$work/helper/"*.whl "$work/zstd"
  fi
  PYTHONPATH="$work/zstd${{PYTHONPATH:+:$PYTHONPATH}}" "$python" -c '
import sys, zstandard
with open(sys.argv[1], "rb") as src, open(sys.argv[2], "wb") as dst:
    zstandard.ZstdDecompressor(max_window_size=1 << 31).copy_stream(src, dst)' "$1" "$2"
}}
while read -r sha wheel carried pieces; do rebuild "$work" "$sha" "$wheel" "$carried" "$pieces"; done <<< "$wheels"
echo "install.sh: {count} wheels checked; installing"
"$python" -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir --upgrade ${{target:+--target "$target"}} "$work"/*.whl
check_requirements || echo "install.sh: installed; the requirements above are not met on this machine"
'''


@dataclass(frozen=True)
class Carried:
    """A wheel as install.sh rebuilds it: the sha256 of the wheel pip installs, its name, the file that carries it
    (the wheel itself, or WHEEL.zst: stored and compressed) and that file's piece count (0: one whole part)."""
    sha256: str
    wheel: str
    carried: str
    pieces: int


def _row(w: Carried) -> str:
    return f"{w.sha256} {w.wheel} {w.carried} {w.pieces}"


def install_script(title: str, parts: list[Part], wheels: list[Carried], requirements: dict[str, str],
                   zstd_wheel: Carried | None = None) -> str:
    """install.sh's text. zstd_wheel: a zstandard wheel among the parts (not installed), for a machine without
    zstd where any wheel is carried compressed."""
    rows = [*wheels, *([zstd_wheel] if zstd_wheel else [])]
    for name in [p.name for p in parts] + [n for w in rows for n in (w.wheel, w.carried)]:
        if shlex.quote(name) != name:  # the tables are read word by word
            raise ValueError(f"a file name install.sh cannot carry: {name!r}")
    return TEMPLATE.format(
        title=title,
        requirements="\n".join(f"{name}\t{spec}" for name, spec in sorted(requirements.items())),
        parts="\n".join(f"{p.sha256} {p.name}" for p in sorted(parts, key=lambda p: p.name)),
        wheels="\n".join(_row(w) for w in sorted(wheels, key=lambda w: w.wheel)),
        zstd_wheel=_row(zstd_wheel) if zstd_wheel else "", count=len(wheels))


def write_install_script(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(0o755)
    return path
