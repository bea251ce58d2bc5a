"""Training text that ships with Python itself.

The built-in default model and the tests' tiny tokenizers are trained offline, so their
text has to come from files already on the machine. Python's standard library is such a
source: its docstrings are English prose about programming, and `this.py` holds the Zen
of Python. Everything here reads the source files of the running interpreter — nothing is
imported for its side effects and nothing is downloaded.

The text depends on the Python version (docstrings change between releases), so a
tokenizer or model trained on it is reproducible for a given Python install, not across
all of them.
"""

import ast
import codecs
import importlib.util
from collections.abc import Iterable
from pathlib import Path


def _module_source(module_name: str) -> str:
    # find_spec locates a top-level module's file without executing it (importing `this`
    # would print the Zen to stdout).
    spec = importlib.util.find_spec(module_name)
    if spec is None or spec.origin is None or not spec.origin.endswith(".py"):
        raise ValueError(f"module_name {module_name!r} is not a pure-Python stdlib module")
    return Path(spec.origin).read_text(encoding="utf-8")


def zen_of_python() -> list[str]:
    """The Zen of Python, one aphorism per item (title line first).

    `this.py` stores it ROT13-encoded in the string `s`; it is read from the file's syntax
    tree rather than by importing the module.
    """
    tree = ast.parse(_module_source("this"))
    for node in tree.body:
        if isinstance(node, ast.Assign) and [t.id for t in node.targets if isinstance(t, ast.Name)] == ["s"]:
            text = codecs.decode(ast.literal_eval(node.value), "rot13")
            return [line for line in text.splitlines() if line.strip()]
    raise ValueError("this.py has no string `s` holding the Zen of Python")


def stdlib_docstrings(module_names: Iterable[str]) -> list[str]:
    """Every docstring (module, classes, functions) of the named stdlib modules, module
    by module, each module's in the fixed breadth-first order of `ast.walk`."""
    docstrings = []
    for module_name in module_names:
        tree = ast.parse(_module_source(module_name))
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                docstring = ast.get_docstring(node)
                if docstring:
                    docstrings.append(docstring)
    return docstrings
