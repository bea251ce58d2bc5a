"""Print the triton release that torch's CUDA build of a given version depends on, exactly.

    python scripts/torch_triton_pin.py 2.13.0      # -> 3.7.1

torch's CUDA wheels pin the one triton they were built with; the CPU build has no
triton at all, yet Triton's interpreter runs tinyserve's kernels on a CPU, and another
triton release would run them through another interpreter than the GPU's compiler. So
scripts/setup.sh installs the pinned one. The pin is read from the package index's
metadata of the CUDA wheel (`pip install --dry-run --report`, which downloads only the
metadata): `torch===X` asks for exactly that version, never a local build like X+cpu.
Exits with status 1, saying why, when there is no such pin.
"""

import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path


def triton_pin(torch_version: str) -> str:
    with tempfile.TemporaryDirectory() as folder:
        report = Path(folder) / "report.json"
        command = [sys.executable, "-m", "pip", "install", "--quiet", "--dry-run", "--no-deps", "--ignore-installed",
                   "--only-binary=:all:", "--report", str(report), f"torch==={torch_version}"]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"torch_triton_pin: pip could not find torch {torch_version}:\n{done.stderr}")
        [install] = json.loads(report.read_text())["install"]
    for requirement in install["metadata"].get("requires_dist", []):
        if match := re.match(r"triton\s*==\s*([\w.]+)", requirement):
            return match.group(1)
    raise SystemExit(f"torch_triton_pin: torch {torch_version} for this platform pins no triton")


if __name__ == "__main__":
    print(triton_pin(sys.argv[1]))
