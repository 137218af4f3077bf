"""The built-in `parquet` source: Parquet files read where they are (a local or shared folder,
`s3://`, any URI pyarrow opens), never copied. The driver lists them (training/data/files.py) and
indexes their footers (training/data/parquet_index.py): that index is the prepared data, keyed by
the files' digest and the options, so an unchanged dataset is listed again but its footers are not
re-read. The workers stream the training split (training/data/stream.py) and read their validation
rows by position. With a `transform`, a plug-in's output is trained on instead
(training/data/transform.py), streamed the same way.

Columns, by task:
- classification: `features` (a list of numeric columns, or one list column) and `label`;
- language_model: `tokens` (one list column of token ids, every row the same length);
- image_classification: `image` (encoded images, decoded on the workers: training/data/image.py) and
  `label`. `path: digits_png/train` (and `digits_png/validation`): scikit-learn's digits as PNG files
  written into the data cache (training/data/image_digits.py).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Callable, Literal, Optional, Union

import numpy as np
from pydantic import Field, PrivateAttr, field_validator, model_validator

from training import storage
from training.data import image_digits
from training.data.files import Listing, as_list, list_splits, listed_for
from training.data.image import ImageProcessorOptions, resolve_processor
from training.data.manifest import Manifest, cached, dataset_key
from training.data.order import BatchPlan
from training.data.parquet_checks import MAX_CLASSES
from training.data.parquet_index import Columns, build_index, check_index_unchanged
from training.data.parquet_read import FileReader
from training.data.source import DataCheck, DataSection
from training.data.stream import StreamingShard
from training.data.transform import TransformOptions, TransformPlan, plan_transform
from training.errors import ConfigError, DataError, UserError, first_line
from training.schema import Section, printable

INDEX_FORMAT = 1


class ParquetOptions(Section):
    # A folder, a glob or a list of them: local paths, s3://bucket/prefix, or any pyarrow URI.
    path: Union[str, list[str]]
    # The validation split: its own path, or a fraction of the files (chosen by a hash of each
    # file's path: the same files whatever the listing order, and stable when files are added).
    validation_path: Optional[Union[str, list[str]]] = None
    validation_fraction: Optional[float] = Field(None, gt=0, lt=1)
    # classification: the feature columns (or one list column) and the label column
    features: Optional[Union[str, list[str]]] = None
    label: Optional[str] = None
    # language_model: a list column of token ids
    tokens: Optional[str] = None
    # image_classification (with label): a column of encoded images (PNG, JPEG: binary, or {bytes, path}
    # structs), decoded on the workers and prepared by image_processor (default: its defaults).
    image: Optional[str] = None
    image_processor: Optional[ImageProcessorOptions] = None
    # Hive partitions to read: {key: value or [values]}; the others are not even listed for reading.
    filter: dict[str, Union[str, int, list[Union[str, int]]]] = Field(default_factory=dict)
    # The order is a pure function of the data, the seed and this number, never of the world size:
    # each worker reads about 1/W of an epoch (exactly when W divides it). At most the batch size.
    partitions: int = Field(16, ge=1, le=65536)
    # Rows are shuffled within windows of this many row groups of a partition (memory: about
    # 2 * window row groups per partition a worker reads).
    shuffle_window: int = Field(2, ge=1, le=1024)
    # Read the next steps' row groups in the background while these steps train, on this many
    # threads (each decodes a row group at a time; more for object storage, whose reads wait on the
    # network).
    read_ahead: bool = True
    read_threads: int = Field(2, ge=1, le=64)
    # When the files carry no statistics for them: classes of the label / the token vocabulary.
    num_classes: Optional[int] = Field(None, ge=2, le=MAX_CLASSES)
    vocab_size: Optional[int] = Field(None, ge=2)
    # Prepare the data with a plug-in first (features, label and tokens then name its output's columns).
    transform: Optional[TransformOptions] = None

    @field_validator("path", "validation_path")
    def _printable(cls, value):
        for each in as_list(value) if value is not None else []:
            printable(each)
        return value

    @model_validator(mode="after")
    def _task_columns(self):
        if self.image is not None:
            if self.label is None or self.tokens is not None or self.features is not None:
                raise ValueError("image is for image classification: set it with label (and neither tokens nor "
                                 "features)")
        elif self.image_processor is not None:
            raise ValueError("image_processor prepares the images of the image column: set image too")
        elif self.tokens is None and (self.features is None or self.label is None):
            raise ValueError("set either tokens (language data), features and label (classification), or image and "
                             "label (image classification)")
        if self.tokens is not None and (self.features is not None or self.label is not None):
            raise ValueError("tokens is for language data; features and label for classification: not both")
        if self.validation_path is None and self.validation_fraction is None:
            raise ValueError("set validation_path or validation_fraction")
        if self.validation_path is not None and self.validation_fraction is not None:
            raise ValueError("set validation_path or validation_fraction, not both")
        return self

    def columns(self, image_settings: Optional[dict] = None, image_shape: Optional[tuple] = None) -> Columns:
        """The columns read; an image column's with the resolved processor settings (training/data/image.py)."""
        features = tuple(as_list(self.features)) if self.features is not None else ()
        return Columns(tokens=self.tokens, features=features, label=self.label, image=self.image,
                       image_processor=json.dumps(image_settings, sort_keys=True) if image_settings else None,
                       channels=self.processor_options.channels, image_shape=image_shape)

    @property
    def processor_options(self) -> ImageProcessorOptions:
        return self.image_processor or ImageProcessorOptions()

    def listing(self) -> Listing:
        """The files, listed once (DataError if there are none)."""
        return list_splits(self.path, self.validation_path, self.validation_fraction, self.filter)


def index_of(options: ParquetOptions, listing: Optional[Listing] = None) -> dict:
    """The index of the files (listed now, unless given) from their footers (DataError: the data)."""
    return build_index(listing or options.listing(), options.columns(), options.num_classes, options.vocab_size)


class ParquetData(DataSection):
    source: Literal["parquet"] = "parquet"
    options: ParquetOptions
    # model.options.pretrained, for image_processor.from_model: set by the job config (bind_model).
    _model_folder: Optional[str] = PrivateAttr(None)

    @property
    def model_folder(self) -> Optional[str]:
        return self._model_folder

    def bind_model(self, model) -> None:
        """The job's model section, for image_processor.from_model: an `hf` model from a pretrained
        folder (ConfigError: exit 2)."""
        if not self.options.processor_options.from_model:
            return
        folder = getattr(model.options, "pretrained", None) if model.name == "hf" else None
        if not folder:
            raise ConfigError("data.options.image_processor.from_model: the settings are read from the "
                              "preprocessor_config.json of model.options.pretrained (model.name hf), which "
                              f"{'is not set' if model.name == 'hf' else 'model.name ' + model.name + ' has not'}; "
                              "give data.options.image_processor's size, image_mean and image_std instead")
        self._model_folder = folder


@dataclass(frozen=True)
class IndexPlan:
    """Parquet read in place: the files as listed, and where their index goes."""

    section: ParquetData
    listing: Listing
    root: str
    columns: Columns

    @property
    def options(self) -> ParquetOptions:
        return self.section.options

    @property
    def task(self) -> str:
        return self.options.columns().task

    @property
    def batch_partitions(self) -> int:
        return self.options.partitions

    def check_unchanged(self, recorded_root: Optional[str]) -> None:
        """A resumed run's data must be the data it started on: exit 2 naming a file that changed."""
        check_index_unchanged(recorded_root, self.listing)

    def wants_cluster(self) -> bool:
        return False

    def prepare(self, check: Optional[DataCheck], log: Callable[[str], None]) -> Manifest:
        where = ", ".join(as_list(self.options.path))
        manifest = cached(self.root, check, log, f"{where} indexed")
        if manifest is not None:
            return manifest
        try:
            index = build_index(self.listing, self.columns, self.options.num_classes, self.options.vocab_size)
        except DataError as exc:  # (a column's problem names its option: data.options.label, ...)
            raise UserError(f"{getattr(exc, 'option', 'data.options.path')}: {exc}") from None
        except OSError as exc:
            raise UserError(f"data.options.path: {first_line(exc)}") from None
        if check is not None:
            check(index["task"], index["spec"], {name: split["rows"] for name, split in index["splits"].items()})
        manifest = Manifest(root=self.root, source=self.section.source, options=self.section.options_as_written(),
                            task=index["task"], spec=index["spec"], splits=index["splits"], schema=index["schema"],
                            digest=index["digest"])
        manifest.write()
        files = sum(len(s["files"]) for s in index["splits"].values())
        groups = sum(len(f["row_groups"]) for s in index["splits"].values() for f in s["files"])
        log(f"data: {where} indexed at {self.root} ({manifest.rows('train')} train, {manifest.rows('validation')} "
            f"validation rows; {files} files, {groups} row groups; read in place)")
        return manifest


class ParquetSource:
    name = "parquet"
    Config = ParquetData

    def plan(self, section: ParquetData, cache_root: str) -> IndexPlan | TransformPlan:
        section = image_digits.in_place(section, cache_root)  # (path: digits_png/...: written into the cache)
        options = section.options
        columns = options.columns()
        if options.image is not None:  # (the processor's settings resolved here, once: the workers' and the key's)
            columns = options.columns(resolve_processor(options.processor_options, section.model_folder))
        if options.transform is not None:  # a plug-in's output, streamed like the input
            return plan_transform(options, columns, cache_root)
        listing = listed_for("data.options.path", options.listing)
        digest = hashlib.sha256(f"{INDEX_FORMAT}:{listing.digest}{columns.image_processor or ''}".encode()).hexdigest()
        key = dataset_key(section.source, section.options_as_written(), section.num_shards, digest)
        return IndexPlan(section, listing, storage.join(cache_root, f"{self.name}-{key}"), columns)

    def plugins(self, section: ParquetData) -> list[str]:
        return [section.options.transform.function] if section.options.transform else []

    def track(self, tracker, manifest: Manifest, log: Callable[[str], None]) -> None:
        """(Nothing beyond the datasets.)"""

    def open(self, manifest: Manifest, plan: BatchPlan, seed: int) -> StreamingShard:
        return open_stream(manifest, plan, seed)

    def rows(self, manifest: Manifest, split: str) -> "IndexedRows":
        return IndexedRows(manifest, split)


def index_options(manifest: Manifest) -> ParquetOptions:
    """The options an index was written with (its columns, the streaming settings)."""
    return ParquetOptions.model_validate(manifest.options)


def columns_of(manifest: Manifest) -> Columns:
    """The columns the workers read: an image column's with the settings the driver resolved and
    the images' shape (the data's spec)."""
    spec = manifest.spec
    if "image_processor" not in spec:
        return index_options(manifest).columns()
    return index_options(manifest).columns(spec["image_processor"], (spec["channels"], spec["height"], spec["width"]))


class IndexedRows:
    """Rows of one split of an index by position (validation, a sample for the model's signature)."""

    def __init__(self, manifest: Manifest, split: str):
        self._reader = FileReader(manifest.splits[split], columns_of(manifest))
        self.num_rows = manifest.rows(split)

    def take(self, indices) -> dict[str, np.ndarray]:
        return self._reader.take(np.asarray(indices, dtype=np.int64))


def open_stream(manifest: Manifest, plan: BatchPlan, seed: int) -> StreamingShard:
    """This worker's part of every global batch of an index's training split, streamed."""
    options = index_options(manifest)
    reader = FileReader(manifest.splits["train"], columns_of(manifest))
    return StreamingShard(reader.groups, reader.load, plan, seed=seed, partitions=options.partitions,
                          window=options.shuffle_window, read_ahead=options.read_ahead,
                          read_threads=options.read_threads, on_close=reader.close)


SOURCE = ParquetSource()
