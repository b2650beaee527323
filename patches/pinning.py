"""Version pins: a patch refuses to run against an upstream version it was not verified on."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

MEGATRON_CORE_PIN = "0.16."
"""Every megatron-core patch here was verified against megatron-core 0.16.x (0.16.1 in CI)."""


class PatchVersionError(RuntimeError):
    """The installed upstream package is not the version a patch was verified against."""


def check_pinned(package: str = "megatron-core", prefix: str = MEGATRON_CORE_PIN) -> str:
    """Return the installed version of `package`; raise PatchVersionError unless it starts with `prefix`."""
    try:
        installed = version(package)
    except PackageNotFoundError as err:
        raise PatchVersionError(f"{package} is not installed; the patches are pinned to {prefix}x") from err
    if not installed.startswith(prefix):
        raise PatchVersionError(
            f"{package}=={installed} is installed but these patches were verified on {prefix}x; "
            "re-run tests/patches against the new version and update patches/README.md before using them"
        )
    return installed
