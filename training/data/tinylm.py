"""The built-in `tinylm` source (driver): bytes of the Python standard library's own source (found
at run time, site-packages left out) as rows of seq_len + 1 byte ids, for a byte-level language
model; split into train and validation by file (no leakage)."""

from __future__ import annotations

import hashlib
import random
import sysconfig
from pathlib import Path
from typing import Literal

import numpy as np
from pydantic import Field

from training.data.source import DataSection
from training.data.tables import SourceData, TableSource, token_table
from training.errors import UserError
from training.schema import Section
from training.tasks import LANGUAGE_MODEL


class TinyLMOptions(Section):
    # Tokens per training sequence (bytes: the tokenizer is byte-level, vocabulary 256).
    seq_len: int = Field(128, ge=8, le=8192)
    # How much of the standard library's source to use, in bytes.
    max_bytes: int = Field(1_000_000, ge=10_000)
    # One file in every `val_every_n_files` goes to validation (split by file: no leakage).
    val_every_n_files: int = Field(20, ge=2)
    file_order_seed: int = 0


class TinyLMData(DataSection):
    source: Literal["tinylm"] = "tinylm"
    options: TinyLMOptions = Field(default_factory=TinyLMOptions)


def stdlib_source_files() -> list[Path]:
    """The standard library's .py files, found at run time, site-packages left out."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [p for p in root.rglob("*.py") if "site-packages" not in p.parts and "dist-packages" not in p.parts]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


class TinyLM(TableSource):
    name = "tinylm"
    Config = TinyLMData
    task = LANGUAGE_MODEL.name

    def load(self, section: TinyLMData) -> SourceData:
        options = section.options
        files = stdlib_source_files()
        random.Random(options.file_order_seed).shuffle(files)
        streams: dict[str, list[bytes]] = {"train": [], "validation": []}
        hasher = hashlib.sha256()
        total = 0
        for index, path in enumerate(files):
            if total >= options.max_bytes:
                break
            try:
                content = path.read_bytes()
            except OSError:
                continue
            content = content[: options.max_bytes - total]
            hasher.update(path.name.encode() + b"\0" + content)
            split = "validation" if index % options.val_every_n_files == options.val_every_n_files - 1 else "train"
            streams[split].append(content + b"\n\n")
            total += len(content)
        if not streams["train"]:
            raise UserError(f"tinylm found no Python source files under {sysconfig.get_paths()['stdlib']}")
        width = options.seq_len + 1
        splits = {}
        for name, chunks in streams.items():
            data = np.frombuffer(b"".join(chunks), dtype=np.uint8)
            rows = max(len(data) // width, 1 if name == "validation" else 0)
            if len(data) < width:  # a tiny validation stream: pad by repeating
                data = np.resize(data, width)
            splits[name] = token_table(data[: rows * width].reshape(rows, width).astype(np.int32))
        spec = {"vocab_size": 256, "seq_len": options.seq_len}
        return SourceData(LANGUAGE_MODEL.name, splits, spec, hasher.hexdigest())


SOURCE = TinyLM()
