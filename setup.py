"""The top-level search_spaces/ and hardware_profiles/ stay where a user of the checkout edits them; a built
package carries them as autotune/search_spaces/ and autotune/hardware_profiles/ (autotune.shipped_folder reads
them there). Everything else about the package is in pyproject.toml."""
from setuptools import find_packages, setup

DATA_FOLDERS = ("search_spaces", "hardware_profiles")

setup(
    packages=find_packages(include=["autotune*"]) + [f"autotune.{folder}" for folder in DATA_FOLDERS],
    package_dir={f"autotune.{folder}": folder for folder in DATA_FOLDERS},
)
