"""The project's import graph, read from the source (no import runs): no cycle among the project's
modules, counting imports inside functions too; and an import inside a function only defers
something heavy (a library that costs a second to import, or that a path never needs) that the
importing module would not load anyway. In-process, no Ray."""

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import REPO

PACKAGES = ("training", "tuning", "cluster", "bench")
# Libraries whose import a bad-input path, the config's checks or a process that never needs them
# should not pay for: each costs from a tenth of a second to seconds here (measured after `import
# torch` for torch's own parts: torch.distributed.checkpoint 1.0 s, ray.train 0.9 s beyond ray's 0.4).
HEAVY = ("torch", "torch.distributed.checkpoint", "torch.distributed.fsdp", "ray", "ray.train", "ray.tune", "ray.data",
         "mlflow", "mlflow.pytorch", "sklearn", "matplotlib", "pyspark", "onnx", "onnxruntime", "torchft",
         "transformers", "huggingface_hub", "peft", "safetensors", "boto3", "botocore", "optuna", "pandas",
         "pyarrow.dataset",
         "cloudsplaining", "parliament", "grpc",
         # optional dependencies, installed where they serve (the `gpu` extra; azure-identity for live Azure checks)
         "pynvml", "azure.identity", "vllm",
         # what only one kind of data needs (image data: Pillow)
         "PIL")


@dataclass(frozen=True)
class Import:
    module: str  # the importing module
    target: str  # what it imports (a module, or a package's submodule)
    line: int
    in_function: bool


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for package in PACKAGES for p in (REPO / package).rglob("*.py")}


def imports_of(name: str, path: Path, known: set[str]) -> list[Import]:
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []

    def visit(node, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inside = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                found.extend(Import(name, alias.name, child.lineno, in_function) for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    base = ".".join(package.split(".")[:len(package.split(".")) - child.level + 1]
                                    + ([base] if base else []))
                for alias in child.names:  # `from a import b` imports a.b when b is a module
                    sub = f"{base}.{alias.name}"
                    found.append(Import(name, sub if sub in known else base, child.lineno, in_function))
            elif isinstance(child, ast.If) and _is_type_checking(child.test):
                continue  # (imports for type annotations alone)
            visit(child, inside)

    visit(tree, False)
    return found


def _is_type_checking(test) -> bool:
    return isinstance(test, ast.Name) and test.id == "TYPE_CHECKING"


def project(target: str, known: set[str]) -> str | None:
    """The project module an import loads (its deepest known prefix), or None for a library."""
    parts = target.split(".")
    for end in range(len(parts), 0, -1):
        if ".".join(parts[:end]) in known:
            return ".".join(parts[:end])
    return None


def graph():
    found = modules()
    known = set(found)
    edges = {name: [i for i in imports_of(name, path, known)] for name, path in found.items()}
    return known, edges


def parents(name: str) -> list[str]:
    """A module's packages, whose __init__ runs when it is imported."""
    parts = name.split(".")
    return [".".join(parts[:end]) for end in range(1, len(parts))]


def top_level_closure(start: str, known: set[str], edges) -> tuple[set[str], set[str]]:
    """(project modules, third-party top-level imports) loaded when `start` is imported."""
    seen, libraries, stack = set(), set(), [start]
    while stack:
        name = stack.pop()
        if name in seen or name not in known:
            continue
        seen.add(name)
        stack.extend(p for p in parents(name) if p in known)
        for item in edges[name]:
            if item.in_function:
                continue
            local = project(item.target, known)
            if local is None:
                libraries.add(item.target)
            else:
                stack.append(local)
    return seen, libraries


def heavy_in(libraries: set[str]) -> set[str]:
    return {h for h in HEAVY for lib in libraries if lib == h or lib.startswith(h + ".")}


def cycles(known: set[str], edges) -> list[list[str]]:
    """Strongly connected components of more than one module (or a module importing itself)."""
    graph_ = {name: {project(i.target, known) for i in edges[name]} - {None} for name in known}
    index, low, on_stack, stack, result, counter = {}, {}, set(), [], [], [0]

    def strong(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph_[v]:
            if w == v:
                continue
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                result.append(sorted(component))

    import sys

    sys.setrecursionlimit(10_000)
    for v in sorted(known):
        if v not in index:
            strong(v)
    return result


def test_no_import_cycle_among_the_projects_modules():
    known, edges = graph()
    found = cycles(known, edges)
    assert not found, "import cycles (imports inside functions counted): " + "; ".join(" <-> ".join(c) for c in found)


def test_an_import_inside_a_function_defers_something_heavy():
    """`import x` inside a function is for keeping torch, Ray, MLflow and the like out of a process
    (or a bad-input path) that does not need them; anything else belongs at the top of the module."""
    known, edges = graph()
    closures = {}

    def closure(name):
        if name not in closures:
            closures[name] = top_level_closure(name, known, edges)
        return closures[name]

    needless = []
    for name in sorted(known):
        _, loaded = closure(name)
        have = heavy_in(loaded)
        for item in edges[name]:
            if not item.in_function:
                continue
            local = project(item.target, known)
            brings = heavy_in(closure(local)[1]) if local else heavy_in({item.target})
            if not brings - have:
                needless.append(f"{name}:{item.line} imports {item.target}")
    assert not needless, "imports inside functions that defer nothing heavy:\n  " + "\n  ".join(needless)


def test_an_import_inside_a_function_says_why():
    known, edges = graph()
    paths = modules()
    silent = []
    for name in sorted(known):
        lines = paths[name].read_text().splitlines()
        for item in edges[name]:
            before = lines[item.line - 2].strip() if item.line >= 2 else ""
            if item.in_function and "#" not in lines[item.line - 1] and not before.startswith("#"):
                silent.append(f"{name}:{item.line}: {lines[item.line - 1].strip()}")
    assert not silent, "imports inside functions without a comment saying why:\n  " + "\n  ".join(silent)


@pytest.mark.parametrize("package", ["training.config", "tuning.config", "cluster.config"])
def test_a_config_is_checked_without_torch_or_ray(package):
    known, edges = graph()
    _, loaded = top_level_closure(package, known, edges)
    assert not heavy_in(loaded) & {"torch", "ray", "mlflow"}, heavy_in(loaded)
