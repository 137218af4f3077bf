"""Runs in the driver, or in a Ray Data task on any node: the documents of one input file of the
`text` source, read in batches of about BATCH_BYTES whatever the file holds (a .txt file is one
document, a JSON Lines file one per line, a Parquet file one per row of a text column).

A document longer than PIECE_CHARS is handed on in pieces of at most PIECE_CHARS characters, each
cut before a space that follows a non-space: no pre-tokenizer match of a byte-level BPE (GPT-2,
Llama 3, RoBERTa) or of a Metaspace (SentencePiece-style) tokenizer spans such a cut, so the pieces
encode to the document's own ids; only a stretch of PIECE_CHARS with no space is cut elsewhere
(before any whitespace, else anywhere). So a 1 GB document costs the tokenizer what PIECE_CHARS do.
"""

from __future__ import annotations

import codecs
import json
import re
from dataclasses import dataclass
from typing import Iterator, Optional

import pyarrow as pa
import pyarrow.parquet as pq

from training import storage
from training.errors import DataError, first_line

# Text handed to the tokenizer at once (its batch encoder runs on several threads; its encodings
# take many times the text's size in memory).
BATCH_BYTES = 1 << 20
# The longest piece of a document handed to the tokenizer (a few per batch: its threads share them).
PIECE_CHARS = 256 << 10
READ_BYTES = 1 << 20  # bytes read from a file at a time
# JSON Lines compressed, as C4, Dolma and RedPajama ship them: name -> the compression's magic bytes.
COMPRESSED_JSONL = {".gz": ("gzip", b"\x1f\x8b"), ".zst": ("zstd", b"\x28\xb5\x2f\xfd")}
JSONL_SUFFIXES = (".jsonl", ".ndjson") + tuple(f"{name}{compressed}" for name in (".jsonl", ".ndjson", ".json")
                                               for compressed in COMPRESSED_JSONL)
_CUT_BEFORE_SPACE = re.compile(r".*\S(?= )", re.S)
_CUT_BEFORE_WHITESPACE = re.compile(r".*\S(?=\s)", re.S)


@dataclass(frozen=True)
class Batch:
    """Texts to encode in one call: whole documents or pieces of one; `ends[i]`: texts[i] ends its
    document (the end-of-document token follows it)."""

    texts: list[str]
    ends: list[bool]


def format_of(uri: str, configured: str) -> str:
    if configured != "auto":
        return configured
    name = uri.lower()
    if name.endswith(JSONL_SUFFIXES):
        return "jsonl"
    if name.endswith((".parquet", ".pq")):
        return "parquet"
    return "text"


def documents(uri: str, fmt: str, text_column: str, limit_bytes: Optional[int] = None,
              piece_chars: int = PIECE_CHARS) -> Iterator[Batch]:
    """Batches of one file's documents (UTF-8; undecodable bytes replaced), in pieces of at most
    `piece_chars`. `limit_bytes`: stop once about that many bytes have been read (a sample)."""
    fs, path = storage.filesystem(uri)
    if fmt == "text":
        items = _text(fs, path, limit_bytes, piece_chars)
    elif fmt == "jsonl":
        items = _pieces(_jsonl(fs, path, uri, text_column, limit_bytes), piece_chars)
    elif fmt == "parquet":
        items = _pieces(_parquet(fs, path, uri, text_column, limit_bytes), piece_chars)
    else:
        raise AssertionError(fmt)
    texts, ends, size = [], [], 0
    for text, end in items:
        texts.append(text)
        ends.append(end)
        size += len(text)
        if size >= BATCH_BYTES:
            yield Batch(texts, ends)
            texts, ends, size = [], [], 0
    if texts:
        yield Batch(texts, ends)


def cut(text: str, start: int, piece_chars: int) -> int:
    """Where a piece of `text` that starts at `start` ends (len(text) > start + piece_chars): before
    the last space after a non-space in the piece's second half; else before any whitespace there;
    else at piece_chars."""
    low, high = start + piece_chars // 2, start + piece_chars
    for pattern in (_CUT_BEFORE_SPACE, _CUT_BEFORE_WHITESPACE):
        found = pattern.match(text, low - 1, high + 1)
        if found:
            return found.end()
    return high


def split(text: str, piece_chars: int) -> Iterator[str]:
    """`text` in pieces (see `cut`); the last one may be as long as piece_chars."""
    start = 0
    while len(text) - start > piece_chars:
        end = cut(text, start, piece_chars)
        yield text[start:end]
        start = end
    yield text[start:] if start else text


def _text(fs, path: str, limit_bytes: Optional[int], piece_chars: int) -> Iterator[tuple[str, bool]]:
    """A file that is one document, read READ_BYTES at a time (`limit_bytes`: its first bytes)."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    rest, left = "", limit_bytes or None
    with fs.open_input_stream(path) as stream:
        while True:
            data = stream.read(READ_BYTES if left is None else min(READ_BYTES, left))
            left = None if left is None else left - len(data)
            text = rest + decoder.decode(data, final=not data)
            if not data:
                break
            *pieces, rest = split(text, piece_chars)
            for piece in pieces:
                yield piece, False
    *pieces, last = split(text, piece_chars)
    for piece in pieces:
        yield piece, False
    yield last, True


def _pieces(docs: Iterator[str], piece_chars: int) -> Iterator[tuple[str, bool]]:
    for doc in docs:
        *pieces, last = split(doc, piece_chars)
        for piece in pieces:
            yield piece, False
        yield last, True


def _jsonl(fs, path: str, uri: str, field: str, limit_bytes: Optional[int]) -> Iterator[str]:
    for text, _, _ in _jsonl_records(fs, path, uri, field, None, limit_bytes):
        yield text


def _jsonl_records(fs, path: str, uri: str, field: str, label: Optional[str],
                   limit_bytes: Optional[int]) -> Iterator[tuple[str, object, str]]:
    """(text, label or None, "line N") of each non-blank line."""
    compression = next((s for s in COMPRESSED_JSONL if uri.lower().endswith(s)), None)
    if compression is not None:
        codec, magic = COMPRESSED_JSONL[compression]
        with fs.open_input_stream(path, compression=None) as raw:
            if raw.read(len(magic)) != magic:
                raise DataError(f"{uri} is not {codec}-compressed (its name ends in {compression}): rename it, or "
                                f"compress it with {codec}")
    seen = 0
    with fs.open_input_stream(path, compression="detect") as stream:
        try:
            for number, line in enumerate(_lines(stream), start=1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except ValueError as exc:
                    raise DataError(f"{uri} line {number}: not JSON ({exc})") from None
                if not isinstance(record, dict) or field not in record:
                    raise DataError(f"{uri} line {number}: no {field!r} field; set data.options.text_column to the "
                                    "field that holds the text")
                text = record[field]
                if not isinstance(text, str):
                    raise DataError(f"{uri} line {number}: {field!r} is {type(text).__name__}, not text")
                if label is not None and record.get(label) is None:
                    raise DataError(f"{uri} line {number}: no {label!r} field (or null); set "
                                    "data.options.label_column to the field that holds each document's label")
                yield text, None if label is None else record[label], f"line {number}"
                seen += len(line)
                if limit_bytes and seen >= limit_bytes:
                    return
        except OSError as exc:
            if compression is None or not re.search("inflate|compress", str(exc), re.I):
                raise  # (a storage error, not the file's)
            raise DataError(f"{uri} does not decompress: {first_line(exc, 200)}") from None


def _lines(stream) -> Iterator[bytes]:
    """The stream's lines (a long one gathered from its reads once, not copied at each)."""
    parts: list[bytes] = []
    while chunk := stream.read(READ_BYTES):
        lines = chunk.split(b"\n")
        if len(lines) == 1:
            parts.append(chunk)
            continue
        yield b"".join([*parts, lines[0]])
        yield from lines[1:-1]
        parts = [lines[-1]]
    if any(parts):
        yield b"".join(parts)


def _parquet(fs, path: str, uri: str, column: str, limit_bytes: Optional[int]) -> Iterator[str]:
    """The column's non-empty values, read in batches of about BATCH_BYTES (rows per batch from the
    footer's sizes: documents of a book each are read one at a time)."""
    try:
        handle = fs.open_input_file(path)
        # (unbuffered, pyarrow reads a row group's column whole, and pre-buffering reads ahead)
        parquet = pq.ParquetFile(handle, buffer_size=READ_BYTES, pre_buffer=False)
    except (pa.ArrowInvalid, OSError) as exc:
        raise DataError(f"{uri} is not a readable Parquet file: {first_line(exc, 200)}") from None
    with handle:
        names = parquet.schema_arrow.names
        if column not in names:
            raise DataError(f"{uri} has no column {column!r} (it has: {', '.join(names)}): set "
                            "data.options.text_column")
        kind = parquet.schema_arrow.field(column).type
        if not _is_text(kind.value_type if pa.types.is_dictionary(kind) else kind):
            raise DataError(f"{uri}: column {column!r} holds {kind}, not text")
        seen = 0
        for batch in parquet.iter_batches(batch_size=_rows_per_batch(parquet, column), columns=[column]):
            for doc in batch.column(0).to_pylist():
                if doc:
                    yield doc
                    seen += len(doc)
            if limit_bytes and seen >= limit_bytes:
                return


def _is_text(kind: pa.DataType) -> bool:
    return pa.types.is_string(kind) or pa.types.is_large_string(kind) or str(kind) == "string_view"


def _rows_per_batch(parquet: pq.ParquetFile, column: str) -> int:
    metadata = parquet.metadata
    index = next(i for i in range(metadata.num_columns) if metadata.schema.column(i).path == column)  # (a leaf)
    widest = max((metadata.row_group(g).column(index).total_uncompressed_size / metadata.row_group(g).num_rows
                  for g in range(metadata.num_row_groups) if metadata.row_group(g).num_rows), default=1)
    return int(max(1, min(1 << 16, BATCH_BYTES // max(widest, 1))))


def records(uri: str, fmt: str, text_column: str, label_column: str,
            limit_bytes: Optional[int] = None) -> Iterator[tuple[str, object, str]]:
    """(text, label, where) of each row of a JSON Lines or Parquet file: a classification table, one
    document per row; `where` names the row ("line 12", "row group 3") for messages. A label as the
    file holds it (an int or a str; a JSON file may hold anything: the caller checks). A row with
    no text or no label is a DataError naming it."""
    fs, path = storage.filesystem(uri)
    if fmt == "jsonl":
        yield from _jsonl_records(fs, path, uri, text_column, label_column, limit_bytes)
    elif fmt == "parquet":
        yield from _parquet_records(fs, path, uri, text_column, label_column, limit_bytes)
    else:
        raise DataError(f"{uri} is a text file (one document, no fields): data.options.label_column needs JSON "
                        "Lines or Parquet, a row per document")


def _parquet_records(fs, path: str, uri: str, column: str, label: str,
                     limit_bytes: Optional[int]) -> Iterator[tuple[str, object, str]]:
    try:
        handle = fs.open_input_file(path)
        parquet = pq.ParquetFile(handle, buffer_size=READ_BYTES, pre_buffer=False)
    except (pa.ArrowInvalid, OSError) as exc:
        raise DataError(f"{uri} is not a readable Parquet file: {first_line(exc, 200)}") from None
    with handle:
        schema = parquet.schema_arrow
        for name, option in ((column, "text_column"), (label, "label_column")):
            if name not in schema.names:
                raise DataError(f"{uri} has no column {name!r} (it has: {', '.join(schema.names)}): set "
                                f"data.options.{option}")
        kind = schema.field(column).type
        if not _is_text(kind.value_type if pa.types.is_dictionary(kind) else kind):
            raise DataError(f"{uri}: column {column!r} holds {kind}, not text")
        kind = schema.field(label).type
        kind = kind.value_type if pa.types.is_dictionary(kind) else kind
        if not (pa.types.is_integer(kind) or _is_text(kind)):
            raise DataError(f"{uri}: column {label!r} holds {kind}: data.options.label_column must hold integers "
                            "(class ids from 0) or strings (class names)")
        seen, batch_rows = 0, _rows_per_batch(parquet, column)
        for group in range(parquet.metadata.num_row_groups):
            for batch in parquet.iter_batches(batch_size=batch_rows, row_groups=[group], columns=[column, label]):
                texts, labels = batch.column(0), batch.column(1)
                if texts.null_count or labels.null_count:
                    which = column if texts.null_count else label
                    raise DataError(f"{uri} row group {group}: column {which!r} has null values; every row needs a "
                                    "text and a label")
                for text, value in zip(texts.to_pylist(), labels.to_pylist()):
                    yield text, value, f"row group {group}"
                    seen += len(text)
                if limit_bytes and seen >= limit_bytes:
                    return
