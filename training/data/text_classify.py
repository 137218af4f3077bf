"""Runs in the driver: the `text` source's classification tables (`data.options.label_column`). One
document per row of JSON Lines or Parquet files, tokenized with the plan's tokenizer and its own
special tokens (BERT's [CLS] ... [SEP], a trained BPE's <|cls|>), truncated to seq_len (counted and
logged) and padded with the pad token; written as Parquet shards that the workers read like the
built-in tables (training/data/shards.py), in the `sequence_classification` task's columns:
`tokens` (seq_len ids), `attention` (1 for real tokens, 0 for padding) and `label`.

Labels are class ids (integers from 0) or names (strings), names mapped to ids in the sorted order
of those the training split holds; the mapping is recorded in the manifest (`origin.labels`). A
validation label the training split lacks is refused: the model has no output for it.

The table is tokenized here, a file at a time, and held as token ids (seq_len * 5 bytes a row)
until written: meant for up to a few million rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np
import pyarrow as pa
from tokenizers import Tokenizer

from training.data.manifest import SPLITS, Manifest, cached
from training.data.parquet_checks import MAX_CLASSES
from training.data.shards import shards_digest, write_shards
from training.data.source import DataCheck
from training.data.text_read import BATCH_BYTES, PIECE_CHARS, records, split
from training.data.tokenize import packing
from training.data.tokenizer import tokenizer_of
from training.errors import DataError, UserError, first_line
from training.tasks import SEQUENCE_CLASSIFICATION


@dataclass
class SplitRows:
    """One split's rows as read: ids, attention masks, labels as the files hold them, and where each
    row is (uri, "line N" / "row group G"), for messages."""

    tokens: list[np.ndarray] = field(default_factory=list)
    attention: list[np.ndarray] = field(default_factory=list)
    labels: list = field(default_factory=list)
    where: list[tuple[str, str]] = field(default_factory=list)
    truncated: int = 0

    @property
    def rows(self) -> int:
        return len(self.labels)


def padded(tokenizer: Tokenizer, seq_len: int, pad_id: int) -> Tokenizer:
    """A copy that encodes a document to exactly seq_len ids with its special tokens: truncated
    (the rest in `overflowing`), then padded with `pad_id` (attention 0)."""
    copy = packing(tokenizer.to_str())
    copy.enable_truncation(max_length=seq_len)
    copy.enable_padding(length=seq_len, pad_id=pad_id, pad_token=copy.id_to_token(pad_id) or "")
    return copy


def encode_rows(encoder: Tokenizer, texts: list[str], out: SplitRows, where: str) -> None:
    """Encode a batch of documents into `out`. A document longer than PIECE_CHARS is cut at a
    pre-tokenizer boundary first (its first piece holds far more than seq_len tokens)."""
    cut = [next(split(text, PIECE_CHARS)) if len(text) > PIECE_CHARS else text for text in texts]
    try:
        encoded = encoder.encode_batch(cut)
    except Exception as exc:  # (tokenizers raises a bare Exception)
        raise DataError(f"data.options.tokenizer cannot encode the text of {where}: {first_line(exc, 200)}") from None
    out.tokens.append(np.array([e.ids for e in encoded], dtype=np.int32).reshape(len(encoded), -1))
    out.attention.append(np.array([e.attention_mask for e in encoded], dtype=np.int8).reshape(len(encoded), -1))
    out.truncated += sum(bool(e.overflowing) or len(c) < len(t) for e, c, t in zip(encoded, cut, texts))


def read_split(files, options, encoder: Tokenizer, fmt_of: Callable[[str], str]) -> SplitRows:
    out = SplitRows()
    for file in files:
        texts, size = [], 0
        for text, label, where in records(file.uri, fmt_of(file.uri), options.text_column, options.label_column):
            texts.append(text)
            out.labels.append(label)
            out.where.append((file.uri, where))
            size += len(text)
            if size >= BATCH_BYTES:
                encode_rows(encoder, texts, out, file.uri)
                texts, size = [], 0
        if texts:
            encode_rows(encoder, texts, out, file.uri)
    return out


def _kind(label, where: tuple[str, str], column: str) -> type:
    if isinstance(label, str):
        return str
    if isinstance(label, int) and not isinstance(label, bool):
        if label < 0:
            raise DataError(f"{where[0]} {where[1]}: label {label} in {column!r} is negative; class ids count from 0")
        return int
    raise DataError(f"{where[0]} {where[1]}: label {label!r} in {column!r} is {type(label).__name__}: labels are "
                    "integers (class ids from 0) or strings (class names)")


def label_ids(splits: dict[str, SplitRows], column: str) -> tuple[dict[str, np.ndarray], int, Optional[list[str]]]:
    """Each split's labels as class ids, the number of classes, and the names in id order (None for
    ids). DataError naming the file and row of a label of another type, or one training lacks."""
    kinds = {}
    for rows in splits.values():
        for label, where in zip(rows.labels, rows.where):
            kinds.setdefault(_kind(label, where, column), where)
    if len(kinds) > 1:
        raise DataError(f"labels in {column!r} are both integers ({' '.join(kinds[int])}) and strings "
                        f"({' '.join(kinds[str])}): use one kind")
    train = splits["train"].labels
    if str in kinds:
        names = sorted(set(train))
        ids = {name: index for index, name in enumerate(names)}
    else:
        names, top = None, max(train)
        ids = {label: label for label in range(top + 1)}
    if len(set(train)) < 2:
        raise DataError(f"the train split holds one class ({train[0]!r}) in {column!r}; classification needs at "
                        "least two")
    if len(ids) > MAX_CLASSES:
        raise DataError(f"{column!r} holds {len(ids):,} classes, more than {MAX_CLASSES:,}")
    out = {}
    for split_name, rows in splits.items():
        unseen = next((i for i, label in enumerate(rows.labels) if label not in ids), None)
        if unseen is not None:
            uri, where = rows.where[unseen]
            known = f"{len(names)} names: {', '.join(map(repr, names[:8]))}{' ...' if len(names) > 8 else ''}" \
                if names else f"ids 0..{len(ids) - 1}"
            raise DataError(f"{uri} {where}: label {rows.labels[unseen]!r} in {column!r} is not in the train split "
                            f"({known}); the model has no output for it")
        out[split_name] = np.array([ids[label] for label in rows.labels], dtype=np.int64)
    return out, len(ids), names


def table(rows: SplitRows, labels: np.ndarray, seq_len: int) -> pa.Table:
    tokens = np.concatenate(rows.tokens) if rows.tokens else np.zeros((0, seq_len), np.int32)
    attention = np.concatenate(rows.attention) if rows.attention else np.zeros((0, seq_len), np.int8)
    return pa.table({"tokens": pa.FixedSizeListArray.from_arrays(pa.array(tokens.reshape(-1)), seq_len),
                     "attention": pa.FixedSizeListArray.from_arrays(pa.array(attention.reshape(-1)), seq_len),
                     "label": pa.array(labels)})


def prepare_table(plan, check: Optional[DataCheck], log: Callable[[str], None]) -> Manifest:
    """The manifest of a classification table (cached by the plan's key)."""
    options = plan.options
    manifest = cached(plan.root, check, log, f"a classification table in rows of {options.seq_len} tokens ready")
    if manifest is not None:
        return manifest
    tokenizer = tokenizer_of(plan, log)
    encoder = padded(tokenizer, options.seq_len, plan.tokenizer.pad_id)
    splits = {}
    for name in SPLITS:
        try:
            splits[name] = read_split(plan.inputs[name], options, encoder, plan.fmt)
        except DataError as exc:
            option = plan.files_option(name)
            raise UserError(str(exc) if str(exc).startswith("data.options.") else f"data.options.{option}: {exc}") \
                from None
        if not splits[name].rows:
            raise UserError(f"data.options.{plan.files_option(name)}: the {name} split holds no row")
    try:
        labels, classes, names = label_ids(splits, options.label_column)
    except DataError as exc:
        raise UserError(f"data.options.label_column: {exc}") from None
    vocab = plan.tokenizer.model_vocab_size or tokenizer.get_vocab_size()
    # (pad_id: a decoder's classifier finds each row's last token by it)
    spec = {"vocab_size": vocab, "num_classes": classes, "seq_len": options.seq_len, "pad_id": plan.tokenizer.pad_id}
    rows = {name: splits[name].rows for name in SPLITS}
    truncated = {name: splits[name].truncated for name in SPLITS}
    log(f"data: {sum(truncated.values())} of {sum(rows.values())} documents were longer than seq_len "
        f"{options.seq_len} tokens and were truncated ({truncated['train']} train, {truncated['validation']} "
        "validation)")
    if check is not None:
        check(SEQUENCE_CLASSIFICATION.name, spec, rows)
    tables = {name: table(splits[name], labels[name], options.seq_len) for name in SPLITS}
    written = write_shards(tables, plan.root, plan.num_shards)
    counts = np.bincount(labels["train"], minlength=classes)
    manifest = Manifest(root=plan.root, source="text", options=options.model_dump(mode="json"),
                        task=SEQUENCE_CLASSIFICATION.name, spec=spec, splits=written,
                        schema=tables["train"].schema.to_string(), digest=shards_digest(written), origin={
                            "path": options.path, "validation_path": options.validation_path,
                            "tokenizer": plan.tokenizer.origin, "labels": names, "truncated": truncated,
                            "pad_id": plan.tokenizer.pad_id, "eos_id": plan.tokenizer.eos_id,
                            "bos_id": plan.tokenizer.bos_id, "train_label_counts": counts.tolist()})
    manifest.write()
    shown = names or list(range(classes))
    log(f"data: classification table prepared at {plan.root} ({rows['train']} train, {rows['validation']} validation "
        f"rows of {options.seq_len} tokens; {classes} classes, train rows per class: "
        f"{', '.join(f'{n}={c}' for n, c in zip(shown, counts.tolist()))}; the most frequent class is "
        f"{counts.max() / counts.sum():.1%} of the rows)")
    return manifest
