"""Only what pyproject.toml cannot say: `patches/` (top of the repo) ships as `megatron_tail.patches`."""

from setuptools import find_packages, setup

setup(
    packages=[*find_packages(include=["megatron_tail", "megatron_tail.*"]), "megatron_tail.patches"],
    package_dir={"megatron_tail.patches": "patches"},
)
