"""The `text` source: text, jsonl and Parquet documents tokenized (a tokenizer file, or a byte-level
BPE trained on a sample), packed into rows of seq_len + 1 ids with an end token between documents,
written a file at a time (an interrupted preparation resumes), and streamed like the parquet
source. In-process, no Ray; one Ray test runs tinylm_bpe.yaml end to end."""

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import CONFIGS, REPO

from training.data import text
from training.data.file_work import FileTask, output_name
from training.data.manifest import Manifest
from training.data.order import BatchPlan
from training.data.parquet import IndexedRows, open_stream
from training.data.registry import data_section
from training.data.tokenize import tokenize_file
from training.data.tokenizer import EOS, train_tokenizer
from training.errors import ConfigError, UserError
from training.metrics import mlflow_name

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho".split()


def corpus(root, files=6, docs_per_file=4):
    """Text files (one document each), jsonl and Parquet files of several documents; deterministic."""
    rng = np.random.default_rng(0)
    texts = {}
    root.mkdir(parents=True, exist_ok=True)
    for index in range(files):
        docs = [" ".join(rng.choice(WORDS, size=int(rng.integers(40, 120)))) + f" end{index}.{d}"
                for d in range(docs_per_file)]
        if index % 3 == 1:
            path = root / f"part{index}.jsonl"
            path.write_text("".join(json.dumps({"body": d, "id": i}) + "\n" for i, d in enumerate(docs)))
        elif index % 3 == 2:
            path = root / "year=2026" / f"part-{index:05d}.snappy.parquet"  # (a Hive layout, as Spark writes it)
            path.parent.mkdir(exist_ok=True)
            pq.write_table(pa.table({"body": docs, "id": list(range(len(docs)))}), path, row_group_size=2)
        else:
            path = root / f"doc{index}.txt"
            docs = [docs[0]]
            path.write_text(docs[0])
        texts[str(path)] = docs
    return texts


def options(root, **extra):
    base = {"path": str(root), "validation_fraction": 0.3, "text_column": "body", "seq_len": 16,
            "tokenizer": {"train": {"vocab_size": 300, "sample_bytes": 10_000}}, "partitions": 2}
    return {**base, **extra}


def data_config(root, **extra):
    return data_section(dict(source="text", options=options(root, **extra)))


def plan(data, cache_root):
    return text.SOURCE.plan(data, cache_root)


def prepare(data, cache_root, log=print, on_file=None):
    return plan(data, cache_root).prepare(None, log, on_file=on_file)


def check_unchanged(recorded_root, data, cache_root):
    plan(data, cache_root).check_unchanged(recorded_root)


def test_tokenizer_training_is_deterministic_for_the_same_sample(tmp_path):
    corpus(tmp_path / "in")
    data = data_config(tmp_path / "in")
    first = plan(data, str(tmp_path / "a"))
    trained = [train_tokenizer(first.inputs["train"], first.options).to_str() for _ in range(2)]
    assert trained[0] == trained[1]
    prepare(data, str(tmp_path / "a"), log=lambda _: None)
    prepare(data, str(tmp_path / "b"), log=lambda _: None)
    saved = [next((tmp_path / c).glob("text-*/tokenizer.json")).read_text() for c in "ab"]
    assert saved[0] == saved[1] == trained[0]


def test_packing_puts_eos_between_documents_in_rows_of_seq_len_plus_one(tmp_path):
    texts = corpus(tmp_path / "in")
    text_plan = plan(data_config(tmp_path / "in"), str(tmp_path / "cache"))
    tokenizer = train_tokenizer(text_plan.inputs["train"], text_plan.options)
    source = next(uri for uri, docs in texts.items() if len(docs) > 1)
    counts = tokenize_file(FileTask(source, "jsonl", str(tmp_path / "out")), tokenizer, 0, 17, 3, "body")
    (written,) = (tmp_path / "out").glob("*.parquet")
    column = pq.read_table(written).column("tokens")
    assert column.type == pa.list_(pa.int32(), 17)
    rows = np.array(column.to_pylist())
    groups = [pq.ParquetFile(written).metadata.row_group(g).num_rows
              for g in range(pq.ParquetFile(written).num_row_groups)]
    assert rows.shape == (counts["rows"], 17) and max(groups) == 3 and sum(groups) == counts["rows"]
    stream = np.concatenate([np.r_[tokenizer.encode(d, add_special_tokens=False).ids, 0] for d in texts[source]])
    assert counts["tokens"] == len(stream) and counts["dropped_tokens"] == len(stream) - rows.size < 17
    assert (rows.ravel() == stream[:rows.size]).all()
    ends = np.flatnonzero(stream == 0)
    assert len(ends) == len(texts[source]) and ends[-1] == len(stream) - 1  # one after every document


def _normalised(manifest):
    body = json.loads(manifest.to_json().replace(manifest.root, "ROOT"))
    body.pop("digest")  # (the output files' modification times)
    for split in body["splits"].values():
        for file in split["files"]:
            file.pop("mtime_ns")
    return body


def test_an_interrupted_preparation_resumes_without_rewriting_finished_files(tmp_path):
    corpus(tmp_path / "in", files=8)
    data = data_config(tmp_path / "in")

    def stop_after_three(counts, seen=[]):
        seen.append(counts)
        if len(seen) == 3:
            raise KeyboardInterrupt("killed")

    with pytest.raises(KeyboardInterrupt):
        prepare(data, str(tmp_path / "cache"), log=lambda _: None, on_file=stop_after_three)
    (root,) = (tmp_path / "cache").glob("text-*")
    assert not (root / "manifest.json").exists()
    finished = {p: p.stat().st_mtime_ns for p in root.glob("*/*.parquet")}
    assert len(finished) == 3 and not list(root.glob("*/.*.tmp"))
    lines = []
    resumed = prepare(data, str(tmp_path / "cache"), log=lines.append)
    assert {p: p.stat().st_mtime_ns for p in finished} == finished
    assert any("tokenized 5 of 8 files" in line for line in lines) and any("3 files prepared earlier" in line
                                                                        for line in lines)
    whole = prepare(data, str(tmp_path / "other"), log=lambda _: None)
    assert _normalised(resumed) == _normalised(whole)


def test_a_resume_on_changed_text_is_refused(tmp_path):
    texts = corpus(tmp_path / "in")
    data = data_config(tmp_path / "in")
    manifest = prepare(data, str(tmp_path / "cache"), log=lambda _: None)
    check_unchanged(manifest.root, data, str(tmp_path / "cache"))
    changed = sorted(texts)[0]
    with open(changed, "a") as handle:
        handle.write(" more")
    with pytest.raises(UserError, match="data.options.path: the text changed since the run started"):
        check_unchanged(manifest.root, data, str(tmp_path / "cache"))


def test_streamed_rows_decode_back_to_the_corpus(tmp_path):
    texts = corpus(tmp_path / "in")
    data = data_config(tmp_path / "in")
    manifest = prepare(data, str(tmp_path / "cache"), log=lambda _: None)
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(next((tmp_path / "cache").glob("text-*/tokenizer.json"))))
    assert manifest.spec == {"vocab_size": tokenizer.get_vocab_size(), "seq_len": 16}
    split = IndexedRows(manifest, "train")
    rows = split.take(np.arange(split.num_rows))["tokens"]
    start, inputs = 0, {}
    for file in manifest.splits["train"]["files"]:  # each output file: its input's documents, packed
        count = sum(file["row_groups"])
        decoded = tokenizer.decode(rows[start:start + count].ravel().tolist(), skip_special_tokens=False)
        start += count
        source = next(uri for uri in texts if output_name(uri) == file["uri"].rsplit("/", 1)[-1])
        whole = "".join(d + EOS for d in texts[source])
        assert whole.startswith(decoded) and len(whole) - len(decoded) < 16 * 12
        inputs[source] = decoded
    assert len(inputs) == len(manifest.splits["train"]["files"])
    stream = open_stream(manifest, BatchPlan(4, 1, 0), seed=0)
    positional = {tuple(r) for r in rows}
    streamed = [tuple(r) for s in range(stream.steps_per_epoch) for r in stream.batch(s)["tokens"]]
    assert len(streamed) == stream.steps_per_epoch * 4 and set(streamed) <= positional


def _bad_tokenizer(root):
    (root / "tokenizer.json").write_text('{"version": "1.0", "model": "not a model"}')
    return {"tokenizer": {"file": str(root / "tokenizer.json")}}


def _missing_field(root):
    (root / "part1.jsonl").write_text('{"body": "fine"}\n{"body": "also fine"}\n{"text": "no body"}\n')
    return {}


def _missing_field_found_while_tokenizing(root):
    """(no tokenizer to train: the bad line is found by the file's own task, after the first line)"""
    corpus(root.parent / "good")
    good = plan(data_config(root.parent / "good"), str(root.parent / "unused"))
    train_tokenizer(good.inputs["train"], good.options).save(str(root.parent / "tokenizer.json"))
    return {**_missing_field(root), "tokenizer": {"file": str(root.parent / "tokenizer.json")}}


def _empty_validation(root):
    (root / "empty.txt").write_text("")
    return {"validation_fraction": None, "validation_path": str(root / "empty.txt")}


BAD = [
    ("no files", lambda root: {"path": str(root / "nothing-*.txt")}, UserError, ["data.options.path", "nothing-*.txt"]),
    ("tokenizer file", _bad_tokenizer, UserError, ["data.options.tokenizer.file", "tokenizer.json"]),
    ("jsonl field", _missing_field, UserError, ["data.options.path", "part1.jsonl line 3", "'body'"]),
    ("jsonl field, tokenizing", _missing_field_found_while_tokenizing, UserError,
     ["data.options.path", "part1.jsonl line 3", "'body'"]),
    ("empty validation", _empty_validation, UserError, ["data.options.validation_path", "empty.txt"]),
    ("seq_len", lambda root: {"seq_len": 4}, ConfigError, ["data.options.seq_len"]),
    ("both tokenizers", lambda root: {"tokenizer": {"file": "x", "train": {}}}, ConfigError,
     ["data.options.tokenizer"]),
]


@pytest.mark.parametrize("case, change, error, words", BAD, ids=[c[0] for c in BAD])
def test_bad_input_is_refused_naming_the_option_and_file_with_nothing_written(tmp_path, case, change, error, words):
    corpus(tmp_path / "in")
    with pytest.raises(error) as raised:
        data = data_config(tmp_path / "in", **change(tmp_path / "in"))
        prepare(data, str(tmp_path / "cache"), log=lambda _: None)
    for word in words:
        assert word in str(raised.value)
    written = [p for p in (tmp_path / "cache").rglob("*") if p.is_file()] if (tmp_path / "cache").exists() else []
    # (a jsonl file found bad as it is tokenized: the files before it are kept for the resume)
    assert not [p for p in written if "part1" in p.name or p.name == "manifest.json"]


@pytest.mark.ray
def test_tinylm_bpe_trains_on_the_standard_library_and_logs_its_tokenizer(ray_cluster, workdir):
    from mlflow.tracking import MlflowClient

    from training import config as config_lib
    from training.run.driver import run_training

    overrides = ["train.max_steps=30", "train.eval_every_n_steps=30", "checkpoint.every_n_steps=30",
                 "data.options.max_bytes=300000", "data.options.tokenizer.train.sample_bytes=300000",
                 "data.options.tokenizer.train.vocab_size=512", "data.options.partitions=2", "failure.max_failures=0",
                 "tracking.register_model=false", "tracking.export_onnx=false",
                 "data.options.tokenize_on=cluster",  # (auto would tokenize this little text in the driver)
                 f"tracking.cluster_config={REPO / 'cluster.yaml'}"]  # as if it ran on that cluster
    job = config_lib.load(CONFIGS / "tinylm_bpe.yaml", overrides, name="tinylm-bpe")
    lines = []
    summary = run_training(job, log=lambda line: (lines.append(line), print(line)))
    assert summary.steps == 30 and summary.metrics["world_size"] == 2
    assert summary.metrics["val_perplexity"] < 512 and summary.metrics["tokens_per_s"] > 0  # better than uniform
    assert any("on the cluster (Ray Data)" in line for line in lines)
    (root,) = (workdir / "runs" / "datasets").glob("text-*")
    in_driver = prepare(job.data.model_copy(update={"options": job.data.options.model_copy(
        update={"tokenize_on": "driver"})}), str(workdir / "again"), log=print)
    assert _normalised(in_driver) == _normalised(Manifest.load(str(root)))  # the same rows, wherever tokenized
    client = MlflowClient(f"sqlite:///{workdir}/mlflow.db")
    assert [a.path for a in client.list_artifacts(summary.mlflow_run_id, "tokenizer")] == ["tokenizer/tokenizer.json"]
    saved = client.download_artifacts(summary.mlflow_run_id, "tokenizer/tokenizer.json", str(workdir))
    from tokenizers import Tokenizer

    assert Tokenizer.from_file(saved).get_vocab_size() == 512
    run = client.get_run(summary.mlflow_run_id)
    assert client.get_metric_history(run.info.run_id, "val_perplexity")
    assert run.data.metrics[mlflow_name("cluster_cost_usd_estimate")] > 0  # the head's time
    assert run.data.metrics[mlflow_name("cluster_gpu_energy_kwh_estimate")] == 0  # CPU workers: no GPU node priced


def test_the_command_refuses_bad_text_input_with_exit_2_before_ray(tmp_path):
    from cli_probe import run_cases

    (tmp_path / "bad-tokenizer.json").write_text("{not json")
    config = str(CONFIGS / "tinylm_bpe.yaml")
    cases = {"data.options.path=/nowhere/at/all/*.txt": "data.options.path: /nowhere/at/all/*.txt does not exist",
             f"data.options.tokenizer={{file: {tmp_path / 'bad-tokenizer.json'}}}":
                 "data.options.tokenizer.file: " + str(tmp_path / "bad-tokenizer.json"),
             "data.options.seq_len=70000": "data.options.seq_len"}
    dirs = {case: tmp_path / f"cwd{i}" for i, case in enumerate(cases)}
    for folder in dirs.values():
        folder.mkdir()
    results = run_cases("training.run.cli",
                        [{"args": [config, "--set", case], "cwd": str(dirs[case])} for case in cases])
    for (case, message), result in zip(cases.items(), results):
        assert result["returncode"] == 2 and message in result["stderr"], (case, result["stderr"])
        assert not result["ray_imported"] and list(dirs[case].iterdir()) == [], case
