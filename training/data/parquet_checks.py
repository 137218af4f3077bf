"""What the driver checks of Parquet data before anything is written (training/data/parquet_index.py
calls it for each file's footer): the task's columns' types from the schema; nulls, label and
token-id ranges and list widths from the footer's statistics (or, where a writer left none, from
the file's first row group); and which errors of pyarrow's mean a broken file rather than a storage
outage.

Each refusal is a `ColumnError` naming the option (`data.options.label`, ...), the file and, for
rows, the row group.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from training.errors import DataError

# A classification head this wide is a label column that holds something else (ids, hashes, times).
MAX_CLASSES = 1_000_000
# pyarrow raises OSError both for a storage outage and for a file whose bytes do not decode; these
# are the second kind (the same bytes fail the same way on every try).
BROKEN_FILE_SIGNS = ("magic bytes", "deserialize thrift", "invalid page header", "unexpected end of stream",
                     "corrupt", "decompress", "parquet file size", "not a parquet file", "invalid parquet",
                     "unexpected end of file", "column chunk", "page header")


class ColumnError(DataError):
    """A column of the data is not what its option needs; `option` names the option."""

    def __init__(self, message: str, option: str):
        super().__init__(message)
        self.option = option


def is_broken_file(exc: BaseException) -> bool:
    """An error reading a Parquet file that another try would meet again: bytes that are not Parquet,
    a footer or page that does not decode, a file not there or not readable. Anything else that is an
    OSError (a dropped connection, throttling, an endpoint restarting) may pass and is worth a retry."""
    if not isinstance(exc, OSError):
        return True  # pyarrow's ArrowInvalid and the like: a format error, never a transient one
    if isinstance(exc, (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)):
        return True
    text = str(exc).lower()
    return any(sign in text for sign in BROKEN_FILE_SIGNS)


def is_list(kind: pa.DataType) -> bool:
    return pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind)


def _is_number(kind: pa.DataType) -> bool:
    return pa.types.is_integer(kind) or pa.types.is_floating(kind) or pa.types.is_boolean(kind)


def check_types(schema: pa.Schema, columns, uri: str) -> None:
    """The task's columns have types it can train on (ColumnError naming the option, column, type)."""
    def refuse(option: str, name: str, needs: str) -> ColumnError:
        return ColumnError(f"{uri}: column {name!r} is {schema.field(name).type}; {needs}", f"data.options.{option}")

    if columns.tokens:
        kind = schema.field(columns.tokens).type
        if not (is_list(kind) and pa.types.is_integer(kind.value_type)):
            raise refuse("tokens", columns.tokens, "tokens must be a list column of integer token ids, every row "
                         "the same length (cast it, e.g. to list<int32>)")
        return
    if getattr(columns, "image", None):

        if not is_image_type(schema.field(columns.image).type):
            raise refuse("image", columns.image, "an image column holds each image's encoded bytes (PNG, JPEG: binary, "
                         "or Hugging Face datasets' {bytes, path} structs)")
    kind = schema.field(columns.label).type
    if not (pa.types.is_integer(kind) or pa.types.is_boolean(kind)):
        raise refuse("label", columns.label, "a label must be an integer (or boolean) column of class ids counted "
                     "from 0; cast it to an integer type (a float, string or time is refused: it would be cut or "
                     "misread)")
    if len(columns.features) == 1 and is_list(schema.field(columns.features[0]).type):
        kind = schema.field(columns.features[0]).type
        if not _is_number(kind.value_type):
            raise refuse("features", columns.features[0], "a list feature column must hold numbers, every row the "
                         "same length")
        return
    for name in columns.features:
        if not _is_number(schema.field(name).type):
            raise refuse("features", name, "features must be numeric columns (integer, float, boolean), or one "
                         "list column of numbers; cast or leave it out")


@dataclass
class ColumnFacts:
    """What one file says about a column: its smallest and largest values (`exact`: from every row
    group's statistics; else a bound seen in the first row group only), its rows' list width."""

    low: Optional[float] = None
    high: Optional[float] = None
    exact: bool = True
    width: Optional[int] = None
    widths_at: dict[int, int] = field(default_factory=dict)

    def take(self, low, high) -> None:
        if low is not None:
            self.low = low if self.low is None else min(self.low, low)
            self.high = high if self.high is None else max(self.high, high)


def _null_error(uri: str, group: int, name: str, option: str, listed: bool) -> ColumnError:
    what = "null values or empty lists" if listed else "null values"
    return ColumnError(f"{uri} row group {group}: column {name!r} has {what}; every row needs a value (drop or fill "
                       "those rows)", option)


def _negative(uri: str, group: int, name: str, option: str, low) -> ColumnError:
    return ColumnError(f"column {name!r} has negative values (min {low:g}) in {uri} row group {group}: labels and "
                       "token ids count from 0", option)


def _uneven(uri: str, group: int, name: str, option: str) -> ColumnError:
    return ColumnError(f"{uri} row group {group}: column {name!r} has rows of different lengths; every row must have "
                       "the same length", option)


def checked_columns(columns) -> dict[str, str]:
    """{column: its option} of the columns checked: the label and every feature, or the tokens."""
    if columns.tokens:
        return {columns.tokens: "data.options.tokens"}
    return {**{name: "data.options.features" for name in columns.features}, columns.label: "data.options.label"}


def _ranged(columns, name: str) -> bool:
    return name in (columns.label, columns.tokens)


def facts_from_footer(meta: pq.FileMetaData, schema: pa.Schema, columns, uri: str) -> tuple[dict, list[int]]:
    """Facts of the checked columns from every non-empty row group's statistics, and the row groups
    whose statistics lack something (to be read instead; ColumnError at the first problem)."""
    leaves = {meta.schema.column(i).path.split(".")[0]: i for i in range(meta.num_columns)}
    facts, missing = {}, set()
    for name, option in checked_columns(columns).items():
        listed, ranged = is_list(schema.field(name).type), _ranged(columns, name)
        facts[name] = found = ColumnFacts()
        for g in range(meta.num_row_groups):
            rows = meta.row_group(g).num_rows
            if rows == 0:
                continue
            chunk = meta.row_group(g).column(leaves[name])
            if listed:  # (a list leaf counts every value, a null or empty list as one: rows x width when even)
                width, remainder = divmod(chunk.num_values, rows)
                if remainder:
                    raise _uneven(uri, g, name, option)
                found.widths_at[g] = width
            stats = chunk.statistics
            if stats is None or not stats.has_null_count or (ranged and not stats.has_min_max):
                missing.add(g)
                found.exact = False
                continue
            if stats.null_count:
                raise _null_error(uri, g, name, option, listed)
            if ranged:
                if stats.min < 0:
                    raise _negative(uri, g, name, option, stats.min)
                found.take(stats.min, stats.max)
        groups = list(found.widths_at)
        other = next((g for g in groups if found.widths_at[g] != found.widths_at[groups[0]]), None)
        if other is not None:
            raise ColumnError(f"{uri}: column {name!r} has rows of {found.widths_at[groups[0]]} values in row group "
                              f"{groups[0]} but {found.widths_at[other]} in row group {other}; every row must have "
                              "the same length", option)
        found.width = found.widths_at[groups[0]] if groups else None
    return facts, sorted(missing)


def facts_from_rows(table: pa.Table, group: int, columns, uri: str, facts: dict) -> None:
    """Check one row group's rows (read where its statistics lacked something) and add what they show."""
    for name, option in checked_columns(columns).items():
        column = table.column(name)
        listed = is_list(column.type)
        values = pc.list_flatten(column) if listed else column
        empty = listed and pc.any(pc.equal(pc.list_value_length(column), 0)).as_py()
        if column.null_count or values.null_count or empty:
            raise _null_error(uri, group, name, option, listed)
        if _ranged(columns, name) and len(values):
            low, high = pc.min_max(values).values()
            if low.as_py() < 0:
                raise _negative(uri, group, name, option, low.as_py())
            facts[name].take(low.as_py(), high.as_py())


def is_image_type(kind: pa.DataType) -> bool:
    """An image column: encoded bytes, or Hugging Face datasets' {bytes, path} struct."""
    binary = (pa.types.is_binary, pa.types.is_large_binary, pa.types.is_fixed_size_binary,
              getattr(pa.types, "is_binary_view", lambda _: False))
    if pa.types.is_struct(kind):
        index = kind.get_field_index("bytes")
        return index >= 0 and is_image_type(kind.field(index).type)
    return any(test(kind) for test in binary)
