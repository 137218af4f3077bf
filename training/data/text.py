"""Runs in the driver: the built-in `text` source. Text files (.txt or any other extension: one
document per file), JSON Lines (one document per line, in a field) or Parquet (a text column)
tokenized with a Hugging Face `tokenizers` file, or with a byte-level BPE trained here on a
deterministic sample of the training files, packed into rows of seq_len + 1 token ids and written
as Parquet that workers stream exactly like the `parquet` source's `tokens` column.

Layout (local or s3://):
    <cache_root>/text-<key>/tokenizer.json                the tokenizer the ids come from
    <cache_root>/text-<key>/{train,validation}/<input file's name>-<digest>.parquet
    <cache_root>/text-<key>/manifest.json                 written last: its presence means complete

`key` digests the inputs' listing (paths, sizes, modification times), the options and the
tokenizer. Each input file is one unit of work, written under a temporary name and renamed: an
interrupted preparation resumes with the files not yet written. Large inputs are tokenized by a
Ray Data pipeline on the cluster (blocks of files, each written by the task that reads it; only
counts come back to the driver); small ones in the driver, a file at a time.

`plan` makes every check a user can fail (paths, options, the tokenizer file, an empty validation
split) without Ray; `prepare` does the work.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from fnmatch import fnmatch
from typing import Callable, Literal, Optional, Union

from pydantic import Field, ValidationError, model_validator

from training import storage
from training.config import DataConfig
from training.data import parquet
from training.data.prepare import decide_where, do_file_tasks, pending_bytes, same_dataset
from training.data.tokenize import DataError, FileTask, format_of, is_done, rows_per_group, tokenize_file
from training.data.tokenizer import hash_rank, load_tokenizer, tokenizer_of
from training.errors import ConfigError, UserError
from training.schema import Section, format_validation_error

SOURCE = "text"
TEXT_FORMAT = 1
STDLIB = "stdlib"  # path: the Python standard library's own .py files (site-packages left out)


class TokenizerTraining(Section):
    vocab_size: int = Field(2048, ge=260, le=1_000_000)  # 256 bytes, the end token, a few merges
    # Bytes of the training files the BPE is trained on (a deterministic sample: files by a hash of
    # their path, up to an equal share of the budget from each).
    sample_bytes: int = Field(4_000_000, ge=10_000)


class TokenizerOptions(Section):
    # A Hugging Face `tokenizers` file (tokenizer.json), local or s3://.
    file: Optional[str] = None
    # Or a byte-level BPE trained during preparation.
    train: Optional[TokenizerTraining] = None

    @model_validator(mode="after")
    def _one(self):
        if (self.file is None) == (self.train is None):
            raise ValueError("give either file (a tokenizer.json) or train ({vocab_size, sample_bytes})")
        return self


class TextOptions(Section):
    # A folder, a glob, a file or a list of them (local, s3://, Hive layouts), or `stdlib`.
    path: Union[str, list[str]]
    # Paths left out: fnmatch patterns on the full path, e.g. "*/site-packages/*".
    exclude: list[str] = Field(default_factory=list)
    # The validation split: its own path, or a fraction of the files (as the parquet source does).
    validation_path: Optional[Union[str, list[str]]] = None
    validation_fraction: Optional[float] = Field(None, gt=0, lt=1)
    # auto: .jsonl/.ndjson -> jsonl, .parquet/.pq -> parquet, anything else -> text (one document per file).
    format: Literal["auto", "text", "jsonl", "parquet"] = "auto"
    # The field (jsonl) or column (parquet) holding each document's text.
    text_column: str = "text"
    # Tokens per training sequence; each row holds seq_len + 1 ids.
    seq_len: int = Field(256, ge=8, le=65536)
    tokenizer: TokenizerOptions
    # The end-of-document token of a tokenizer file (default: the first it has of EOS_CANDIDATES).
    eos_token: Optional[str] = None
    # At most this many bytes of the files under `path` (whole files, chosen by a hash of their path).
    max_bytes: Optional[int] = Field(None, ge=1)
    # Where the files are tokenized: a Ray Data pipeline on the cluster, or the driver a file at a time.
    tokenize_on: Literal["auto", "cluster", "driver"] = "auto"
    # Passed on to the streaming loader (see the parquet source).
    partitions: int = Field(16, ge=1, le=65536)
    shuffle_window: int = Field(2, ge=1, le=1024)
    read_ahead: bool = True
    read_threads: int = Field(2, ge=1, le=64)

    @model_validator(mode="after")
    def _validation(self):
        if (self.validation_path is None) == (self.validation_fraction is None):
            raise ValueError("set validation_path or validation_fraction (one of them)")
        return self


@dataclass(frozen=True)
class TextPlan:
    options: TextOptions
    inputs: dict[str, list[parquet.DataFile]]  # split -> files
    tokenizer_json: Optional[str]  # a tokenizer file's content (None: trained during preparation)
    eos_id: int
    root: str

    @property
    def width(self) -> int:
        return self.options.seq_len + 1

    @property
    def group_rows(self) -> int:
        return rows_per_group(self.width, sum(f.size for f in self.inputs["train"]), self.options.partitions)

    def folder(self, split: str) -> str:
        return storage.join(self.root, split)

    def tasks(self) -> list[FileTask]:
        """The files not yet tokenized."""
        return [FileTask(f.uri, format_of(f.uri, self.options.format), self.folder(split))
                for split, files in self.inputs.items() for f in files if not is_done(self.folder(split), f.uri)]

    def prepared(self) -> bool:
        from training.data.prepare import MANIFEST

        return storage.exists(storage.join(self.root, MANIFEST))


def options_of(data: DataConfig) -> TextOptions:
    try:
        return TextOptions.model_validate(data.options)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc, "data.options", TextOptions).strip()) from None


def stdlib_files() -> list[parquet.DataFile]:
    from training.data.sources import stdlib_source_files

    files = []
    for path in stdlib_source_files():
        stat = path.stat()
        files.append(parquet.DataFile(str(path), stat.st_size, stat.st_mtime_ns, {}))
    return files


def list_inputs(paths, exclude: list[str], option: str) -> list[parquet.DataFile]:
    listed = []
    try:
        for spec in parquet._as_list(paths):
            listed += stdlib_files() if spec == STDLIB else parquet.list_files(spec)
    except parquet.DataError as exc:
        raise UserError(f"data.options.{option}: {exc}") from None
    except OSError as exc:
        raise UserError(f"data.options.{option}: {str(exc).splitlines()[0][:300]}") from None
    files = [f for f in {f.uri: f for f in listed}.values() if not any(fnmatch(f.uri, p) for p in exclude)]
    if not files:
        raise UserError(f"data.options.{option}: no files under {', '.join(parquet._as_list(paths))}"
                        + (f" once data.options.exclude {exclude} is applied" if exclude else ""))
    return sorted(files, key=lambda f: f.uri)


def within_bytes(files: list[parquet.DataFile], max_bytes: Optional[int]) -> list[parquet.DataFile]:
    """Whole files, by a hash of their path, until max_bytes (at least one file)."""
    if max_bytes is None:
        return files
    chosen, total = [], 0
    for file in hash_rank(files):
        if chosen and total + file.size > max_bytes:
            continue
        chosen.append(file)
        total += file.size
    return sorted(chosen, key=lambda f: f.uri)


def check_first_records(files: list[parquet.DataFile], options: TextOptions, option: str) -> None:
    """A cheap look at each jsonl and Parquet file (its first batch): a missing field or column is
    refused now; the rest of a jsonl file is checked as it is tokenized."""
    from training.data.tokenize import documents

    for file in files:
        fmt = format_of(file.uri, options.format)
        if fmt == "text":
            continue
        try:
            next(iter(documents(file.uri, fmt, options.text_column, limit_bytes=1)), None)
        except DataError as exc:
            raise UserError(f"data.options.{option}: {exc}") from None


def plan(data: DataConfig, cache_root: str) -> TextPlan:
    """Every check a user can fail, without Ray and without writing anything; where the data goes."""
    options = options_of(data)
    train = within_bytes(list_inputs(options.path, options.exclude, "path"), options.max_bytes)
    if options.validation_path is not None:
        validation = list_inputs(options.validation_path, options.exclude, "validation_path")
        option = "validation_path"
    else:
        option = "validation_fraction"
        try:
            chosen = parquet.validation_files(train, options.validation_fraction)
        except parquet.DataError as exc:
            raise UserError(f"data.options.validation_fraction: {exc}") from None
        validation, train = [f for f in train if f.uri in chosen], [f for f in train if f.uri not in chosen]
    if not sum(f.size for f in validation):
        raise UserError(f"data.options.{option}: the validation split is empty ({len(validation)} files, no bytes: "
                        f"{', '.join(f.uri for f in validation[:3])})")
    check_first_records(train, options, "path")
    check_first_records(validation, options, option)
    tokenizer_json, eos_id = load_tokenizer(options)
    tokenizer_digest = hashlib.sha256((tokenizer_json or "").encode()).hexdigest()
    ident = json.dumps({"format": TEXT_FORMAT, "options": options.model_dump(mode="json", exclude={"tokenize_on"}), "tokenizer": tokenizer_digest,
                        "train": parquet.digest(train), "validation": parquet.digest(validation)}, sort_keys=True)
    root = storage.join(cache_root, f"{SOURCE}-{hashlib.sha256(ident.encode()).hexdigest()[:16]}")
    return TextPlan(options, {"train": train, "validation": validation}, tokenizer_json, eos_id, root)


def wants_cluster(text_plan: TextPlan) -> bool:
    """Whether preparing this data would use a Ray cluster if one were up (the driver opens its Ray
    session before preparing, then)."""
    if text_plan.prepared():
        return False
    pending = pending_bytes(text_plan.inputs, text_plan.tasks())
    return decide_where(text_plan.options.tokenize_on, pending, cluster_up=True) == "cluster"


def check_unchanged(recorded_root: Optional[str], data: DataConfig, cache_root: str,
                    text_plan: Optional[TextPlan] = None) -> None:
    """A resumed run's text must be the text it started on: the same inputs and tokenizer give the same
    key (re-tokenizing changed text would silently train the rest of the run on other rows)."""
    if not recorded_root:
        return
    if not same_dataset(recorded_root, (text_plan or plan(data, cache_root)).root):
        raise UserError("data.options.path: the text changed since the run started (a file new, gone, or with another "
                        "size or modification time, or another tokenizer file): resuming would train on other rows; "
                        "restore it, or start a new run (--name)")


# -- tokenizing, indexing ------------------------------------------------------------------------

def tokenize_in_driver(tasks: list[FileTask], tokenizer_json: str, eos_id: int, width: int, group: int,
                       text_column: str, on_file: Optional[Callable[[dict], None]] = None) -> list[dict]:
    """A file at a time; `on_file(counts)` after each."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_str(tokenizer_json)
    results = []
    for task in tasks:
        results.append(tokenize_file(task, tokenizer, eos_id, width, group, text_column))
        if "error" in results[-1]:
            break
        if on_file is not None:
            on_file(results[-1])
    return results


def tokenize_on_cluster(tasks: list[FileTask], sizes: dict[str, int], tokenizer_json: str, eos_id: int, width: int,
                        group: int, text_column: str) -> list[dict]:
    """Each file tokenized by a Ray Data task on any node (see prepare.files_on_cluster)."""
    from training.data.prepare import files_on_cluster

    def work(tasks: list[FileTask]) -> list[dict]:
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_str(tokenizer_json)
        return [tokenize_file(task, tokenizer, eos_id, width, group, text_column) for task in tasks]

    return files_on_cluster(tasks, sizes, work)


def prepare(data: DataConfig, cache_root: str, log: Callable[[str], None] = print, check=None,
            text_plan: Optional[TextPlan] = None, on_file: Optional[Callable[[dict], None]] = None):
    """The Manifest of the tokenized data (cached by key; resumed file by file if interrupted).
    `on_file(counts)`: called after each file tokenized in this process."""
    from training.data.prepare import MANIFEST, Manifest, cached

    text_plan = text_plan or plan(data, cache_root)
    options = text_plan.options
    manifest = cached(text_plan.root, check, log, f"text in rows of {text_plan.width} tokens")
    if manifest is not None:
        return manifest
    tokenizer = tokenizer_of(text_plan, log)
    tasks = text_plan.tasks()
    arguments = (tokenizer.to_str(), text_plan.eos_id, text_plan.width, text_plan.group_rows, options.text_column)
    work = do_file_tasks(text_plan.inputs, tasks, options.tokenize_on, "tokenizing",
                         in_driver=lambda: tokenize_in_driver(tasks, *arguments, on_file=on_file),
                         on_cluster=lambda sizes: tokenize_on_cluster(tasks, sizes, *arguments), log=log)
    if work.error:
        split = next(s for s, fs in text_plan.inputs.items() if any(f.uri == work.error["uri"] for f in fs))
        raise UserError(f"data.options.{_files_option(options, split)}: {work.error['error']}")
    if tasks:
        rows, dropped = sum(r["rows"] for r in work.results), sum(r["dropped_tokens"] for r in work.results)
        log(f"data: tokenized {len(tasks)} of {work.files} files ({work.pending_bytes / 1e6:.1f} MB) in "
            f"{work.elapsed_s:.1f} s {work.how}: {rows} rows ({rows / max(work.elapsed_s, 1e-9):.0f} rows/s); "
            f"{dropped} tokens at files' ends dropped (shorter than a row)")
    index_options = parquet.ParquetOptions(
        path=text_plan.folder("train"), validation_path=text_plan.folder("validation"), tokens="tokens",
        vocab_size=tokenizer.get_vocab_size(), partitions=options.partitions,
        shuffle_window=options.shuffle_window, read_ahead=options.read_ahead, read_threads=options.read_threads)
    for split in ("train", "validation"):
        try:
            parquet.list_files(text_plan.folder(split))
        except parquet.DataError:
            raise UserError(f"data.options.{_files_option(options, split)}: the {split} split holds no row: each file has fewer than seq_len + 1 "
                            f"= {text_plan.width} tokens; lower data.options.seq_len or give more text") from None
    index = parquet.build_index(index_options)
    if check is not None:
        check(index["task"], index["spec"], {name: split["rows"] for name, split in index["splits"].items()})
    manifest = Manifest(root=text_plan.root, source=SOURCE, options=index_options.model_dump(mode="json"),
                        task=index["task"], spec=index["spec"], splits=index["splits"], schema=index["schema"],
                        digest=index["digest"], origin={"path": options.path, "validation_path": options.validation_path,
                                                        "tokenizer": options.tokenizer.file or "trained"})
    storage.write_text(storage.join(text_plan.root, MANIFEST), manifest.to_json())
    log(f"data: text prepared at {text_plan.root} ({manifest.rows('train')} train, {manifest.rows('validation')} "
        f"validation rows of {text_plan.width} tokens; vocabulary {manifest.spec['vocab_size']})")
    return manifest


def _files_option(options: TextOptions, split: str) -> str:
    """The option that names a split's files."""
    return "validation_path" if split == "validation" and options.validation_path is not None else "path"
