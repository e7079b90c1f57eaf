"""`autotune bundle`: an engine release and the wheels an offline machine lacks for it, as a folder:

    DIR/wheels/        the wheels (from PyPI, each checked against the sha256 it publishes)
    DIR/packed/        large wheels stored and zstd-compressed for the trip where that pays (WHEEL.zst, pack.py)
    DIR/parts/NN/      the files to carry as parts of at most --part-size, grouped into batches of at most that
                       size: a file that fits is its own part, a larger one is cut into FILE.partNNN
    DIR/install.sh     checks every part's sha256, joins and decompresses the wheels, checks them again,
                       pip-installs them (no index, no deps)
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
from packaging.specifiers import SpecifierSet

from autotune.bundle.download import fetch_all, sha256_of
from autotune.bundle.index import Index, IndexError_
from autotune.bundle.pack import Packed, pack
from autotune.bundle.resolve import Resolution, ResolveError, Resolver
from autotune.bundle.script import Carried, install_script, write_install_script
from autotune.bundle.split import Part, batches, parse_size, split_file
from autotune.bundle.target import Target, read_freeze

PACK_FROM = 4 << 20  # smaller wheels travel as they are: packing saves them little for the time it takes


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


def lay_out(out: Path, wheels: list[Path], packed: dict[str, Packed], helpers: list[Path],
            limit: int) -> tuple[list[Part], list[list[Part]], list[Carried]]:
    """What travels, in out/parts/NN/: each wheel (or its packed form) and each helper as parts, grouped into
    batches of at most `limit`; and install.sh's row for each wheel, then each helper."""
    carried = {path.name: packed[path.name].path if path.name in packed else path for path in [*wheels, *helpers]}
    parts = [part for path in carried.values() for part in split_file(path, limit, out / "pieces")]
    grouped = batches(parts, limit)
    for number, batch in enumerate(grouped):
        folder = out / "parts" / f"{number:02d}"
        folder.mkdir(parents=True)
        for part in batch:
            (out / "pieces" / part.name).replace(folder / part.name)
    shutil.rmtree(out / "pieces")
    pieces: dict[str, int] = {}
    for part in parts:
        pieces[part.wheel] = pieces.get(part.wheel, 0) + (part.name != part.wheel)
    rows = [Carried(packed[path.name].stored_sha256 if path.name in packed else sha256_of(path), path.name,
                    carried[path.name].name, pieces[carried[path.name].name]) for path in [*wheels, *helpers]]
    return parts, grouped, rows


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
    compress: Annotated[bool, typer.Option(help="carry large wheels stored and zstd-compressed where that saves "
                                                "at least 15% (install.sh decompresses them)")] = True,
) -> None:
    """Bundle an engine release that matches the target's torch and CUDA, with the wheels it lacks, for an
    offline install: wheels, parts of --part-size, install.sh with checksums, manifest.json."""
    from autotune.engines import get_adapter  # here: every CLI start (a server's too) paid 0.7 s for it

    try:
        limit = parse_size(part_size)
        installed = read_freeze(target_freeze)
        _version_pair("--python", python)
        target = Target(python, machine, _version_pair("--glibc", glibc), installed)
        adapter = get_adapter(engine)
        drops, adds = adapter.bundle_drops(cuda), adapter.bundle_adds()
        resolver = Resolver(Index(), target, drops, adds)
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
    for stale in (out / "parts", out / "pieces", out / "packed"):
        shutil.rmtree(stale, ignore_errors=True)
    packed = {path.name: found for path in paths if compress and path.stat().st_size >= PACK_FROM
              if (found := pack(path, out / "packed"))}
    helpers = []  # a zstandard wheel install.sh decompresses with where the machine has no zstd
    zstd = next((path for path in paths if path.name.startswith("zstandard-")), None)
    if packed and zstd is None:
        zstd_wheel = resolver.best_wheel("zstandard", SpecifierSet())
        if zstd_wheel is None:
            typer.echo("error: no zstandard wheel for the target: run again with --no-compress", err=True)
            raise typer.Exit(1)
        zstd = fetch_all([zstd_wheel], out / "wheels")[0]
        helpers = [zstd]
    parts, grouped, rows = lay_out(out, paths, packed, helpers, limit)
    title = f"install.sh: {engine} {res.engine.version} and the {len(wheels) - 1} wheels it needs that the target lacks"
    by_name = {row.wheel: row for row in rows}
    write_install_script(out / "install.sh", install_script(title, parts, rows[:len(wheels)], res.unchecked,
                                                            by_name[zstd.name] if packed else None))
    args = {"engine": engine, "python": python, "torch": torch, "cuda": cuda, "target_freeze": str(target_freeze),
            "part_size": part_size, "glibc": glibc, "machine": machine, "compress": compress}
    record = manifest(res, target, drops, grouped, args)
    record["packed"] = {name: {"carried": p.path.name, "bytes": p.path.stat().st_size,
                               "stored_sha256": p.stored_sha256} for name, p in sorted(packed.items())}
    record["carried_bytes"] = sum(p.size for p in parts)
    record["added"] = [{"requirement": r, "why": why} for r, why in sorted(adds.items())]
    (out / "manifest.json").write_text(json.dumps(record, indent=1) + "\n")
    typer.echo(f"{len(packed)} wheels packed: {sum(w.size for w in wheels) / 1e6:.0f} MB travel as "
               f"{record['carried_bytes'] / 1e6:.0f} MB")
    typer.echo(f"{len(parts)} parts in {len(grouped)} batches of at most {part_size} ({out / 'parts'}); "
               f"dropped {len(res.dropped)}: {', '.join(sorted(res.dropped)) or 'none'}; "
               f"left to the target {len(res.unchecked)}; {out / 'install.sh'}")


if __name__ == "__main__":
    typer.run(bundle)
