"""The datasets a run trains and validates on, recorded as the MLflow run's inputs (the run page's
"Datasets used"): where the data is, its digest, schema and row counts. Logged once, when the run
is created (a resumed run already has them: a changed dataset is refused before it resumes)."""

from __future__ import annotations

import json

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


def dataset_inputs(manifest) -> list:
    from mlflow.entities import Dataset, DatasetInput, InputTag  # (lazy: mlflow)

    name = manifest.source.split(":")[-1]
    source_type, source = sources(manifest)
    inputs = []
    for split, context in CONTEXTS.items():
        body = manifest.splits[split]
        files = len(body.get("files", body.get("shards", [])))
        profile = json.dumps({"num_rows": body["rows"], "files": files, "task": manifest.task, **manifest.spec})
        dataset = Dataset(name=f"{name}-{split}", digest=manifest.digest[:16], source_type=source_type,
                          source=source[split], schema=json.dumps({"columns": manifest.schema}), profile=profile)
        inputs.append(DatasetInput(dataset, tags=[InputTag("mlflow.data.context", context)]))
    return inputs


def log_datasets(tracker, manifest, log) -> None:
    """A failure is a warning: the dataset is also in the run's record and summary."""
    try:
        tracker.client.log_inputs(tracker.run_id, datasets=dataset_inputs(manifest))
    except Exception as exc:  # (MLflow away right after the start: the run goes on)
        log(topics.line(topics.TRACKING, f"the datasets were not recorded in MLflow: {first_line(exc, 200)}"))
