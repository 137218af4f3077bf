"""The built-in `text` source (the driver). Text files (.txt or any other extension: one
document per file), JSON Lines (one document per line, in a field; plain, gzip or zstd) or Parquet
(a text column) tokenized with a Hugging Face `tokenizers` file, the pretrained model's own
tokenizer (`tokenizer: {from_model: true}`, training/data/model_tokenizer.py), or a byte-level BPE
trained here on a deterministic sample of the training files, packed into rows of seq_len + 1
token ids and written as Parquet that workers stream exactly like the `parquet` source's `tokens`
column. With `label_column`, the rows are a classification table instead, one document per row
(training/data/text_classify.py); with `format: chat`, conversations rendered with a chat template and
packed (training/data/chat.py).

Each input file is tokenized by the file-by-file pipeline (training/data/file_work.py), into
`<cache_root>/text-<key>/`, beside the tokenizer the ids come from (`tokenizer.json`). `key` digests
the inputs' listing (paths, sizes, modification times), the options and the tokenizer.

`SOURCE.plan` makes every check a user can fail (paths, options, the tokenizer file, an empty
validation split) without Ray; `TextPlan.prepare` does the work.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from fnmatch import fnmatch
from typing import Callable, Literal, Optional, Union

from pydantic import Field, PrivateAttr, model_validator

from training import storage
from training.data import chat, stdlib_chat, stdlib_docstrings
from training.data.chat import ChatOptions
from training.data.file_work import (
    FilePlan,
    FileTask,
    check_cache_dir,
    do_file_tasks,
    files_on_cluster,
    index_output,
    output_manifest,
)
from training.data.files import DataFile, as_list, digest, list_files, listed_for, split_listing
from training.data.manifest import Manifest, cached
from training.data.order import BatchPlan
from training.data.parquet import IndexedRows, ParquetOptions, open_stream
from training.data.parquet_index import Columns
from training.data.shards import SplitReader, TrainShard
from training.data.source import DataCheck, DataSection
from training.data.stream import StreamingShard
from training.data.text_classify import prepare_table
from training.data.text_read import documents, format_of, records
from training.data.tinylm import stdlib_source_files
from training.data.tokenize import packing, rows_per_group, tokenize_file
from training.data.tokenizer import ChosenTokenizer, hash_rank, load_tokenizer, log_tokenizer, tokenizer_of
from training.errors import ConfigError, DataError, UserError
from training.schema import Section
from training.tasks import LANGUAGE_MODEL, PACKED_LANGUAGE_MODEL, SEQUENCE_CLASSIFICATION

TEXT_FORMAT = 1
STDLIB = "stdlib"  # path: the Python standard library's own .py files (site-packages left out)
# path: stdlib_docstrings/train, validation_path: stdlib_docstrings/validation: a classification table of
# the standard library's docstrings by package (training/data/stdlib_docstrings.py)
STDLIB_DOCSTRINGS = stdlib_docstrings.NAME
# path: stdlib_chat/train, validation_path: stdlib_chat/validation (format: chat): conversations about the
# standard library's functions (training/data/stdlib_chat.py)
GENERATED = {STDLIB_DOCSTRINGS: stdlib_docstrings.ensure, stdlib_chat.NAME: stdlib_chat.ensure}


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
    # Or the tokenizer of the pretrained model (`model.name: hf`, its `model.options.pretrained` folder):
    # its tokenizer.json, end token and padding token, its ids checked against the model's embeddings.
    from_model: bool = False

    @model_validator(mode="after")
    def _one(self):
        if (self.file is not None) + (self.train is not None) + self.from_model != 1:
            raise ValueError("give one of file (a tokenizer.json), train ({vocab_size, sample_bytes}) or "
                             "from_model: true")
        return self


class TextOptions(Section):
    # A folder, a glob, a file or a list of them (local, s3://, Hive layouts), or `stdlib`.
    path: Union[str, list[str]]
    # Paths left out: fnmatch patterns on the full path, e.g. "*/site-packages/*".
    exclude: list[str] = Field(default_factory=list)
    # The validation split: its own path, or a fraction of the files (as the parquet source does).
    validation_path: Optional[Union[str, list[str]]] = None
    validation_fraction: Optional[float] = Field(None, gt=0, lt=1)
    # auto: .jsonl/.ndjson (also .gz or .zst, and C4's .json.gz) -> jsonl, .parquet/.pq -> parquet, anything
    # else -> text (one document per file). chat: conversations in JSON Lines or Parquet files (see `chat`).
    format: Literal["auto", "text", "jsonl", "parquet", "chat"] = "auto"
    # format: chat: how conversations are rendered, what the loss learns, packing (training/data/chat.py).
    chat: Optional[ChatOptions] = None
    # The field (jsonl) or column (parquet) holding each document's text.
    text_column: str = "text"
    # A classification table: the field (jsonl) or column (parquet) holding each document's label,
    # an integer class id (from 0) or a class name (names are numbered in sorted order). Each row is
    # then one document, truncated or padded to seq_len tokens (the sequence_classification task).
    label_column: Optional[str] = None
    # Tokens per training sequence; each row holds seq_len + 1 ids (with label_column: seq_len).
    seq_len: int = Field(256, ge=8, le=65536)
    tokenizer: TokenizerOptions
    # The end-of-document token of a tokenizer file (default: the first it has of EOS_CANDIDATES), or of
    # the model's tokenizer (default: its tokenizer_config.json's eos_token).
    eos_token: Optional[str] = None
    # The token a classification table's rows are padded with (default: the tokenizer's own padding
    # token, else its end token; the attention column marks the padding either way).
    pad_token: Optional[str] = None
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
        if self.label_column is not None and self.tokenize_on == "cluster":
            raise ValueError("tokenize_on: cluster is for language data; a classification table (label_column) is "
                             "tokenized in this process")
        if self.chat is not None and self.format != "chat":
            raise ValueError(f"chat is for format: chat, but format is {self.format}")
        if self.format == "chat":
            chat.check_options(self)
        return self


class TextData(DataSection):
    source: Literal["text"] = "text"
    options: TextOptions
    # model.options.pretrained, for tokenizer.from_model: set by the job config (bind_model), which
    # alone sees both sections.
    _model_folder: Optional[str] = PrivateAttr(None)

    @property
    def model_folder(self) -> Optional[str]:
        return self._model_folder

    def bind_model(self, model) -> None:
        """The job's model section (`model.name`, `model.options`), for tokenizer.from_model: it must be
        an `hf` model from a pretrained folder (ConfigError: exit 2)."""
        if not self.options.tokenizer.from_model:
            return
        if model.name != "hf":
            raise ConfigError("data.options.tokenizer.from_model: the tokenizer is taken from model.options."
                              f"pretrained of an hf model, but model.name is {model.name}; give "
                              "data.options.tokenizer.file or train instead")
        folder = getattr(model.options, "pretrained", None)
        if not folder:
            raise ConfigError("data.options.tokenizer.from_model: model.options.pretrained is not set (the model is "
                              "built from model.options.config): there is no folder to take the tokenizer from; give "
                              "data.options.tokenizer.file or train instead")
        self._model_folder = folder


@dataclass(frozen=True)
class TextPlan(FilePlan):
    options: TextOptions
    tokenizer: ChosenTokenizer
    num_shards: int  # (a classification table's shards: data.num_shards)
    chat_template: Optional[tuple[str, str]] = None  # format: chat: (the template, where it comes from)

    @property
    def classifies(self) -> bool:
        return self.options.label_column is not None

    @property
    def chats(self) -> bool:
        return self.options.format == "chat"

    @property
    def task(self) -> str:
        return (SEQUENCE_CLASSIFICATION if self.classifies else PACKED_LANGUAGE_MODEL if self.chats
                else LANGUAGE_MODEL).name

    @property
    def batch_partitions(self) -> Optional[int]:
        return None if self.classifies or self.chats else self.options.partitions

    @property
    def width(self) -> int:
        return self.options.seq_len + 1

    @property
    def group_rows(self) -> int:
        return rows_per_group(self.width, sum(f.size for f in self.inputs["train"]), self.options.partitions)

    def fmt(self, uri: str) -> str:
        return format_of(uri, self.options.format)

    changed_message = ("the text changed since the run started (a file new, gone, or with another size or "
                       "modification time, or another tokenizer file): resuming would train on other rows; restore "
                       "it, or start a new run (--name)")

    def prepare(self, check: Optional[DataCheck], log: Callable[[str], None],
                on_file: Optional[Callable[[dict], None]] = None) -> Manifest:
        """The Manifest of the tokenized data (cached by key; resumed file by file if interrupted).
        `on_file(counts)`: called after each file tokenized in this process."""
        if self.classifies:
            return prepare_table(self, check, log)
        if self.chats:
            return chat.prepare_chat(self, check, log)
        options = self.options
        manifest = cached(self.root, check, log, f"text in rows of {self.width} tokens ready")
        if manifest is not None:
            return manifest
        tokenizer = tokenizer_of(self, log)
        tasks = self.tasks()
        arguments = (tokenizer.to_str(), self.tokenizer.eos_id, self.width, self.group_rows, options.text_column)
        bos_id = self.tokenizer.bos_id
        work = do_file_tasks(self, tasks, "tokenizing",
                             in_driver=lambda: tokenize_in_driver(tasks, *arguments, on_file=on_file, bos_id=bos_id),
                             on_cluster=lambda sizes: tokenize_on_cluster(tasks, sizes, *arguments, bos_id=bos_id),
                             log=log)
        if work.error:
            split, message = self.split_of(work.error["uri"]), work.error["error"]
            raise UserError(message if message.startswith("data.options.")  # (it names its option)
                            else f"data.options.{self.files_option(split)}: {message}")
        if tasks:
            rows, dropped = sum(r["rows"] for r in work.results), sum(r["dropped_tokens"] for r in work.results)
            log(f"data: tokenized {len(tasks)} of {work.files} files ({work.pending_bytes / 1e6:.1f} MB) in "
                f"{work.elapsed_s:.1f} s {work.how}: {rows} rows ({rows / max(work.elapsed_s, 1e-9):.0f} rows/s); "
                f"{dropped} tokens at files' ends dropped (shorter than a row)")
        vocab_size = self.tokenizer.model_vocab_size or tokenizer.get_vocab_size()  # (the model's embedding rows)
        index = index_output(self, Columns(tokens="tokens"), lambda split: UserError(
            f"data.options.{self.files_option(split)}: the {split} split holds no row: each file has fewer than "
            f"seq_len + 1 = {self.width} tokens; lower data.options.seq_len or give more text"),
            lambda problem: f"data (text): {problem}", vocab_size=vocab_size)
        if check is not None:
            check(index["task"], index["spec"], {name: split["rows"] for name, split in index["splits"].items()})
        index_options = ParquetOptions(
            path=self.folder("train"), validation_path=self.folder("validation"), tokens="tokens",
            vocab_size=vocab_size, partitions=options.partitions,
            shuffle_window=options.shuffle_window, read_ahead=options.read_ahead, read_threads=options.read_threads)
        manifest = output_manifest(self, SOURCE.name, index, index_options.model_dump(mode="json"), origin={
            "path": options.path, "validation_path": options.validation_path,
            "tokenizer": self.tokenizer.origin, "bos_id": self.tokenizer.bos_id, "eos_id": self.tokenizer.eos_id})
        log(f"data: text prepared at {self.root} ({manifest.rows('train')} train, {manifest.rows('validation')} "
            f"validation rows of {self.width} tokens; vocabulary {manifest.spec['vocab_size']})")
        return manifest

    def files_option(self, split: str) -> str:
        """The option that names a split's files."""
        return "validation_path" if split == "validation" and self.options.validation_path is not None else "path"




def stdlib_files() -> list[DataFile]:
    files = []
    for path in stdlib_source_files():
        stat = path.stat()
        files.append(DataFile(str(path), stat.st_size, stat.st_mtime_ns, {}))
    return files


def _listed(spec: str, cache_root: str) -> list[DataFile]:
    if spec == STDLIB:
        return stdlib_files()
    if spec.split("/", 1)[0] in GENERATED:  # (stdlib_docstrings/train, stdlib_chat/validation, ...)
        return list_files(storage.join(GENERATED[spec.split("/", 1)[0]](cache_root), *spec.split("/")[1:]))
    return list_files(spec)


def list_inputs(paths, exclude: list[str], option: str, cache_root: str) -> list[DataFile]:
    listed = listed_for(f"data.options.{option}", lambda: [
        f for spec in as_list(paths) for f in _listed(spec, cache_root)])
    files = [f for f in {f.uri: f for f in listed}.values() if not any(fnmatch(f.uri, p) for p in exclude)]
    if not files:
        raise UserError(f"data.options.{option}: no files under {', '.join(as_list(paths))}"
                        + (f" once data.options.exclude {exclude} is applied" if exclude else ""))
    return sorted(files, key=lambda f: f.uri)


def within_bytes(files: list[DataFile], max_bytes: Optional[int]) -> list[DataFile]:
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


def check_first_records(files: list[DataFile], options: TextOptions, option: str) -> None:
    """A cheap look at each jsonl and Parquet file (its first batch): a missing field or column is
    refused now; the rest of a jsonl file is checked as it is tokenized. A classification table
    takes no text files (one document, no label)."""
    for file in files:
        fmt = format_of(file.uri, options.format)
        if fmt == "chat" or (fmt == "text" and options.label_column is None):  # (chat: chat.check_first)
            continue
        try:
            if options.label_column is None:
                next(iter(documents(file.uri, fmt, options.text_column, limit_bytes=1)), None)
            else:
                next(iter(records(file.uri, fmt, options.text_column, options.label_column, limit_bytes=1)), None)
        except DataError as exc:
            if fmt == "text":
                raise UserError(f"data.options.label_column: {exc}") from None
            raise UserError(f"data.options.{option}: {exc}") from None


def tokenize_in_driver(tasks: list[FileTask], tokenizer_json: str, eos_id: int, width: int, group: int,
                       text_column: str, on_file: Optional[Callable[[dict], None]] = None,
                       bos_id: Optional[int] = None) -> list[dict]:
    """A file at a time; `on_file(counts)` after each."""

    tokenizer = packing(tokenizer_json)
    results = []
    for task in tasks:
        results.append(tokenize_file(task, tokenizer, eos_id, width, group, text_column, bos_id))
        if "error" in results[-1]:
            break
        if on_file is not None:
            on_file(results[-1])
    return results


def tokenize_on_cluster(tasks: list[FileTask], sizes: dict[str, int], tokenizer_json: str, eos_id: int, width: int,
                        group: int, text_column: str, bos_id: Optional[int] = None) -> list[dict]:
    """Each file tokenized by a Ray Data task on any node (see file_work.files_on_cluster)."""

    def work(tasks: list[FileTask]) -> list[dict]:
        tokenizer = packing(tokenizer_json)
        return [tokenize_file(task, tokenizer, eos_id, width, group, text_column, bos_id) for task in tasks]

    return files_on_cluster(tasks, sizes, work)


class TextSource:
    name = "text"
    Config = TextData

    def plan(self, section: TextData, cache_root: str) -> TextPlan:
        """Every check a user can fail, without Ray and without writing anything; where the data goes."""
        options = section.options
        if options.tokenizer.from_model and section.model_folder is None:
            raise UserError("data.options.tokenizer.from_model: this data section was not given the job's model "
                            "section (model.options.pretrained): validate the whole job config")
        train = within_bytes(list_inputs(options.path, options.exclude, "path", cache_root), options.max_bytes)
        if options.validation_path is not None:
            validation, option = list_inputs(options.validation_path, options.exclude, "validation_path",
                                             cache_root), "validation_path"
        else:
            validation, option = None, "validation_fraction"
        try:
            inputs = split_listing(train, validation, options.validation_fraction).splits
        except DataError as exc:
            raise UserError(f"data.options.validation_fraction: {exc}") from None
        if not sum(f.size for f in inputs["validation"]):
            raise UserError(f"data.options.{option}: the validation split is empty ({len(inputs['validation'])} "
                            f"files, no bytes: {', '.join(f.uri for f in inputs['validation'][:3])})")
        check_first_records(inputs["train"], options, "path")
        check_first_records(inputs["validation"], options, option)
        first = None if options.format == "chat" else next((f for f in inputs["train"] if f.size), None)
        chosen = load_tokenizer(options, first, section.model_folder)  # (chat: chat.check_first encodes)
        tokenizer_digest = hashlib.sha256((chosen.json or "").encode()).hexdigest()
        template = None
        if options.format == "chat":
            template = chat.template_of(options, section.model_folder)
            chat.check_first(inputs, options, chat.Renderer(chosen.json, chosen, *template, options.chat or
                                                            chat.ChatOptions()))
        # (chat unset is left out: the keys of data prepared before it existed stay as they were)
        exclude = {"tokenize_on"} | ({"chat"} if options.chat is None else set())
        ident = {"format": TEXT_FORMAT, "options": options.model_dump(mode="json", exclude=exclude),
                 "tokenizer": tokenizer_digest, "train": digest(inputs["train"]),
                 "validation": digest(inputs["validation"])}
        if options.tokenizer.from_model:  # (the ids' bounds and the separators come from the model's files)
            ident["model"] = [chosen.model_vocab_size, chosen.eos_id, chosen.bos_id, chosen.pad_id]
        if options.label_column is not None or template is not None:
            ident["num_shards"] = section.num_shards
        if template is not None:  # (a folder's own template is not in the options)
            ident["chat_template"] = hashlib.sha256(template[0].encode()).hexdigest()
        key = hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]
        root = storage.join(cache_root, f"{self.name}-{key}")
        check_cache_dir(cache_root, root)
        return TextPlan(inputs, root, "driver" if options.label_column or template else options.tokenize_on,
                        options, chosen, section.num_shards, template)

    def plugins(self, section: TextData) -> list[str]:
        return []

    def track(self, tracker, manifest: Manifest, log: Callable[[str], None]) -> None:
        log_tokenizer(tracker, manifest, log)

    def open(self, manifest: Manifest, plan: BatchPlan, seed: int) -> StreamingShard | TrainShard:
        if not manifest.streamed:  # (a classification table: shards)
            return TrainShard(SplitReader(manifest, "train"), plan, seed)
        return open_stream(manifest, plan, seed)

    def rows(self, manifest: Manifest, split: str) -> IndexedRows | SplitReader:
        return IndexedRows(manifest, split) if manifest.streamed else SplitReader(manifest, split)


SOURCE = TextSource()
