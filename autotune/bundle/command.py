"""`autotune bundle`: an engine release and the wheels an offline machine lacks for it, as a folder:

    DIR/wheels/        the wheels (from PyPI, each checked against the sha256 it publishes)
    DIR/parts/NN/      the same as parts of at most --part-size, grouped into batches of at most that size:
                       a wheel that fits is its own part, a larger one is cut into WHEEL.partNNN
    DIR/install.sh     checks every part's sha256, joins the wheels, pip-installs them (no index, no deps)
    DIR/manifest.json  what was picked and why, what the machine already has, what was dropped and why

Run as `python3 -m autotune.bundle.command --engine sglang ...` or through the CLI once registered there.
"""
import json
import shutil
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Annotated

import typer

from autotune.bundle.download import fetch_all
from autotune.bundle.index import Index, IndexError_
from autotune.bundle.resolve import Resolution, ResolveError, Resolver
from autotune.bundle.script import install_script, write_install_script
from autotune.bundle.split import Part, batches, parse_size, split_file
from autotune.bundle.target import Target, read_freeze
from autotune.engines import get_adapter


@dataclass(frozen=True)
class Kept:
    name: str
    version: str
    filename: str
    size: int
    sha256: str
    why: list[str]  # the requirements that named it
    replaces: str | None  # the version the target has, which does not meet them


def _version_pair(option: str, text: str) -> tuple[int, int]:
    major, _, minor = text.partition(".")
    if not (major.isdigit() and minor.split(".")[0].isdigit()):
        raise ValueError(f"{option} {text!r}: not a version like 2.35")
    return int(major), int(minor.split(".")[0])


def manifest(res: Resolution, target: Target, drops: dict[str, str], parts: list[list[Part]], args: dict) -> dict:
    engine = Kept(res.engine.name, str(res.engine.version), res.engine.filename, res.engine.size, res.engine.sha256,
                  ["the engine release: its torch pin holds the target's torch"], None)
    kept = [engine] + [Kept(n, str(p.wheel.version), p.wheel.filename, p.wheel.size, p.wheel.sha256,
                            list(p.required_by), p.replaces) for n, p in sorted(res.picks.items())]
    return {
        "made": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "arguments": args,
        "target": {"python": target.python, "machine": target.machine, "glibc": ".".join(map(str, target.glibc)),
                   "installed_packages": len(target.installed)},
        "engine": {"name": res.engine.name, "version": str(res.engine.version)},
        "wheels": [asdict(k) for k in kept],
        "total_bytes": sum(k.size for k in kept),
        "parts": [[asdict(p) for p in batch] for batch in parts],
        "present": res.present,
        "left_to_target": res.unchecked,
        "dropped": [{"name": n, "why": drops[n], "named_by": list(by)} for n, by in sorted(res.dropped.items())],
    }


def bundle(
    engine: Annotated[str, typer.Option(help="engine whose release to bundle (its PyPI name)")],
    torch: Annotated[str, typer.Option(help="the target's torch version, e.g. 2.11.0 (a +cuXXX label is ignored)")],
    cuda: Annotated[int, typer.Option(help="the target's CUDA major version, e.g. 13")],
    target_freeze: Annotated[Path, typer.Option(help="the target's `pip freeze` (a bare name: installed, version "
                                                     "unknown)")],
    out: Annotated[Path, typer.Option(help="folder to write the bundle into (wheels already there are kept)")],
    python: Annotated[str, typer.Option(help="the target's Python, e.g. 3.12 or 3.12.3")] = "3.12",
    part_size: Annotated[str, typer.Option(help="largest part and batch: what one transfer carries")] = "40M",
    glibc: Annotated[str, typer.Option(help="the target's glibc (wheels for a newer one are not picked)")] = "2.35",
    machine: Annotated[str, typer.Option(help="the target's machine (platform_machine)")] = "x86_64",
) -> None:
    """Bundle an engine release that matches the target's torch and CUDA, with the wheels it lacks, for an
    offline install: wheels, parts of --part-size, install.sh with checksums, manifest.json."""
    try:
        limit = parse_size(part_size)
        installed = read_freeze(target_freeze)
        _version_pair("--python", python)
        target = Target(python, machine, _version_pair("--glibc", glibc), installed)
        drops = get_adapter(engine).bundle_drops(cuda)
        resolver = Resolver(Index(), target, drops)
        res = resolver.resolve(resolver.engine_release(engine, torch.split("+")[0], cuda))
    except (OSError, ValueError, IndexError_, ResolveError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    wheels = [res.engine] + [p.wheel for p in res.picks.values()]
    typer.echo(f"{engine} {res.engine.version}: {len(wheels)} wheels the target lacks, "
               f"{sum(w.size for w in wheels) / 1e6:.0f} MB; fetching into {out / 'wheels'}")
    try:
        paths = fetch_all(wheels, out / "wheels")
    except (OSError, ValueError, IndexError_) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(1) from None
    for stale in (out / "parts", out / "pieces"):
        shutil.rmtree(stale, ignore_errors=True)
    parts = [part for path in paths for part in split_file(path, limit, out / "pieces")]
    grouped = batches(parts, limit)
    for number, batch in enumerate(grouped):
        folder = out / "parts" / f"{number:02d}"
        folder.mkdir(parents=True)
        for part in batch:
            (out / "pieces" / part.name).replace(folder / part.name)
    shutil.rmtree(out / "pieces")
    pieces = {}
    for part in parts:
        pieces[part.wheel] = pieces.get(part.wheel, 0) + (part.name != part.wheel)
    title = f"install.sh: {engine} {res.engine.version} and the {len(wheels) - 1} wheels it needs that the target lacks"
    write_install_script(out / "install.sh", install_script(
        title, parts, [(w.sha256, w.filename, pieces[w.filename]) for w in wheels], res.unchecked))
    args = {"engine": engine, "python": python, "torch": torch, "cuda": cuda, "target_freeze": str(target_freeze),
            "part_size": part_size, "glibc": glibc, "machine": machine}
    (out / "manifest.json").write_text(json.dumps(manifest(res, target, drops, grouped, args), indent=1) + "\n")
    typer.echo(f"{len(parts)} parts in {len(grouped)} batches of at most {part_size} ({out / 'parts'}); "
               f"dropped {len(res.dropped)}: {', '.join(sorted(res.dropped)) or 'none'}; "
               f"left to the target {len(res.unchecked)}; {out / 'install.sh'}")


if __name__ == "__main__":
    typer.run(bundle)
