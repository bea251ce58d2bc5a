"""docs/reading_path.md: every entry is a real function, and the whole path stays readable in an afternoon."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PATH_DOC = ROOT / "docs" / "reading_path.md"
BUDGET_LINES = 2000
ENTRY = re.compile(r"^\d+\. `(tinyserve/[\w/]+\.py):([\w.]+)` — (.+)$", re.MULTILINE)
# vLLM's lifecycle names, each of which the path must pass through.
LIFECYCLE = ["serving_chat.py:create_chat_completion", "input_processor.py:InputProcessor.make_requests",
             "AsyncLLM.generate", "AsyncLLM.add_request", "EngineCore.step", "Scheduler.schedule",
             "ModelRunner.execute_model", "OutputProcessor.process_outputs"]


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


def test_every_entry_is_a_function_that_exists_with_a_sentence_on_it():
    found = entries()
    assert len(found) >= 20
    missing = [f"{path}:{name}" for path, name, _ in found if definition(path, name) is None]
    assert missing == []
    assert all(sentence.rstrip().endswith(".") for _, _, sentence in found)


def test_the_path_is_within_its_budget_and_passes_through_vllms_lifecycle_names():
    found = entries()
    total = sum(node.end_lineno - node.lineno + 1 for node in (definition(p, n) for p, n, _ in found))
    assert total <= BUDGET_LINES
    named = [f"{path}:{name}" for path, name, _ in found]
    assert [name for name in LIFECYCLE if not any(entry.endswith(name) for entry in named)] == []


def test_the_readme_and_the_design_document_link_the_path():
    assert "docs/reading_path.md" in (ROOT / "README.md").read_text(encoding="utf-8")
    assert "reading_path.md" in (ROOT / "docs" / "design.md").read_text(encoding="utf-8")
