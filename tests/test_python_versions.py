"""Every Python that pyproject.toml promises can at least compile all of tinyserve.

A module that one release compiles and the next refuses breaks the server before any
test of it can run (3.13 refused a lone surrogate in a docstring that 3.11 accepted).
So every source file — the package, tests, benchmarks, scripts and the notebooks' code
cells — is compiled under each supported Python found on the machine (tests/pythons.py),
with warnings as errors: what one release warns about (an invalid escape sequence),
a later one refuses.
"""

import json
import os
import subprocess
import sys

import pytest
from IPython.core.inputtransformer2 import TransformerManager

from tests.pythons import ROOT, THIS_PYTHON, find_pythons, supported_versions

SOURCE_FOLDERS = ("tinyserve", "tests", "benchmarks", "scripts")
PYTHONS = find_pythons()


def source_files() -> list[str]:
    files = [path for folder in SOURCE_FOLDERS for path in sorted((ROOT / folder).rglob("*.py"))]
    return [str(path) for path in files + sorted(ROOT.glob("*.py"))]


def notebook_cells(folder) -> list[str]:
    """Each notebook code cell as a file of its own, its IPython syntax (%magics) turned into
    the Python that Jupyter runs for it."""
    paths = []
    for notebook in sorted((ROOT / "notebooks").glob("*.ipynb")):
        cells = [c for c in json.loads(notebook.read_text(encoding="utf-8"))["cells"] if c["cell_type"] == "code"]
        for number, cell in enumerate(cells, 1):
            path = folder / f"{notebook.stem}-cell-{number}.py"
            path.write_text(TransformerManager().transform_cell("".join(cell["source"])), encoding="utf-8")
            paths.append(str(path))
    return paths


def test_the_sources_and_notebook_cells_are_all_found(tmp_path):
    files = source_files()
    for folder in SOURCE_FOLDERS:
        assert any(f"{os.sep}{folder}{os.sep}" in path for path in files), folder
    assert len(notebook_cells(tmp_path)) >= 4 * 5


@pytest.mark.parametrize("version", PYTHONS)
def test_every_source_file_compiles_under_every_python_found(version, tmp_path):
    files = source_files() + notebook_cells(tmp_path)
    # Bytecode goes to a folder of the test's own, not into __pycache__ beside the sources.
    env = {**os.environ, "PYTHONPYCACHEPREFIX": str(tmp_path / "bytecode")}
    command = [PYTHONS[version], "-W", "error", "-m", "compileall", "-q", "-f", *files]
    result = subprocess.run(command, capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stdout + result.stderr


def test_this_python_is_a_supported_one():
    assert THIS_PYTHON in supported_versions(), sys.version


def test_requires_python_classifiers_and_readme_name_the_same_pythons():
    versions = supported_versions()
    minors = [int(version.split(".")[1]) for version in versions]
    assert minors == list(range(minors[0], minors[-1] + 1))  # no release skipped
    assert f'requires-python = ">={versions[0]}"' in (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    assert f"Python {versions[0]} to {versions[-1]}" in (ROOT / "README.md").read_text(encoding="utf-8")
