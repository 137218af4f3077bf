"""`python -m training status` on run files it did not write: JSON of the wrong shape, a checkpoint's
meta.json holding a list, bad --interval and --storage values, run names that are paths. Each one is
a message and an exit code, never a traceback; in the list, one bad run does not hide the others.
The good runs are written by the real writers; the bad files by hand, as a person editing them would."""

import json

import pyarrow.fs as pafs
import pytest
from cli_probe import run_cases

from training.checkpoint import format as ckpt
from training.observe import files
from training.observe.callback import RunEvents
from training.observe.driver_status import DriverStatus
from training.run.record import Record

FS = pafs.LocalFileSystem()

# A run's file, and what it holds instead of what its writer writes.
BAD_FILES = {
    "progress-metrics-list": ("progress.json", {"step": 5, "metrics": [1, 2]}),
    "progress-step-text": ("progress.json", {"step": "five"}),
    "progress-metric-text": ("progress.json", {"step": 5, "metrics": {"train_loss": "low"}}),
    "progress-updated-text": ("progress.json", {"step": 5, "updated": "yesterday"}),
    "status-list": ("status.json", ["running"]),
    "status-beat-text": ("status.json", {"state": "running", "heartbeat": 1.0, "heartbeat_every_s": "10"}),
    "summary-list": ("summary.json", []),
    "summary-steps-text": ("summary.json", {"steps": "many", "metrics": {}}),
    "record-run-id-number": ("run.json", {"identity": {}, "mlflow_run_id": 7, "tracking_uri": "x"}),
}
WRONG_META = {
    "a list": [],
    "a string": "meta",
    "files as a list": {"format_version": ckpt.FORMAT_VERSION, "layout": "sharded", "files": ["state.pt"]},
    "a size as text": {"format_version": ckpt.FORMAT_VERSION, "state_bytes": "123"},
    "no files": {"format_version": ckpt.FORMAT_VERSION, "layout": "sharded"},
}
# Run names that are paths (ROOT: the folder holding the storage and, next to it, a run named outside).
PATH_NAMES = {"parent": "..", "sibling": "../outside", "absolute": "ROOT/outside", "up-again": "a-good/..",
              "root": "/", "here": ".", "backslash": "a\\b", "uri": "file:///etc"}


def good_run(storage, name):
    run_dir = storage / name
    Record(name, {"seed": 0}, "abc123", None).write(str(run_dir / "run.json"))
    RunEvents(name, str(run_dir)).on_report({"step": 10, "total_steps": 20, "train_loss": 0.5}, checkpointed=True)
    DriverStatus(str(run_dir), name).end("finished")
    return run_dir


def write_checkpoint(run_dir, step, meta=None):
    directory = run_dir / ckpt.checkpoint_dir_name(step)
    directory.mkdir(parents=True)
    ckpt.save(directory, model_state={}, optimizer_state={}, scheduler_state={}, loop=ckpt.LoopState(step=step),
              config={"seed": 0}, steps_per_epoch=10, world_size=1, metrics={"val_loss": 0.5})
    if meta is not None:
        (directory / ckpt.META_FILE).write_text(json.dumps(meta))
    return directory


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """Every command of this file in one process: {case: result}."""
    root = tmp_path_factory.mktemp("status")
    storage = root / "runs"
    good_run(storage, "a-good")
    for name, (file, value) in BAD_FILES.items():
        run_dir = good_run(storage, name)
        (run_dir / file).write_text(json.dumps(value))
    good_run(storage, "z-good")
    checkpointed = good_run(root / "ckpts", "r")
    write_checkpoint(checkpointed, 20)
    for step, meta in zip((40, 60, 80, 100, 120), WRONG_META.values()):
        write_checkpoint(checkpointed, step, meta)
    good_run(root, "outside")  # a run next to the storage, not in it
    (root / "a-file").write_text("not a folder")
    cases = {
        "list": ["status", "--storage", str(storage)],
        "list-json": ["status", "--storage", str(storage), "--json"],
        "checkpoints": ["status", "r", "--storage", str(root / "ckpts")],
        "storage-is-a-file": ["status", "--storage", str(root / "a-file")],
        **{f"one:{name}": ["status", name, "--storage", str(storage)] for name in BAD_FILES},
        **{f"interval:{value}": ["status", "--storage", str(storage), "--watch", f"--interval={value}"]
           for value in ("nan", "inf", "-inf", "0", "-1", "1e300")},
        **{f"name:{key}": ["status", name.replace("ROOT", str(root)), "--storage", str(storage)]
           for key, name in PATH_NAMES.items()},
    }
    done = run_cases("training.run.cli", [{"args": args, "cwd": str(root)} for args in cases.values()])
    return dict(zip(cases, done))


def test_one_unreadable_run_is_listed_as_such_and_the_others_are_shown(results):
    result = results["list"]
    assert result["returncode"] == 0 and "Traceback" not in result["stderr"], result["stderr"]
    lines = dict(line.split(None, 1) for line in result["stdout"].splitlines())
    assert lines["a-good"].startswith("finished") and lines["z-good"].startswith("finished")
    for name, (file, _) in BAD_FILES.items():
        assert lines[name].startswith("unreadable: "), lines[name]
        assert f"/{name}/{file}" in lines[name], lines[name]
    assert "'metrics' is an array ([1, 2]), not an object" in lines["progress-metrics-list"]
    assert "metric 'train_loss' is a string (\"low\"), not a number" in lines["progress-metric-text"]
    assert "holds an array ([\"running\"]), not a JSON object" in lines["status-list"]
    assert "'heartbeat_every_s' is a string (\"10\"), not a number" in lines["status-beat-text"]
    assert "'mlflow_run_id' is an integer (7), not a string" in lines["record-run-id-number"]


def test_the_list_as_json_marks_the_unreadable_runs(results):
    result = results["list-json"]
    assert result["returncode"] == 0, result["stderr"]
    reports = {report["name"]: report for report in json.loads(result["stdout"])}
    assert reports["a-good"]["state"] == "finished" and reports["a-good"]["step"] == 10
    assert {reports[name]["state"] for name in BAD_FILES} == {"unreadable"}
    assert "summary.json" in reports["summary-steps-text"]["detail"]


@pytest.mark.parametrize("name", BAD_FILES)
def test_one_unreadable_run_is_refused_naming_its_file_and_field(results, name):
    result = results[f"one:{name}"]
    file, _ = BAD_FILES[name]
    assert result["returncode"] == 2 and "Traceback" not in result["stderr"], result["stderr"]
    assert result["stderr"].startswith(f"error: run {name!r} cannot be shown: ") and f"/{name}/{file}" \
        in result["stderr"], result["stderr"]
    assert len(result["stderr"].strip().splitlines()) == 1


@pytest.mark.parametrize("meta", WRONG_META.values(), ids=WRONG_META.keys())
def test_a_checkpoint_whose_meta_is_the_wrong_shape_is_incomplete(tmp_path, meta):
    write_checkpoint(tmp_path, 20)
    bad = write_checkpoint(tmp_path, 40, meta)
    assert not ckpt.is_complete(FS, str(bad))
    assert ckpt.newest_complete(FS, str(tmp_path)) == (20, str(tmp_path / ckpt.checkpoint_dir_name(20)))


def test_status_shows_such_checkpoints_as_incomplete_and_resumes_from_the_last_complete_one(results):
    result = results["checkpoints"]
    assert result["returncode"] == 0, result["stderr"]
    assert "checkpoints (step): 120 (incomplete), 100 (incomplete), 80 (incomplete), 60 (incomplete), " \
           "40 (incomplete), 20 (complete)" in result["stdout"]


@pytest.mark.parametrize("value", ("nan", "inf", "-inf", "0", "-1", "1e300"))
def test_an_interval_that_is_not_a_positive_finite_number_of_seconds_is_refused(results, value):
    result = results[f"interval:{value}"]
    assert result["returncode"] == 2 and result["stderr"].startswith("error: --interval "), result["stderr"]
    assert "Traceback" not in result["stderr"]


def test_a_storage_that_is_a_file_is_refused(results):
    result = results["storage-is-a-file"]
    assert result["returncode"] == 2 and "Traceback" not in result["stderr"], result["stderr"]
    assert "--storage" in result["stderr"] and "a-file is a file" in result["stderr"]


@pytest.mark.parametrize("key", PATH_NAMES)
def test_a_run_name_that_is_a_path_is_refused_and_nothing_outside_the_storage_is_read(results, key):
    result = results[f"name:{key}"]
    assert result["returncode"] == 2 and "Traceback" not in result["stderr"], result["stderr"]
    assert "a run's name is one folder in --storage, not a path" in result["stderr"]
    assert result["stdout"] == ""  # (the run next to the storage is not shown)


@pytest.mark.parametrize("earlier", [{"attempt": "x"}, {"attempt": None, "first_started": None}, ["a", "list"]])
def test_a_driver_starts_afresh_over_a_status_file_it_did_not_write(tmp_path, earlier):
    (tmp_path / files.STATUS_FILE).write_text(json.dumps(earlier))
    status = DriverStatus(str(tmp_path), "r", clock=lambda: 100.0)
    assert status.record["attempt"] == 1 and status.record["first_started"] == 100.0
