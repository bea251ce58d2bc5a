"""The Pythons tinyserve supports, and the interpreters of them found on this machine.

    supported_versions()   ["3.10", ..., "3.13"]: the classifiers of pyproject.toml
    find_pythons()         {"3.10": "/path/to/python3.10", ...}: the running one and every other found

Tests that must hold under every supported Python (the sources compile, the built-in
model builds alike) run code under each interpreter found here. One is looked for as
`python3.X` on PATH, then under `pyenv root`; a name that does not run as that version
is passed over (a pyenv shim of a version that is not selected fails when it is run).
The release after the newest supported one is looked for too, so a break in it shows
before it is promised.
"""

import functools
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
THIS_PYTHON = f"{sys.version_info.major}.{sys.version_info.minor}"


def supported_versions() -> list[str]:
    """The "Programming Language :: Python :: 3.X" classifiers, oldest first."""
    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    return sorted(re.findall(r'"Programming Language :: Python :: (3\.\d+)"', text), key=_minor)


@functools.cache
def find_pythons() -> dict[str, str]:
    """One interpreter per supported version found, plus the next release's, oldest first."""
    newest = supported_versions()[-1]
    wanted = [*supported_versions(), f"3.{_minor(newest) + 1}"]
    found = {THIS_PYTHON: sys.executable}
    for version in wanted:
        if version not in found:
            runnable = (path for path in _candidates(version) if _runs_as(path, version))
            if path := next(runnable, None):
                found[version] = path
    return dict(sorted(found.items(), key=lambda item: _minor(item[0])))


def has_modules(python: str, modules: list[str]) -> bool:
    """Whether `python` can import every one of `modules` (looked up, not imported: that is fast)."""
    check = f"import importlib.util, sys; sys.exit(any(importlib.util.find_spec(m) is None for m in {modules!r}))"
    return subprocess.run([python, "-c", check], capture_output=True).returncode == 0


def _candidates(version: str) -> list[str]:
    name = f"python{version}"
    on_path = [path] if (path := shutil.which(name)) else []
    pyenv = shutil.which("pyenv")
    if pyenv is None:
        return on_path
    root = subprocess.run([pyenv, "root"], capture_output=True, text=True).stdout.strip()
    # Newest patch release first: "3.12.10" sorts after "3.12.9".
    installed = sorted(Path(root).glob(f"versions/{version}.*/bin/{name}"), key=lambda p: _patch(p.parents[1].name))
    return on_path + [str(path) for path in reversed(installed)]


def _runs_as(python: str, version: str) -> bool:
    check = "import sys; print('%d.%d' % sys.version_info[:2])"
    try:
        result = subprocess.run([python, "-c", check], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return result.returncode == 0 and result.stdout.strip() == version


def _minor(version: str) -> int:
    return int(version.split(".")[1])


def _patch(release: str) -> tuple:
    return tuple(int(part) if part.isdigit() else -1 for part in release.split("."))
