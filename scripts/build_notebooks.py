"""Execute the walkthrough notebooks top to bottom; save them with their outputs, or only check them.

    .venv/bin/python scripts/build_notebooks.py                 run every notebook, save its outputs in place
    .venv/bin/python scripts/build_notebooks.py --check         run every notebook, fail on any error, save nothing
    .venv/bin/python scripts/build_notebooks.py notebooks/03_kv_cache.ipynb

The outputs are committed so that the notebooks render on GitHub; this script is what
regenerates them, and tests/test_notebooks.py checks them with the same `execute`.
Each notebook runs in a fresh `python3` kernel of the interpreter running this script
(jupyter_client starts a kernelspec's "python" as sys.executable), with notebooks/ as
its working directory, like a reader's Jupyter would.
"""

import argparse
import os
import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK_DIR = ROOT / "notebooks"
TIMEOUT_S = 180  # per notebook: each must run top to bottom on a laptop CPU in well under that
KERNEL_ENV = {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def notebooks() -> list[Path]:
    """The walkthrough notebooks, in reading order."""
    return sorted(NOTEBOOK_DIR.glob("[0-9][0-9]_*.ipynb"))


def execute(path: Path, timeout_s: int = TIMEOUT_S) -> tuple[nbformat.NotebookNode, float]:
    """Run a notebook in a fresh kernel; raises nbclient's CellExecutionError on the first failing cell.

    Returns the executed notebook (the file on disk is not touched) and its wall time in seconds.
    """
    notebook = nbformat.read(path, as_version=4)
    # timeout is per cell for nbclient; the caller checks the notebook's total against its own limit
    client = NotebookClient(notebook, timeout=timeout_s, kernel_name="python3", record_timing=False,
                            resources={"metadata": {"path": str(path.parent)}})
    started = time.monotonic()
    client.execute(env={**os.environ, **KERNEL_ENV})
    return notebook, time.monotonic() - started


def image_outputs(notebook: nbformat.NotebookNode) -> int:
    """How many outputs of the notebook are PNG images."""
    return sum("image/png" in output.get("data", {}) for cell in notebook.cells if cell.cell_type == "code"
               for output in cell.outputs)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("paths", nargs="*", type=Path, help="notebooks to run (default: every notebooks/NN_*.ipynb)")
    parser.add_argument("--check", action="store_true", help="execute only: fail on an error, write nothing")
    args = parser.parse_args()
    failed = []
    for path in args.paths or notebooks():
        try:
            notebook, seconds = execute(path)
        except Exception as error:  # report every notebook, then fail
            print(f"FAILED {path}: {error}", file=sys.stderr)
            failed.append(path)
            continue
        if seconds > TIMEOUT_S:
            print(f"FAILED {path}: took {seconds:.0f} s, more than {TIMEOUT_S} s", file=sys.stderr)
            failed.append(path)
            continue
        if not args.check:
            nbformat.write(notebook, path)
        print(f"{'checked' if args.check else 'saved'} {path} in {seconds:.1f} s, {image_outputs(notebook)} images")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
