"""Print the requirements an installed package states for this environment, one a line, less those named.

    python scripts/requirements_of.py tinyserve xgrammar      # tinyserve's own, all but xgrammar
    python scripts/requirements_of.py xgrammar triton         # xgrammar's, all but triton

scripts/setup.sh installs the serve set with it. xgrammar asks for triton on every Linux x86_64
machine, for its CUDA kernels; on a CPU it never loads it, and triton is about 1 GB. So xgrammar
is installed without its requirements, and then those requirements less triton (torch's CUDA
build brings the triton it was built with; `make test` installs it for Triton's interpreter).
Markers are evaluated for this Python and platform, and the requirements of extras left out.
"""

import sys
from importlib.metadata import requires

try:
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name
except ImportError:  # a fresh environment: pip's own copy
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.utils import canonicalize_name


def requirements_of(package: str, excluded: set[str]) -> list[str]:
    wanted = []
    for line in requires(package) or []:
        requirement = Requirement(line)
        if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
            continue  # another platform's, or an extra's
        if canonicalize_name(requirement.name) in excluded:
            continue
        requirement.marker = None
        wanted.append(str(requirement))
    return wanted


if __name__ == "__main__":
    package, *names = sys.argv[1:]
    print("\n".join(requirements_of(package, {canonicalize_name(name) for name in names})))
