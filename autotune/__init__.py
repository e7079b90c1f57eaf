"""autotune: find, prove and hand over the fastest launch configuration of a speculative-decoding LLM server."""
import os
from importlib import metadata, resources
from pathlib import Path

# The source checkout around the package: its top-level folders are the source of truth for the shipped
# data, and tests and benchmarks read theirs here. In an install it is site-packages, with neither those
# folders nor a .git.
PROJECT_ROOT = Path(__file__).resolve().parent.parent


def _version() -> str:
    try:
        return metadata.version(__name__)
    except metadata.PackageNotFoundError:  # a checkout run in place, never installed (provenance: its commit)
        return "0+unknown"


__version__ = _version()


def package_path(*parts: str) -> Path:
    """A file or folder shipped inside the package (schemas, workloads, data/, kernels), as a path: pip
    installs wheels unpacked, so the package's resources are files."""
    return Path(str(resources.files(__name__).joinpath(*parts)))


def shipped_folder(name: str) -> Path:
    """A top-level data folder ("search_spaces", "hardware_profiles"): the built package's copy (setup.py maps
    the folder into it as autotune/<name>), else, running from the checkout or an editable install, the folder
    itself."""
    packaged = package_path(name)
    return packaged if packaged.is_dir() else PROJECT_ROOT / name


def cache_dir(*parts: str) -> Path:
    """Where builds, installs and parsed files are kept between runs: $AUTOTUNE_CACHE, else ~/.cache/autotune (the
    setup scripts use the same)."""
    return Path(os.environ.get("AUTOTUNE_CACHE") or Path.home() / ".cache" / "autotune", *parts)
