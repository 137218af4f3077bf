"""Config errors that the config alone reveals (a metric the data's task has not, a model for
another task, a micro-batch larger than the batch, more loader partitions than the batch) and
partitions that leave an epoch no whole batch are refused with exit 2 before any data is prepared,
tokenized, transformed or written, and before Ray starts: runs and sweeps alike. A validation split
of fewer rows than workers is no error: the workers without rows add zeros. No Ray."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import CONFIGS, REPO

from training import config as config_lib
from training.errors import ConfigError, UserError
from training.run.driver import run_training
from training.run.paths import default_run_name

SPARK_TABLE = Path(__file__).resolve().parent / "data" / "spark_digits"  # tests/data/make_spark_digits.py
TOKENS_TRANSFORM = '''
import pyarrow as pa


def to_tokens(table):
    return pa.table({"tokens": [[int(v) % 16 for v in row[:9]] for row in table.column("pixels").to_pylist()]})
'''


def files_under(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}


@pytest.fixture
def table(workdir):
    target = workdir / "warehouse" / "digits"
    shutil.copytree(SPARK_TABLE, target)
    return target


@pytest.fixture
def texts(workdir):
    root = workdir / "texts"
    root.mkdir()
    for index in range(4):
        (root / f"doc{index}.txt").write_text(" ".join(["alpha beta gamma delta"] * 200) + f" end{index}")
    return root


def parquet_data(table, partitions=4, **extra) -> str:
    columns = {"tokens": extra.pop("tokens")} if "tokens" in extra else {"features": "pixels", "label": "digit"}
    options = {"path": str(table), **columns, "validation_fraction": 0.25, "partitions": partitions, **extra}
    return f"data.options={options}"


def text_data(texts) -> list[str]:
    options = {"path": str(texts), "validation_fraction": 0.5, "seq_len": 16, "partitions": 2,
               "tokenizer": {"train": {"vocab_size": 300, "sample_bytes": 10_000}}}
    return ["data.source=text", f"data.options={options}"]


CASES = [
    ("val_accuracy score on language-model data", "tinylm.yaml", lambda w: ["checkpoint.score_metric=val_accuracy"],
     ConfigError, "checkpoint.score_metric: 'val_accuracy' is not a validation metric of language_model data"),
    ("val_accuracy early stopping on text", "tinylm.yaml",
     lambda w: [*text_data(w["texts"]), "train.early_stopping={metric: val_accuracy, mode: max}"],
     ConfigError, "train.early_stopping.metric: 'val_accuracy' is not a validation metric of language_model data"),
    ("a classifier on a language-model transform", "digits.yaml",
     lambda w: ["data.source=parquet", parquet_data(w["table"], tokens="tokens",
                                                     transform={"function": "refusal_transforms:to_tokens"})],
     UserError, "model.name: digits_mlp is for classification data, but the data is language_model"),
    ("a micro-batch larger than the batch", "digits.yaml",
     lambda w: ["train.global_batch_size=32", "train.micro_batch_size=64"],
     ConfigError, "train.micro_batch_size 64 is larger than train.global_batch_size 32"),
    ("more partitions than the batch", "digits.yaml",
     lambda w: ["data.source=parquet", parquet_data(w["table"], partitions=16), "train.global_batch_size=8"],
     ConfigError, "data.options.partitions 16 is more than train.global_batch_size 8"),
    ("more text partitions than the batch", "tinylm.yaml",
     lambda w: [*text_data(w["texts"]), "data.options.partitions=16", "train.global_batch_size=8"],
     ConfigError, "data.options.partitions 16 is more than train.global_batch_size 8"),
    # ~1350 training rows: a batch of 1000 fits once, but 900 partitions of 1 row each give a batch
    # of 2 rows from each partition none of them
    ("partitions that leave no step per epoch", "digits.yaml",
     lambda w: ["data.source=parquet", parquet_data(w["table"], partitions=900), "train.global_batch_size=1000"],
     ConfigError, "data.options.partitions 900: the"),
]


@pytest.mark.parametrize("case,config,overrides,error,message", CASES, ids=[c[0] for c in CASES])
def test_a_config_error_is_refused_before_anything_is_prepared_or_written(workdir, table, texts, monkeypatch,
                                                                          case, config, overrides, error, message):
    plugins = workdir / "plugins"
    plugins.mkdir()
    (plugins / "refusal_transforms.py").write_text(TOKENS_TRANSFORM)
    monkeypatch.syspath_prepend(str(plugins))
    before = files_under(workdir)
    job = config_lib.load(CONFIGS / config, overrides({"table": table, "texts": texts}) + ["scaling.num_workers=2"],
                          name="refused")
    with pytest.raises(error) as refused:
        run_training(job, log=print)
    assert message in str(refused.value)
    assert files_under(workdir) == before  # no data cache, no run directory, no MLflow run


def test_a_sweep_metric_the_data_has_not_is_refused_before_the_data_is_prepared(workdir, texts):
    import yaml

    from tuning import config as sweep_config
    from tuning.sweep import run_sweep

    sweep_file = workdir / "lm_sweep.yaml"
    sweep_file.write_text(yaml.safe_dump({
        "base": str(CONFIGS / "tinylm.yaml"), "set": ["train.max_steps=20", *text_data(texts)],
        "space": {"optim.lr": {"loguniform": [1.0e-4, 1.0e-2]}}, "metric": "val_accuracy", "num_samples": 2}))
    before = files_under(workdir)
    with pytest.raises(ConfigError, match="metric: 'val_accuracy' is not a validation metric of language_model"):
        run_sweep(sweep_config.load(sweep_file), log=print)
    assert files_under(workdir) == before


def test_the_command_exits_2_with_the_message_and_writes_nothing(workdir, texts):
    before = files_under(workdir)
    env = {**os.environ, "TRAINING_BASE_DIR": str(workdir)}
    overrides = [arg for override in text_data(texts) for arg in ("--set", override)]
    result = subprocess.run([sys.executable, "-m", "training", str(CONFIGS / "tinylm.yaml"), *overrides,
                             "--set", "checkpoint.score_metric=val_accuracy"],
                            cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "error: checkpoint.score_metric: 'val_accuracy' is not a validation metric" in result.stderr
    assert files_under(workdir) == before


@pytest.mark.parametrize("file_name", ["my job (1)!.yaml", "日本語.yaml", "--.yaml", "a" * 300 + ".yaml", ".yaml"])
def test_a_default_run_name_is_a_valid_run_name_whatever_the_config_file_is_called(file_name):
    name = default_run_name(file_name)
    assert config_lib.validate({"name": name}).name == name


def test_a_validation_split_of_fewer_rows_than_workers_is_evaluated_by_every_worker(tmp_path):
    """One validation row, three workers: the two without a row score nothing, and the sums the
    workers add are the one row's (the first evaluation crashed with StopIteration)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    import torch

    from training.data.registry import data_section, prepare, source_of
    from training.data.source import validation_part
    from training.models.registry import build_model, model_section
    from training.tasks import TASKS
    from training.worker.evaluate import evaluate
    from training.worker.setup import tensors

    rng = np.random.default_rng(0)

    def rows(count):
        return pa.table({"x": [rng.random(4).tolist() for _ in range(count)], "y": rng.integers(0, 3, count)})

    pq.write_table(rows(64), tmp_path / "train.parquet")
    pq.write_table(rows(1), tmp_path / "validation.parquet")
    section = data_section({"source": "parquet", "options": {
        "path": str(tmp_path / "train.parquet"), "validation_path": str(tmp_path / "validation.parquet"),
        "features": "x", "label": "y", "partitions": 2}})
    manifest = prepare(section, str(tmp_path / "cache"), log=print)
    split = source_of("parquet").rows(manifest, "validation")
    parts = [validation_part(split, 3, rank) for rank in range(3)]
    assert [len(part["y"]) for part in parts] == [1, 0, 0]
    assert all(part["x"].shape[1:] == (4,) and part["x"].dtype == np.float32 for part in parts)

    task = TASKS[manifest.task]
    model = build_model(model_section({"name": "digits_mlp", "options": {"hidden": [8]}}),
                        {"task": manifest.task, **manifest.spec})
    scores = [evaluate(model, task, tensors(part), 256, torch.device("cpu"), torch.autocast("cpu", enabled=False))
              for part in parts]
    assert scores[1] == scores[2] == {"val_loss": 0.0, "val_accuracy": 0.0}
    assert scores[0]["val_loss"] > 0
