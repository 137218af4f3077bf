"""Runs in the driver (or as `python -m training.data.stdlib_chat OUT [--parquet]`): a chat dataset
made from the running Python's standard library, for fine-tuning with nothing downloaded
(`format: chat` of the `text` source, `path: stdlib_chat/train`, `validation_path:
stdlib_chat/validation`). One conversation per public function or method with a docstring: the
user gives its qualified name and signature (`json.dumps(obj, *, skipkeys=False, ...)`), the
assistant answers with the first paragraph of its docstring (whitespace joined).

Test folders, private names (a leading underscore, in any part of the name) and first paragraphs
outside MIN_CHARS..MAX_CHARS are left out. Validation holds about VALIDATION_SHARE of the rows, in
whole modules (by a hash of their path): functions training never saw. Deterministic: the same
Python writes the same files, once, into the data cache, in a folder named for the Python version
and its stdlib folder.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import sys
import sysconfig
from pathlib import Path
from typing import Iterator

import pyarrow as pa
import pyarrow.parquet as pq

from training import storage
from training.data.tinylm import stdlib_source_files
from training.data.tokenizer import write_atomically

NAME = "stdlib_chat"
MIN_CHARS, MAX_CHARS = 30, 600
VALIDATION_SHARE = 0.1
FORMAT = 1
DONE = "_SUCCESS"  # written last (the listing skips it): the folder is complete
TEST_FOLDERS = {"test", "tests", "idle_test", "idlelib"}


def first_paragraph(docstring: str) -> str:
    return " ".join(docstring.strip().split("\n\n", 1)[0].split())


def functions(tree: ast.Module, module: str) -> Iterator[tuple[str, str]]:
    """(qualified name with signature, first paragraph) of each documented public function and
    method, in source order."""
    def walk(node, prefix: str):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef) and not child.name.startswith("_"):
                yield from walk(child, f"{prefix}{child.name}.")
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) and not child.name.startswith("_"):
                doc = ast.get_docstring(child)
                paragraph = first_paragraph(doc) if doc else ""
                if MIN_CHARS <= len(paragraph) <= MAX_CHARS:
                    args = ast.unparse(child.args)
                    yield f"{prefix}{child.name}({args})", paragraph

    yield from walk(tree, f"{module}.")


def module_name(relative: Path) -> str:
    parts = list(relative.with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def conversations(root: Path, files: list[Path]) -> dict[str, list[dict]]:
    """split -> rows ({"messages": [user, assistant], "module": ...}), modules in path order."""
    splits: dict[str, list[dict]] = {"train": [], "validation": []}
    for path in files:
        relative = path.relative_to(root)
        module = module_name(relative)
        if TEST_FOLDERS.intersection(relative.parts) or any(p.startswith("_") for p in module.split(".")):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, OSError, ValueError):
            continue
        rank = int(hashlib.sha256(relative.as_posix().encode()).hexdigest()[:8], 16) / 0xFFFFFFFF
        split = "validation" if rank < VALIDATION_SHARE else "train"
        splits[split] += [{"messages": [{"role": "user", "content": signature},
                                        {"role": "assistant", "content": answer}], "module": module}
                          for signature, answer in functions(tree, module)]
    return splits


def write(folder: str, parquet: bool = False) -> dict[str, int]:
    """train/ and validation/ under `folder`, a file each (JSON Lines, or Parquet); rows per split."""
    root = Path(sysconfig.get_paths()["stdlib"])
    splits = conversations(root, stdlib_source_files())
    for split, rows in splits.items():
        if parquet:
            fs, path = storage.filesystem(storage.join(folder, split, f"{NAME}.parquet"))
            fs.create_dir(path.rsplit("/", 1)[0], recursive=True)
            pq.write_table(pa.Table.from_pylist(rows), path, filesystem=fs, compression="zstd")
        else:
            write_atomically(storage.join(folder, split, f"{NAME}.jsonl"),
                             "".join(json.dumps(row, sort_keys=True) + "\n" for row in rows))
    return {split: len(rows) for split, rows in splits.items()}


def ensure(cache_root: str) -> str:
    """The folder of the dataset in the data cache, written first if it is not there yet."""
    root = Path(sysconfig.get_paths()["stdlib"])
    settings = [FORMAT, MIN_CHARS, MAX_CHARS, VALIDATION_SHARE, sorted(TEST_FOLDERS), sys.version, str(root)]
    folder = storage.join(cache_root, f"stdlib-chat-{hashlib.sha256(json.dumps(settings).encode()).hexdigest()[:16]}")
    if not storage.exists(storage.join(folder, DONE)):
        write(folder)
        storage.write_text(storage.join(folder, DONE), "")
    return folder


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m training.data.stdlib_chat", description=__doc__.split("\n\n")[0])
    parser.add_argument("out", help="a folder (local or s3://): train/ and validation/ are written in it")
    parser.add_argument("--parquet", action="store_true", help="Parquet files instead of JSON Lines")
    args = parser.parse_args(argv)
    counts = write(args.out, args.parquet)
    print(f"{counts['train']} train and {counts['validation']} validation conversations written under {args.out}")


if __name__ == "__main__":
    main()
