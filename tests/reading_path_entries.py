"""docs/reading_path.md read as data, and which of its functions a real server ran (a helper module, not tests).

`entries()` and `sections()` read the document; `definition()` finds an entry's function. `LineCoverage`
measures every Python process a server starts: coverage's own .pth (coverage 7) starts it in any process
that finds COVERAGE_PROCESS_START in its environment, the engine's included, and each process writes its
data as it exits, so the server must be stopped gracefully before `executed()` is read. `InProcessCoverage`
measures this process alone, while it is entered (coverage's Python API, its data kept in memory): what an
offline LLM runs. `never_ran` names the entries none of whose body lines ran.
"""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PATH_DOC = ROOT / "docs" / "reading_path.md"
ENTRY = re.compile(r"^\d+\. `(tinyserve/[\w/]+\.py):([\w.]+)` — (.+)$", re.MULTILINE)
BESIDE = "## Beside the path"  # the heading that ends the path proper


def entries() -> list[tuple[str, str, str]]:
    return ENTRY.findall(PATH_DOC.read_text(encoding="utf-8"))


def definition(path: str, qualname: str) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
    scope = ast.parse((ROOT / path).read_text(encoding="utf-8")).body
    *classes, name = qualname.split(".")
    for class_name in classes:
        found = [n for n in scope if isinstance(n, ast.ClassDef) and n.name == class_name]
        if not found:
            return None
        scope = found[0].body
    functions = [n for n in scope if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name]
    return functions[0] if functions else None


def sections() -> dict[str, list[str]]:
    """The entries ("file:Class.method") by section: "" for the path proper (all before BESIDE), then each
    later section by its heading."""
    found: dict[str, list[str]] = {"": []}
    current = ""
    for line in PATH_DOC.read_text(encoding="utf-8").splitlines():
        if line.startswith("## ") and (current or line.startswith(BESIDE)):
            current = line.removeprefix("## ")
            found[current] = []
        elif match := ENTRY.match(line):
            found[current].append(f"{match[1]}:{match[2]}")
    return found


def body_lines(entry: str) -> set[int]:
    """The lines of a function's body, its docstring left out: the lines that run only when it is called."""
    node = definition(*entry.split(":"))
    body = node.body[1:] if ast.get_docstring(node) is not None and len(node.body) > 1 else node.body
    return set(range(body[0].lineno, node.end_lineno + 1))


def never_ran(entries_: list[str], executed: dict[str, set[int]]) -> list[str]:
    return [entry for entry in entries_ if not body_lines(entry) & executed.get(str(ROOT / entry.split(":")[0]), set())]


class LineCoverage:
    """Line coverage of tinyserve/ in every process started with `env` in its environment."""

    def __init__(self, folder: Path) -> None:
        self.data = folder / "coverage"
        self.data.mkdir()
        self.rc = folder / "coveragerc"
        self.rc.write_text(f"[run]\nparallel = true\ndata_file = {self.data / '.coverage'}\n"
                           f"source = {ROOT / 'tinyserve'}\n", encoding="utf-8")
        self.env = {"COVERAGE_PROCESS_START": str(self.rc)}

    @property
    def num_processes(self) -> int:
        """How many processes have written their data (before executed() combines them)."""
        return len(list(self.data.iterdir()))

    def executed(self) -> dict[str, set[int]]:
        """Each measured file's executed lines, over every process."""
        import coverage

        measured = coverage.Coverage(config_file=str(self.rc))
        measured.combine()
        data = measured.get_data()
        return {path: set(data.lines(path)) for path in data.measured_files()}


class InProcessCoverage:
    """Line coverage of tinyserve/ in this process while entered: coverage's tracer, set on this thread and on
    every thread started inside, records each line run; the data stays in memory."""

    def __enter__(self) -> "InProcessCoverage":
        import coverage

        self.coverage = coverage.Coverage(source=[str(ROOT / "tinyserve")], data_file=None)
        self.coverage.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.coverage.stop()

    def executed(self) -> dict[str, set[int]]:
        data = self.coverage.get_data()
        return {path: set(data.lines(path)) for path in data.measured_files()}
