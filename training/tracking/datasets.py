"""The datasets a run trains and validates on, recorded as the MLflow run's inputs (the run page's
"Datasets used"): where the data is, its digest, schema and row counts. Logged once, when the run
is created (a resumed run already has them: a changed dataset is refused before it resumes)."""

from __future__ import annotations

import json
import re
from typing import Optional

from training import topics
from training.errors import first_line
from training.redaction import redact, redact_values

CONTEXTS = {"train": "training", "validation": "validation"}


def sources(manifest) -> tuple[str, dict[str, str]]:
    """(source type, each split's source): a JSON object whose `uri` is the data's location as
    written in the config (a string, or a list of them), with the partition `filter` that chose
    its files when there is one; passwords in URIs redacted."""
    origin = manifest.origin
    if origin is not None:  # prepared from other data (text tokenized, Parquet transformed)
        written = origin
        common = {"prepared": manifest.root, **{k: v for k, v in origin.items() if k in ("transform", "tokenizer")}}
    elif manifest.streamed:  # read in place: the data's own location
        written, common = manifest.options, {"index": manifest.root}
    else:
        return "prepared-parquet", dict.fromkeys(CONTEXTS, json.dumps({"uri": redact(manifest.root)}))
    by_split = {}
    for split in CONTEXTS:
        own = split == "validation" and written.get("validation_path") is not None
        body = {"uri": written.get("validation_path" if own else "path")}
        if written.get("filter"):
            body["filter"] = written["filter"]
        if split == "validation" and not own and written.get("validation_fraction") is not None:
            body["validation_fraction"] = written["validation_fraction"]
        by_split[split] = json.dumps(redact_values({**body, **common}))
    return "parquet", by_split


# Arrow's type names (as pyarrow writes them) by MLflow's column types; lists become MLflow arrays.
_MLFLOW_TYPES = {"boolean": ("bool",), "integer": ("int8", "int16", "int32", "uint8", "uint16"),
                 "long": ("int64", "uint32", "uint64"), "float": ("halffloat", "float16", "float"),
                 "double": ("double",), "string": ("string", "large_string", "utf8"),
                 "binary": ("binary", "large_binary")}
_BY_ARROW = {arrow: mlflow for mlflow, names in _MLFLOW_TYPES.items() for arrow in names}
_LIST = re.compile(r"^(?:large_|fixed_size_)?list<(?:item|element): (?P<item>.*?)(?: not null)?>(?:\[\d+\])?$")


def _top_level_fields(arrow_schema: str) -> list[tuple[str, str]]:
    """(name, type) of each top-level field of a schema as the manifest holds it: pyarrow's
    `Schema.to_string()` (a field a line, its children indented below it) or `name: type, ...`."""
    fields = []
    for line in arrow_schema.split("\n-- ")[0].splitlines():  # (then pyarrow's metadata, if any)
        if line[:1].isspace():  # a field's children
            continue
        depth, start = 0, 0
        for at, char in enumerate(line + ","):
            depth += (char in "<[(") - (char in ">])")
            if depth == 0 and char == ",":
                name, _, kind = line[start:at].strip().partition(": ")
                if name:
                    fields.append((name, kind.strip()))
                start = at + 1
    return fields


def _mlflow_type(arrow_type: str):
    from mlflow.types.schema import Array, DataType  # (lazy: mlflow)

    listed = _LIST.match(arrow_type)
    if listed:
        item = _mlflow_type(listed.group("item"))
        return Array(item) if item is not None else None
    if arrow_type.startswith(("timestamp[", "date32", "date64")):
        return DataType.datetime
    if arrow_type.startswith("fixed_size_binary"):
        return DataType.binary
    found = _BY_ARROW.get(arrow_type.removesuffix(" not null"))
    return DataType[found] if found else None


def mlflow_schema(arrow_schema: str) -> Optional[str]:
    """The columns as MLflow's own datasets record them, `{"mlflow_colspec": [{"name", "type", ...}]}`:
    the form the run page's dataset drawer shows as a table. A column of a type MLflow has no name
    for is left out (the profile holds the schema as Arrow writes it)."""
    from mlflow.types.schema import ColSpec, Schema  # (lazy: mlflow)

    columns = [ColSpec(kind, name) for name, kind in ((n, _mlflow_type(t)) for n, t in _top_level_fields(arrow_schema))
               if kind is not None]
    return json.dumps({"mlflow_colspec": Schema(columns).to_dict()}) if columns else None


def dataset_inputs(manifest) -> list:
    from mlflow.entities import Dataset, DatasetInput, InputTag  # (lazy: mlflow)

    name = manifest.source.split(":")[-1]
    source_type, source = sources(manifest)
    inputs = []
    for split, context in CONTEXTS.items():
        body = manifest.splits[split]
        files = len(body.get("files", body.get("shards", [])))
        profile = json.dumps({"num_rows": body["rows"], "files": files, "task": manifest.task, **manifest.spec,
                              "arrow_schema": manifest.schema})
        dataset = Dataset(name=f"{name}-{split}", digest=manifest.digest[:16], source_type=source_type,
                          source=source[split], schema=mlflow_schema(manifest.schema), profile=profile)
        inputs.append(DatasetInput(dataset, tags=[InputTag("mlflow.data.context", context)]))
    return inputs


def log_datasets(tracker, manifest, log) -> None:
    """A failure is a warning: the dataset is also in the run's record and summary."""
    try:
        tracker.client.log_inputs(tracker.run_id, datasets=dataset_inputs(manifest))
    except Exception as exc:  # (MLflow away right after the start: the run goes on)
        log(topics.line(topics.TRACKING, f"the datasets were not recorded in MLflow: {first_line(exc, 200)}"))
