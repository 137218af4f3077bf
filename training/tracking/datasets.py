"""The datasets a run trains and validates on, recorded as the MLflow run's inputs (the run page's
"Datasets used"): where the data is, its digest, schema and row counts. Logged once, when the run
is created (a resumed run already has them: a changed dataset is refused before it resumes)."""

from __future__ import annotations

import json

from training import topics
from training.errors import first_line
from training.redaction import redact

CONTEXTS = {"train": "training", "validation": "validation"}


def dataset_inputs(manifest) -> list:
    from mlflow.entities import Dataset, DatasetInput, InputTag  # (lazy: mlflow)

    name = manifest.source.split(":")[-1]
    if manifest.origin is not None:  # prepared from other data (text tokenized, Parquet transformed)
        source_type = "parquet"
        source = redact(json.dumps({"uri": json.dumps(manifest.origin.get("path")), "prepared": manifest.root,
                                    **{k: v for k, v in manifest.origin.items() if k in ("transform", "tokenizer")}}))
    elif manifest.streamed:  # read in place: the data's own location
        where = manifest.options.get("path")
        source_type, source = "parquet", json.dumps({"uri": redact(json.dumps(where)), "index": redact(manifest.root)})
    else:
        source_type, source = "prepared-parquet", json.dumps({"uri": redact(manifest.root)})
    inputs = []
    for split, context in CONTEXTS.items():
        body = manifest.splits[split]
        files = len(body.get("files", body.get("shards", [])))
        profile = json.dumps({"num_rows": body["rows"], "files": files, "task": manifest.task, **manifest.spec})
        dataset = Dataset(name=f"{name}-{split}", digest=manifest.digest[:16], source_type=source_type, source=source,
                          schema=json.dumps({"columns": manifest.schema}), profile=profile)
        inputs.append(DatasetInput(dataset, tags=[InputTag("mlflow.data.context", context)]))
    return inputs


def log_datasets(tracker, manifest, log) -> None:
    """A failure is a warning: the dataset is also in the run's record and summary."""
    try:
        tracker.client.log_inputs(tracker.run_id, datasets=dataset_inputs(manifest))
    except Exception as exc:  # (MLflow away right after the start: the run goes on)
        log(topics.line(topics.TRACKING, f"the datasets were not recorded in MLflow: {first_line(exc, 200)}"))
