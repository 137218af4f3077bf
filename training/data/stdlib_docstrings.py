"""Runs in the driver: `path: stdlib_docstrings/train` and `validation_path:
stdlib_docstrings/validation` of the `text` source, a text-classification table made from the
running Python's standard library, so an encoder can be trained with nothing downloaded: the
docstrings (module, class and function ones, at least MIN_CHARS long) of the .py files of a few of
its packages (their test folders left out), each row labelled with its package (`package`), as
JSON Lines files (`text`, `package`, `module`), one per package and split.

At most PER_MODULE rows of a module and PER_CLASS of a package (by a hash of each row), to keep
the classes near balance. Validation holds VALIDATION_SHARE of each package's rows in whole modules
(by a hash of their path): modules that training never saw, every class in about its share.
Deterministic: the same Python writes the same files; written once into the data cache, in a
folder named for the Python version and its stdlib folder.
"""

from __future__ import annotations

import ast
import hashlib
import json
import sys
import sysconfig
from collections import Counter
from pathlib import Path

from training import storage
from training.data.tokenizer import write_atomically

NAME = "stdlib_docstrings"
# Packages of the standard library that every Python from 3.10 on has, with hundreds of docstrings each.
PACKAGES = ("asyncio", "email", "idlelib", "importlib", "logging", "tkinter")
PER_CLASS = 400
PER_MODULE = 60  # (tkinter/__init__.py alone has ~250)
MIN_CHARS = 20
VALIDATION_SHARE = 0.2  # of each package's rows, in whole modules
FORMAT = 1
DONE = "_SUCCESS"  # written last (the listing skips it): the folder is complete
TEST_FOLDERS = {"test", "tests", "idle_test"}


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def docstrings(path: Path) -> list[str]:
    """A module's docstrings in source order (none if it does not parse on this Python)."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError, OSError, ValueError):
        return []
    nodes = sorted((n for n in ast.walk(tree) if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef,
                                                                  ast.AsyncFunctionDef))),
                   key=lambda n: getattr(n, "lineno", 0))
    found = (ast.get_docstring(n) for n in nodes)
    return [d for d in found if d and len(d) >= MIN_CHARS]


def table_rows(root: Path) -> dict[str, dict[str, list[dict]]]:
    """split -> package -> its rows: per package, whole modules (in the order of a hash of their
    path) go to validation until it holds VALIDATION_SHARE of the package's rows."""
    rows = []
    for path in sorted(root.rglob("*.py"), key=lambda p: p.relative_to(root).as_posix()):
        relative = path.relative_to(root)
        if relative.parts[0] not in PACKAGES or TEST_FOLDERS.intersection(relative.parts):
            continue
        module = relative.as_posix()
        rows += [{"text": d, "package": relative.parts[0], "module": module, "rank": _digest(f"{module}:{i}")}
                 for i, d in enumerate(docstrings(path)[:PER_MODULE])]
    kept: Counter = Counter()
    by_module: dict[str, list[dict]] = {}
    for row in sorted(rows, key=lambda r: r["rank"]):
        if kept[row["package"]] < PER_CLASS:
            kept[row["package"]] += 1
            by_module.setdefault(row["module"], []).append(row)
    splits: dict[str, dict[str, list[dict]]] = {"train": {}, "validation": {}}
    held: Counter = Counter()
    for module in sorted(by_module, key=_digest):
        chosen = by_module[module]
        package = chosen[0]["package"]
        split = "validation" if held[package] < VALIDATION_SHARE * kept[package] else "train"
        held[package] += len(chosen) if split == "validation" else 0
        splits[split].setdefault(package, []).extend(
            {"text": r["text"], "package": package, "module": module} for r in sorted(chosen, key=lambda r: r["rank"]))
    return splits


def ensure(cache_root: str) -> str:
    """The folder of the table (train/ and validation/, a JSON Lines file per package in each),
    written first if it is not there yet."""
    root = Path(sysconfig.get_paths()["stdlib"])
    settings = [FORMAT, PACKAGES, VALIDATION_SHARE, PER_CLASS, PER_MODULE, MIN_CHARS, sys.version, str(root)]
    key = _digest(json.dumps(settings))[:16]
    folder = storage.join(cache_root, f"stdlib-docstrings-{key}")
    if storage.exists(storage.join(folder, DONE)):
        return folder
    for split, packages in table_rows(root).items():
        for package, rows in sorted(packages.items()):
            write_atomically(storage.join(folder, split, f"{package}.jsonl"),
                             "".join(json.dumps(row, sort_keys=True) + "\n" for row in rows))
    storage.write_text(storage.join(folder, DONE), "")
    return folder
