"""Runs in the driver, or in a Ray Data task on any node: one input file of the `text` source read a
batch of documents at a time, tokenized, packed into rows and written as one Parquet file (a unit of
training/data/file_work.py's pipeline).

Packing: every document is followed by the end-of-document token, and the file's token stream is
cut into rows of `width` (seq_len + 1) ids; what is left at the end of the file (shorter than a
row) is dropped and counted. A file is written to a hidden temporary name and renamed when
complete (see file_work), so a file that is there is finished; a file too short for one row is
still marked done, as an empty `_<name>.parquet`.
Memory: one batch of documents and one row group of rows, whatever the file's size.
"""

from __future__ import annotations

import json
from typing import Iterator, Optional

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from training import storage
from training.data.file_work import FileTask, done_paths, temporary_path
from training.errors import DataError, first_line

# Text handed to the tokenizer at once (its batch encoder runs on several threads; its encodings,
# with offsets and token strings, take many times the text's size in memory).
BATCH_BYTES = 1 << 20
# Rows of a row group: about 256 KiB of token ids (the streaming loader holds a few per partition,
# and an epoch leaves out up to about one row group per partition).
ROW_GROUP_BYTES = 256 << 10
META_KEY = b"training.text"


def format_of(uri: str, configured: str) -> str:
    if configured != "auto":
        return configured
    name = uri.lower()
    if name.endswith((".jsonl", ".ndjson", ".jsonl.gz")):
        return "jsonl"
    if name.endswith((".parquet", ".pq")):
        return "parquet"
    return "text"


def documents(uri: str, fmt: str, text_column: str, limit_bytes: Optional[int] = None) -> Iterator[list[str]]:
    """Batches of documents of one file (UTF-8; undecodable bytes replaced). `limit_bytes`: stop
    once about that many bytes have been read (a sample)."""
    fs, path = storage.filesystem(uri)
    if fmt == "text":
        with fs.open_input_stream(path) as stream:
            data = stream.read(limit_bytes) if limit_bytes else stream.read()
        yield [data.decode("utf-8", errors="replace")]
    elif fmt == "jsonl":
        yield from _jsonl(fs, path, uri, text_column, limit_bytes)
    elif fmt == "parquet":
        try:
            handle = fs.open_input_file(path)
            parquet = pq.ParquetFile(handle)
        except (pa.ArrowInvalid, OSError) as exc:
            raise DataError(f"{uri} is not a readable Parquet file: {first_line(exc, 200)}") from None
        with handle:
            if text_column not in parquet.schema_arrow.names:
                raise DataError(f"{uri} has no column {text_column!r} (it has: "
                                f"{', '.join(parquet.schema_arrow.names)}): set data.options.text_column")
            seen = 0
            for batch in parquet.iter_batches(batch_size=1024, columns=[text_column]):
                docs = [d for d in batch.column(0).to_pylist() if d]
                if docs and not isinstance(docs[0], str):
                    raise DataError(f"{uri}: column {text_column!r} holds {batch.schema.field(0).type}, not text")
                yield docs
                seen += sum(len(d) for d in docs)
                if limit_bytes and seen >= limit_bytes:
                    return
    else:
        raise AssertionError(fmt)


def _jsonl(fs, path: str, uri: str, field: str, limit_bytes: Optional[int]) -> Iterator[list[str]]:
    batch, size, seen = [], 0, 0
    with fs.open_input_stream(path, compression="detect") as stream:
        for number, line in enumerate(_lines(stream), start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as exc:
                raise DataError(f"{uri} line {number}: not JSON ({exc})") from None
            if not isinstance(record, dict) or field not in record:
                raise DataError(f"{uri} line {number}: no {field!r} field; set data.options.text_column to the field "
                                "that holds the text")
            text = record[field]
            if not isinstance(text, str):
                raise DataError(f"{uri} line {number}: {field!r} is {type(text).__name__}, not text")
            batch.append(text)
            size += len(line)
            if size >= BATCH_BYTES:
                yield batch
                batch, seen, size = [], seen + size, 0
            if limit_bytes and seen + size >= limit_bytes:
                break
    if batch:
        yield batch


def _lines(stream) -> Iterator[bytes]:
    rest = b""
    while chunk := stream.read(1 << 20):
        lines = (rest + chunk).split(b"\n")
        rest = lines.pop()
        yield from lines
    if rest:
        yield rest


def rows_per_group(width: int, input_bytes: int, partitions: int) -> int:
    """Rows per row group: at most about ROW_GROUP_BYTES, and about an eighth of what one streaming
    partition is expected to hold (an epoch leaves out up to about one row group per partition;
    the rows are guessed from the input's size at 4 bytes per token, a low guess for BPE)."""
    expected_rows = input_bytes // (4 * width)
    return max(16, min(ROW_GROUP_BYTES // (4 * width), expected_rows // (8 * partitions)))


def tokenize_file(task: FileTask, tokenizer, eos_id: int, width: int, group: int, text_column: str) -> dict:
    """Tokenize, pack and write one file in row groups of `group` rows; its counts, or
    {"error": message} for bad data (nothing of this file is left behind then)."""
    final, empty = done_paths(task.folder, task.uri)
    fs, _ = storage.filesystem(final)
    _, tmp_path = storage.filesystem(temporary_path(task.folder, task.uri))
    fs.create_dir(storage.filesystem(task.folder)[1], recursive=True)
    schema = pa.schema([("tokens", pa.list_(pa.int32(), width))])
    counts = {"uri": task.uri, "documents": 0, "tokens": 0, "rows": 0, "dropped_tokens": 0, "bytes": 0}
    pending = np.empty(0, dtype=np.int32)
    writer = None
    try:
        writer = pq.ParquetWriter(tmp_path, schema, filesystem=fs, compression="zstd")
        for docs in documents(task.uri, task.fmt, text_column):
            encoded = tokenizer.encode_batch(docs, add_special_tokens=False)
            counts["documents"] += len(docs)
            counts["bytes"] += sum(len(d) for d in docs)
            parts = [pending]
            for item in encoded:
                parts += [np.asarray(item.ids, dtype=np.int32), np.array([eos_id], dtype=np.int32)]
            pending = np.concatenate(parts)
            counts["tokens"] += len(pending) - len(parts[0])
            full = (len(pending) // (width * group)) * width * group  # whole row groups only
            if full:
                _write(writer, pending[:full], width, group)
                counts["rows"] += full // width
                pending = pending[full:]
        rows = len(pending) // width
        if rows:
            _write(writer, pending[: rows * width], width, group)
            counts["rows"] += rows
        counts["dropped_tokens"] = int(len(pending) - rows * width)
        writer.add_key_value_metadata({META_KEY: json.dumps(counts).encode()})
        writer.close()
        writer = None
        fs.move(tmp_path, storage.filesystem(final if counts["rows"] else empty)[1])
    except DataError as exc:
        return {"uri": task.uri, "error": str(exc)}
    finally:
        if writer is not None:
            writer.close()
            fs.delete_file(tmp_path)
    return counts


def _write(writer, ids: np.ndarray, width: int, group: int) -> None:
    column = pa.FixedSizeListArray.from_arrays(pa.array(ids), width)
    writer.write_table(pa.table({"tokens": column}), row_group_size=group)
