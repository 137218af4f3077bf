"""Runs in the driver, or in a Ray Data task on any node: one input file of the `text` source read a
batch of documents at a time (training/data/text_read.py), tokenized, packed into rows and written
as one Parquet file (a unit of training/data/file_work.py's pipeline).

Packing: every document is followed by the end-of-document token (and preceded by the model's
begin token where its own tokenizer puts one first: Llama's <s>), and the file's token stream is
cut into rows of `width` (seq_len + 1) ids; what is left at the end of the file (shorter than a
row) is dropped and counted. A file is written to a hidden temporary name and renamed when
complete (see file_work), so a file that is there is finished; a file too short for one row is
still marked done, as an empty `_<name>.parquet`.
Memory: one batch of text (about text_read.BATCH_BYTES, a long document in pieces) and one row
group of rows, whatever the file's size.
"""

from __future__ import annotations

import json
from typing import Optional

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from tokenizers import Tokenizer

from training import storage
from training.data.file_work import FileTask, done_paths, temporary_path
from training.data.text_read import Batch, documents
from training.errors import DataError, first_line

# Rows of a row group: about 256 KiB of token ids (the streaming loader holds a few per partition,
# and an epoch leaves out up to about one row group per partition).
ROW_GROUP_BYTES = 256 << 10
META_KEY = b"training.text"


def encode(tokenizer, batch: Batch, eos_id: int, where: str, bos_id: Optional[int] = None,
           starts: bool = True) -> list[np.ndarray]:
    """The batch's ids, the end token after each document's last piece (and `bos_id`, if any, before
    each document's first; `starts`: the batch's first text begins a document). A tokenizer that cannot
    encode the text (a model with no unknown token and a vocabulary that lacks a character) is the
    data's error, named with its file."""
    # (the fast encoder leaves out offsets, which packing does not use: less time and memory)
    encoder = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)
    try:
        encoded = encoder(batch.texts, add_special_tokens=False)
    except Exception as exc:  # (tokenizers raises a bare Exception)
        raise DataError(f"data.options.tokenizer cannot encode the text of {where}: {first_line(exc, 200)}") from None
    end = np.array([eos_id], dtype=np.int32)
    begin = None if bos_id is None else np.array([bos_id], dtype=np.int32)
    parts = []
    for item, ends in zip(encoded, batch.ends):
        if starts and begin is not None:
            parts.append(begin)
        starts = ends
        parts.append(np.asarray(item.ids, dtype=np.int32))
        if ends:
            parts.append(end)
    return parts


def rows_per_group(width: int, input_bytes: int, partitions: int) -> int:
    """Rows per row group: at most about ROW_GROUP_BYTES, and about an eighth of what one streaming
    partition is expected to hold (an epoch leaves out up to about one row group per partition;
    the rows are guessed from the input's size at 4 bytes per token, a low guess for BPE)."""
    expected_rows = input_bytes // (4 * width)
    return max(16, min(ROW_GROUP_BYTES // (4 * width), expected_rows // (8 * partitions)))


def packing(tokenizer_json: str):
    """A tokenizer from its file for packing: its own truncation and padding off (a model's
    tokenizer.json may carry them, and would cut every document to its max_length)."""
    tokenizer = Tokenizer.from_str(tokenizer_json)
    tokenizer.no_truncation()
    tokenizer.no_padding()
    return tokenizer


def tokenize_file(task: FileTask, tokenizer, eos_id: int, width: int, group: int, text_column: str,
                  bos_id: Optional[int] = None) -> dict:
    """Tokenize, pack and write one file in row groups of `group` rows; its counts, or
    {"error": message} for bad data (nothing of this file is left behind then)."""
    final, empty = done_paths(task.folder, task.uri)
    fs, _ = storage.filesystem(final)
    _, tmp_path = storage.filesystem(temporary_path(task.folder, task.uri))
    fs.create_dir(storage.filesystem(task.folder)[1], recursive=True)
    schema = pa.schema([("tokens", pa.list_(pa.int32(), width))])
    counts = {"uri": task.uri, "documents": 0, "tokens": 0, "rows": 0, "dropped_tokens": 0, "bytes": 0}
    pending = np.empty(0, dtype=np.int32)
    writer, starts = None, True
    try:
        writer = pq.ParquetWriter(tmp_path, schema, filesystem=fs, compression="zstd")
        for batch in documents(task.uri, task.fmt, text_column):
            parts = encode(tokenizer, batch, eos_id, task.uri, bos_id, starts)
            starts = batch.ends[-1]
            counts["documents"] += sum(batch.ends)
            counts["bytes"] += sum(len(t) for t in batch.texts)
            counts["tokens"] += sum(len(p) for p in parts)
            pending = np.concatenate([pending, *parts])
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
