"""install.sh: reassemble the parts, check every sha256, install the wheels with pip (no index, no dependency
resolution: the bundle is the resolution), then check the requirements the bundle left to the machine."""
import shlex
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
# sha256, name and piece count of every wheel (0: the part is the wheel itself)
wheels=$(cat <<'WHEELS'
{wheels}
WHEELS
)
find_part() {{ find "${{folders[@]}}" -type f -name "$1" -print -quit 2>/dev/null; }}
while read -r sha name; do
  path=$(find_part "$name")
  [ -n "$path" ] || {{ echo "install.sh: part $name is missing (looked under ${{folders[*]}})" >&2; exit 1; }}
  echo "$sha  $path" | sha256sum --check --status || {{ echo "install.sh: part $name is corrupted (its sha256 differs)" >&2; exit 1; }}
done <<< "$parts"

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
while read -r sha wheel pieces; do
  if [ "$pieces" = 0 ]; then
    cp "$(find_part "$wheel")" "$work/$wheel"
  else
    for i in $(seq 0 $((pieces - 1))); do cat "$(find_part "$(printf '%s.part%03d' "$wheel" "$i")")"; done > "$work/$wheel"
  fi
  echo "$sha  $work/$wheel" | sha256sum --check --status || {{ echo "install.sh: $wheel joined from its parts is corrupted" >&2; exit 1; }}
done <<< "$wheels"
echo "install.sh: {count} wheels checked; installing"
"$python" -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir --upgrade ${{target:+--target "$target"}} "$work"/*.whl
check_requirements || echo "install.sh: installed; the requirements above are not met on this machine"
'''


def install_script(title: str, parts: list[Part], wheels: list[tuple[str, str, int]], requirements: dict[str, str]) -> str:
    """install.sh's text. wheels: (sha256, file name, piece count: 0 for a wheel that is its own part)."""
    for name in [p.name for p in parts] + [w for _, w, _ in wheels]:
        if shlex.quote(name) != name:  # the tables are read word by word
            raise ValueError(f"a file name install.sh cannot carry: {name!r}")
    return TEMPLATE.format(
        title=title,
        requirements="\n".join(f"{name}\t{spec}" for name, spec in sorted(requirements.items())),
        parts="\n".join(f"{p.sha256} {p.name}" for p in sorted(parts, key=lambda p: p.name)),
        wheels="\n".join(f"{sha} {name} {pieces}" for sha, name, pieces in sorted(wheels, key=lambda w: w[1])),
        count=len(wheels))


def write_install_script(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(0o755)
    return path
