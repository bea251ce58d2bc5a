"""What a test needs from the machine beyond pip's packages: a missing one skips it, except in CI.

CI (CI=true) installs every such tool (.ci/run) and must run every test, so there
a missing tool fails the test instead of letting it pass by skipping.
"""

import os
import shutil
from typing import NoReturn

import pytest


def missing(message: str) -> NoReturn:
    """Skip the test, or fail it under CI=true: CI must run it, not skip it."""
    if os.environ.get("CI") == "true":
        pytest.fail(message)
    pytest.skip(message)


def system_binary(name: str, debian_package: str) -> str:
    """The path of a program from a Debian package; also looked for in /usr/sbin, off a non-root PATH."""
    path = shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin")
    if path is None:
        missing(f"the {name} binary is not installed (Debian: apt-get install {debian_package})")
    return path
