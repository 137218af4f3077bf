"""Runs in the driver: the conversations of one chat file of the `text` source (`format: chat`), JSON
Lines (plain, gzip or zstd) or Parquet, each checked. A row is a conversation: a `messages` list of
{role, content} (Parquet: a list of structs), or a `prompt` and a `completion` (one user turn, one
assistant turn). A row that is neither, a role not in ROLES, content that is not text, or (when the
loss learns the assistant's turns) no assistant turn is a DataError naming the file and its line or
row group.
"""

from __future__ import annotations

import json
from typing import Iterator, Optional

import pyarrow as pa
import pyarrow.parquet as pq

from training import storage
from training.data.text_read import COMPRESSED_JSONL, READ_BYTES, format_of
from training.errors import DataError, first_line

ROLES = ("system", "user", "assistant", "tool")
PROMPT, COMPLETION = "prompt", "completion"
ROWS_PER_BATCH = 1024  # (Parquet rows read at a time)


def conversation(record, column: str, where: str, needs_assistant: bool) -> list[dict]:
    """The row's messages as [{role, content}], checked (DataError naming `where`)."""
    if not isinstance(record, dict):
        raise DataError(f"{where}: a row is a JSON object with {column!r} (or {PROMPT!r} and {COMPLETION!r}), not "
                        f"{type(record).__name__}")
    messages = record.get(column)
    if messages is None and record.get(PROMPT) is not None and record.get(COMPLETION) is not None:
        messages = [{"role": "user", "content": record[PROMPT]}, {"role": "assistant", "content": record[COMPLETION]}]
    if messages is None:
        raise DataError(f"{where}: no {column!r} (nor {PROMPT!r} and {COMPLETION!r}); set "
                        "data.options.chat.messages_column to the field holding each conversation's messages")
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: {column!r} is {type(messages).__name__ if messages else 'empty'}, not a list of "
                        "{role, content} messages")
    checked = []
    for number, message in enumerate(messages, start=1):
        role = message.get("role") if isinstance(message, dict) else None
        content = message.get("content") if isinstance(message, dict) else None
        if role not in ROLES:
            raise DataError(f"{where}: message {number} has role {role!r}; the roles are {', '.join(ROLES)}")
        if not isinstance(content, str):
            raise DataError(f"{where}: message {number} ({role}) has content {type(content).__name__}, not text")
        checked.append({"role": role, "content": content})
    if needs_assistant and not any(m["role"] == "assistant" for m in checked):
        raise DataError(f"{where}: no assistant turn, and data.options.chat.train_on is assistant (the loss learns "
                        "only the assistant's turns); remove the row or set train_on: all")
    return checked


def conversations(uri: str, column: str, needs_assistant: bool,
                  limit: Optional[int] = None) -> Iterator[tuple[list[dict], str]]:
    """(messages, where) of each row of a chat file; `limit`: at most that many rows (a first look)."""
    fmt = format_of(uri, "auto")
    fs, path = storage.filesystem(uri)
    if fmt == "jsonl":
        rows = _jsonl(fs, path, uri)
    elif fmt == "parquet":
        rows = _parquet(fs, path, uri, column)
    else:
        raise DataError(f"{uri}: a chat file is JSON Lines (.jsonl, .ndjson, also .gz or .zst) or Parquet "
                        "(.parquet, .pq)")
    for count, (record, where) in enumerate(rows):
        if limit is not None and count >= limit:
            return
        yield conversation(record, column, where, needs_assistant), where


def _jsonl(fs, path: str, uri: str) -> Iterator[tuple[object, str]]:
    compressed = uri.lower().endswith(tuple(COMPRESSED_JSONL))
    try:
        with fs.open_input_stream(path, compression="detect" if compressed else None) as stream:
            rest, number = b"", 0
            while True:
                chunk = stream.read(READ_BYTES)
                lines = (rest + chunk).split(b"\n")
                rest = lines.pop() if chunk else b""
                for line in lines:
                    number += 1
                    if not line.strip():
                        continue
                    try:
                        yield json.loads(line), f"{uri} line {number}"
                    except ValueError as exc:
                        raise DataError(f"{uri} line {number}: not JSON ({exc})") from None
                if not chunk:
                    return
    except OSError as exc:
        if not compressed:
            raise  # (a storage error, not the file's)
        raise DataError(f"{uri} does not decompress: {first_line(exc, 200)}") from None


def _parquet(fs, path: str, uri: str, column: str) -> Iterator[tuple[object, str]]:
    try:
        handle = fs.open_input_file(path)
        parquet = pq.ParquetFile(handle, buffer_size=READ_BYTES, pre_buffer=False)
    except (pa.ArrowInvalid, OSError) as exc:
        raise DataError(f"{uri} is not a readable Parquet file: {first_line(exc, 200)}") from None
    with handle:
        names = parquet.schema_arrow.names
        wanted = [column] if column in names else [n for n in (PROMPT, COMPLETION) if n in names]
        if len(wanted) == 1 and wanted[0] != column:
            wanted = []
        if not wanted:
            raise DataError(f"{uri} row group 0: no column {column!r} (nor {PROMPT!r} and {COMPLETION!r}; it has: "
                            f"{', '.join(names)}); set data.options.chat.messages_column")
        for group in range(parquet.metadata.num_row_groups):
            for batch in parquet.iter_batches(batch_size=ROWS_PER_BATCH, row_groups=[group], columns=wanted):
                for record in batch.to_pylist():
                    yield record, f"{uri} row group {group}"
