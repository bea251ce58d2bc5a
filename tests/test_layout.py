"""The layout's rules, checked from the source: which module may import which.

The tree shows the two processes (frontend/ runs in the API process, engine/ in an
engine process, wire/ is what crosses), and dependencies point down the request's
journey. These tests read every module's imports with `ast`, without importing
anything, so a rule broken by a new import fails here, named.
"""

import ast
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "tinyserve"
MAX_LINES = 300  # STYLE: a file past this is asking to be split
HARD_MAX_LINES = 400  # ... and one that gives its reason may reach this
LONG_MODULE_REASON = "over 300 lines because"  # the phrase its docstring must contain


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def imports(name: str, *, top_level_only: bool = False) -> set[str]:
    """The modules `name` imports (absolute names; `from a import b` counts a.b when that is a module)."""
    tree = ast.parse(MODULES[name].read_text(encoding="utf-8"))
    nodes = tree.body if top_level_only else ast.walk(tree)
    found = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module is not None and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names
                         if f"{node.module}.{alias.name}" in MODULES)
    return found


def tinyserve_imports(name: str, **kwargs) -> set[str]:
    return {m for m in imports(name, **kwargs) if m == "tinyserve" or m.startswith("tinyserve.")}


def closure(name: str) -> set[str]:
    """Every tinyserve module that importing `name` runs, following module-level imports."""
    seen, todo = set(), [name]
    while todo:
        current = todo.pop()
        if current in seen or current not in MODULES:
            continue
        seen.add(current)
        todo += tinyserve_imports(current, top_level_only=True)
    return seen


def in_package(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


@pytest.mark.parametrize("package", ["tinyserve.lifecycle", "tinyserve.kernels"])
def test_lifecycle_and_kernels_import_nothing_else_of_tinyserve(package):
    offenders = {name: sorted(m for m in tinyserve_imports(name) if not in_package(m, package))
                 for name in MODULES if in_package(name, package)}
    assert {name: bad for name, bad in offenders.items() if bad} == {}


def test_trace_reading_imports_only_the_lifecycle_of_tinyserve():
    """Reading a run back needs the record's schema and nothing of the server: replay is handed its engine."""
    allowed = ("tinyserve.trace_reading", "tinyserve.lifecycle")
    reading = [name for name in MODULES if in_package(name, "tinyserve.trace_reading")]
    offenders = {name: sorted(m for m in tinyserve_imports(name) if not any(in_package(m, p) for p in allowed))
                 for name in reading}
    assert reading and {name: bad for name, bad in offenders.items() if bad} == {}


@pytest.mark.parametrize("name", ["tinyserve.engine.core.scheduler", "tinyserve.engine.core.kv_cache_manager",
                                  "tinyserve.engine.core.block_pool"])
def test_scheduler_and_kv_cache_import_no_torch_numpy_or_zmq(name):
    third_party = {m.split(".")[0] for module in closure(name) for m in imports(module, top_level_only=True)}
    assert third_party & {"torch", "numpy", "zmq"} == set()


def test_the_worker_imports_nothing_of_the_schedulers_request_state():
    worker = [name for name in MODULES if in_package(name, "tinyserve.engine.worker")]
    forbidden = ("tinyserve.engine.core.request", "tinyserve.engine.core.scheduler")
    offenders = {name: sorted(m for m in tinyserve_imports(name) if m in forbidden) for name in worker}
    assert worker and {name: bad for name, bad in offenders.items() if bad} == {}


def test_execute_model_takes_the_scheduler_output_and_nothing_else():
    tree = ast.parse(MODULES["tinyserve.engine.worker.model_runner"].read_text(encoding="utf-8"))
    [execute] = [node for node in ast.walk(tree) if isinstance(node, ast.FunctionDef) and node.name == "execute_model"]
    arguments = execute.args
    names = [a.arg for a in arguments.posonlyargs + arguments.args + arguments.kwonlyargs]
    assert names == ["self", "scheduler_output"] and arguments.vararg is None and arguments.kwarg is None
    assert ast.unparse(arguments.args[1].annotation) == "SchedulerOutput"


def test_the_module_defining_llm_imports_neither_engine_core_nor_the_scheduler():
    direct = tinyserve_imports("tinyserve.entrypoints.llm")
    assert not {m for m in direct if in_package(m, "tinyserve.engine")}


def test_the_front_end_and_the_engine_live_in_separate_folders():
    def folder_defining(class_name: str) -> pathlib.Path:
        [path] = [path for path in MODULES.values()
                  if re.search(rf"^class {class_name}\b", path.read_text(encoding="utf-8"), re.MULTILINE)]
        return path.parent

    front_end, engine = folder_defining("AsyncLLM"), folder_defining("EngineCore")
    assert front_end != engine and front_end not in engine.parents and engine not in front_end.parents


def test_the_wire_imports_neither_side():
    wire = [name for name in MODULES if in_package(name, "tinyserve.wire")]
    sides = ("tinyserve.frontend", "tinyserve.engine", "tinyserve.entrypoints")
    assert wire and not {m for name in wire for m in tinyserve_imports(name) if m.startswith(sides)}


@pytest.mark.parametrize(("lower", "upper"), [("tinyserve.engine", "tinyserve.frontend"),
                                               ("tinyserve.frontend", "tinyserve.entrypoints")])
def test_arrows_point_one_way_at_any_depth(lower, upper):
    """The engine knows nothing of the front end, and the front end nothing of the HTTP layer above it,
    counting imports inside functions too."""
    offenders = {name: sorted(m for m in tinyserve_imports(name) if in_package(m, upper))
                 for name in MODULES if in_package(name, lower)}
    assert {name: bad for name, bad in offenders.items() if bad} == {}


MAX_FUNCTION_LINES = 60  # STYLE: a longer function is two ideas; name the halves
FUNCTION_RULE_PACKAGES = ("tinyserve.engine", "tinyserve.frontend", "tinyserve.wire", "tinyserve.models",
                          "tinyserve.entrypoints.api")


def test_no_function_in_the_lifecycles_packages_is_over_60_lines():
    """engine/, frontend/, wire/, models/ and the HTTP layer (entrypoints/api/) are read function by function
    (docs/reading_path.md)."""
    too_long = {}
    for name, path in MODULES.items():
        if not name.startswith(FUNCTION_RULE_PACKAGES):
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    too_long[f"{name}:{node.name}"] = length
    assert too_long == {}


def test_no_import_cycles_at_any_depth():
    """Imports inside functions count too: a cycle there is a circle a reader walks just the same."""
    graph = {name: {m for m in tinyserve_imports(name) if m in MODULES and m != name} for name in MODULES}
    # A package's __init__ is run by importing any module below it; only real imports count here.
    state, cycles = {}, []

    def visit(name: str, path: list[str]) -> None:
        state[name] = "open"
        for target in sorted(graph[name]):
            if state.get(target) == "open":
                cycles.append(path[path.index(target):] + [target] if target in path else [name, target])
            elif target not in state:
                visit(target, path + [target])
        state[name] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert cycles == []


def test_no_module_is_long_without_saying_why():
    too_long = {}
    for name, path in MODULES.items():
        num_lines = len(path.read_text(encoding="utf-8").splitlines())
        docstring = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
        if num_lines > HARD_MAX_LINES or (num_lines > MAX_LINES and LONG_MODULE_REASON not in docstring):
            too_long[name] = num_lines
    assert too_long == {}


def test_every_package_caption_says_where_it_runs():
    captions = {name: ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
                for name, path in MODULES.items() if path.name == "__init__.py"}
    for name in ("tinyserve.frontend", "tinyserve.engine", "tinyserve.engine.core", "tinyserve.engine.worker"):
        assert "process" in captions[name], name


LIFECYCLE_FUNCTIONS = [
    ("tinyserve.engine.engine_core", "EngineCore.step"),
    ("tinyserve.engine.core.scheduler", "Scheduler.schedule"),
    ("tinyserve.engine.worker.model_runner", "ModelRunner.execute_model"),
    ("tinyserve.engine.worker.tensor_parallel_workers", "TensorParallelRunner.execute_model"),
    ("tinyserve.frontend.output_processor", "OutputProcessor.process_outputs"),
]


@pytest.mark.parametrize(("module", "qualname"), LIFECYCLE_FUNCTIONS, ids=[q for _, q in LIFECYCLE_FUNCTIONS])
def test_lifecycle_functions_read_no_clock_and_touch_no_span_outside_one_with(module, qualname):
    """Instrumentation sits behind one `with` (the step recorder, a spans object's clock); the body
    itself is the lifecycle: no time.* call, no span, and at most one `with` at its top level."""
    class_name, name = qualname.split(".")
    tree = ast.parse(MODULES[module].read_text(encoding="utf-8"))
    [cls] = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == class_name]
    [function] = [n for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name]
    body = ast.Module(body=function.body[1:] if ast.get_docstring(function) else function.body, type_ignores=[])
    clocks = [ast.unparse(n) for n in ast.walk(body)
              if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "time"]
    spans = sorted({n.id if isinstance(n, ast.Name) else n.attr for n in ast.walk(body)
                    if isinstance(n, (ast.Name, ast.Attribute)) and "span" in (n.id if isinstance(n, ast.Name) else n.attr)})
    withs = [n for n in body.body if isinstance(n, (ast.With, ast.AsyncWith))]
    assert (clocks, spans, len(withs) <= 1) == ([], [], True)


# The layers: capabilities beside the core, each a package with one EngineLayer in its layer.py
# (engine/layers.py), put together at one assembly point (tinyserve/assemble.py).
LAYER_PACKAGES = ("tinyserve.spec_decode", "tinyserve.pipeline_parallel", "tinyserve.distributed", "tinyserve.lora",
                  "tinyserve.kv_events", "tinyserve.reasoning", "tinyserve.multimodal")
CORE = [name for name in MODULES if in_package(name, "tinyserve.engine") or name == "tinyserve.config"]


def in_a_layer(name: str) -> bool:
    return any(in_package(name, package) for package in LAYER_PACKAGES)


def test_the_engine_and_its_arguments_import_no_layer():
    """The core never knows its layers, at any depth (imports inside functions count): the assembly
    point hands the engine what each layer adds."""
    offenders = {name: sorted(m for m in tinyserve_imports(name) if in_a_layer(m))
                 for name in CORE}
    assert CORE and {name: bad for name, bad in offenders.items() if bad} == {}


def test_every_layer_says_what_it_adds_in_one_layer_module_that_the_assembly_lists():
    assembly = tinyserve_imports("tinyserve.assemble", top_level_only=True)
    layer_modules = sorted(name for name in MODULES if name.endswith(".layer") and in_a_layer(name))
    assert layer_modules and set(layer_modules) <= assembly
    assert not any(name.endswith(".attach") for name in MODULES)


# What a layer must not assign to: another object's engine, scheduler, runner, recorder or KV cache.
ENGINE_PARTS = {"engine", "engine_core", "scheduler", "model_runner", "runner", "recorder", "kv_cache_manager", "pool"}


def _assigned_through(target: ast.expr) -> list[str]:
    """The names an attribute assignment reaches its object through: `engine.scheduler.x = ...` -> engine, scheduler."""
    names, node = [], target.value
    while isinstance(node, ast.Attribute):
        names.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        names.append(node.id)
    return names[::-1]


def test_no_layer_assigns_to_the_engine_or_its_parts():
    """A layer's seams are constructor arguments and named hook lists, never an attribute set afterwards
    (`engine.step_fn = ...`, `engine.scheduler.x = ...`, `self.runner.y = ...`)."""
    offenders = []
    for name, path in MODULES.items():
        if not in_a_layer(name):
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            targets = node.targets if isinstance(node, ast.Assign) else \
                [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
            for target in targets:
                if isinstance(target, ast.Attribute) and ENGINE_PARTS & set(_assigned_through(target)):
                    offenders.append(f"{name}:{node.lineno} {ast.unparse(target)}")
    assert offenders == []


def test_no_function_on_the_reading_path_takes_spans():
    """Lifecycle functions record what happened on an observer found by request id (frontend/request_observers.py)
    or on the step's record; none is handed a spans object to thread through."""
    from tests.test_reading_path import definition, entries

    taking_spans = []
    for path, qualname, _ in entries():
        function = definition(path, qualname)
        arguments = function.args
        names = [a.arg for a in arguments.posonlyargs + arguments.args + arguments.kwonlyargs]
        if "spans" in names:
            taking_spans.append(f"{path}:{qualname}")
    assert entries() and taking_spans == []
