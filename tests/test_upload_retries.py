"""A checkpoint upload retries in one layer only, within one budget: through Ray Train's own retry
of the upload function (called in-process, no cluster), a storage that keeps failing with a
retryable AWS error is tried at most the policy's attempts, all files together, and never waits past
the budget a preemption's deadline leaves."""

import pyarrow.fs as pafs
import pytest

from training import storage
from training.checkpoint import format as ckpt
from training.checkpoint.report import synchronous_upload_budget_s
from training.checkpoint.upload import RetryPolicy, UploadFailed, upload, upload_fn

RETRYABLE = "AWS Error NETWORK_CONNECTION during PutObject operation: curlCode: 7, Couldn't connect to server"


class FailingStorage(pafs.FileSystemHandler):
    """A storage whose writes fail with a retryable S3 error, the first `failures` of them
    (None: all); every write attempt is counted."""

    def __init__(self, target: str, failures=None):
        self.inner, self.target, self.failures, self.writes = pafs.LocalFileSystem(), target, failures, 0
        self.fail_writes = None  # or the numbers of the writes that fail (1 = the first)
        self.transfer = lambda: None  # called by every write: a test's clock moves by a transfer's time

    def _attempt(self):
        self.writes += 1
        self.transfer()
        failing = self.writes in self.fail_writes if self.fail_writes is not None else (
            self.failures is None or self.writes <= self.failures)
        if failing:
            raise OSError(f"When uploading to {self.target}: {RETRYABLE}")

    def create_dir(self, path, recursive):
        self._attempt()
        self.inner.create_dir(path, recursive=recursive)

    def open_output_stream(self, path, metadata):
        self._attempt()
        return self.inner.open_output_stream(path)

    def get_type_name(self):
        return "failing"

    def normalize_path(self, path):
        return path

    def get_file_info(self, paths):
        return self.inner.get_file_info(paths)

    def get_file_info_selector(self, selector):
        return self.inner.get_file_info(selector)

    def _unused(self, *args):  # the rest of the interface: an upload does not read, move or delete
        raise NotImplementedError

    copy_file = delete_dir = delete_dir_contents = delete_file = delete_root_dir_contents = _unused
    move = open_append_stream = open_input_file = open_input_stream = _unused

    def equals(self, other):
        return other is self


def saved_checkpoint(directory, step=20):
    import torch

    directory.mkdir()
    ckpt.save(directory, model_state={"w": torch.ones(100)}, optimizer_state={}, scheduler_state={},
              loop=ckpt.LoopState(step=step), config={"seed": 0}, steps_per_epoch=10, world_size=1, metrics={})
    return directory


@pytest.fixture
def failing_storage(tmp_path, monkeypatch):
    handler = FailingStorage(str(tmp_path / "remote"))
    monkeypatch.setattr(storage, "filesystem", lambda uri: (pafs.PyFileSystem(handler), uri))
    return handler


def ray_train_upload(checkpoint_dir, upload_function):
    """The upload as a Ray Train worker runs it: through `TrainContext._upload_checkpoint`, with
    Ray's own retry decorator around it."""
    from types import SimpleNamespace

    import ray.train
    from ray.train.v2._internal.execution.context import TrainContext

    context = SimpleNamespace(execution_context=SimpleNamespace(train_context_callbacks=[]))
    return TrainContext._upload_checkpoint(context, "checkpoint-00000020", {},
                                           checkpoint=ray.train.Checkpoint.from_directory(str(checkpoint_dir)),
                                           checkpoint_upload_fn=upload_function)


def test_a_failing_storage_is_tried_the_policys_attempts_not_multiplied_by_ray_trains_retry(tmp_path, failing_storage):
    local = saved_checkpoint(tmp_path / "local")
    policy = RetryPolicy(attempts=4, first_delay_s=0.01, max_delay_s=0.02)
    with pytest.raises(UploadFailed, match="failed 4 times in .* giving up: .*aws error network_connection") as caught:
        ray_train_upload(local, upload_fn(str(tmp_path / "remote"), policy))
    assert failing_storage.writes == 4  # not 3 x 4: Ray Train did not start the upload over
    # Ray's retry re-raises `from None`, dropping the cause: the message says what the storage said
    assert "Couldn't connect to server" in str(caught.value)


def test_one_budget_covers_every_file_and_no_wait_ends_past_it(tmp_path, failing_storage):
    local = saved_checkpoint(tmp_path / "local")
    now = [0.0]
    slept = []

    def sleep(seconds):
        slept.append(seconds)
        now[0] += seconds

    # create_dir, state.pt and meta.json: five failures spread over three writes, on one budget
    failing_storage.failures = 5
    policy = RetryPolicy(attempts=6, first_delay_s=1, max_delay_s=4, budget_s=100)
    fs, path = upload(local, str(tmp_path / "remote"), "checkpoint-00000020", policy, sleep=sleep, clock=lambda: now[0])
    assert slept == [1, 2, 4, 4, 4] and ckpt.is_complete(pafs.LocalFileSystem(), path)

    failing_storage.failures, failing_storage.writes, slept[:] = None, 0, []
    now[0] = 0.0
    with pytest.raises(UploadFailed, match="failed 4 times in 7 s"):
        upload(local, str(tmp_path / "remote"), "checkpoint-00000030", policy.within(10), sleep=sleep,
               clock=lambda: now[0])
    assert slept == [1, 2, 4] and sum(slept) <= 10  # the next wait (4 s) would have ended past 10 s


def test_the_budget_counts_waiting_between_attempts_not_the_transfer(tmp_path, failing_storage):
    """A large checkpoint: each file takes 150 s to write (on a test clock). One transient error on
    the last file, past the 120 s budget's length of transfer, is still retried: the budget bounds
    how long an outage is waited out. A preemption's deadline still counts the transfer."""
    local = saved_checkpoint(tmp_path / "local")
    now = [0.0]
    slept = []

    def sleep(seconds):
        slept.append(seconds)
        now[0] += seconds

    def transfer():
        now[0] += 150.0

    failing_storage.transfer = transfer
    failing_storage.fail_writes = {3}  # create_dir, state.pt, then meta.json fails once
    policy = RetryPolicy(attempts=6, first_delay_s=1, max_delay_s=30, budget_s=120)
    fs, path = upload(local, str(tmp_path / "remote"), "checkpoint-00000020", policy, sleep=sleep, clock=lambda: now[0])
    assert slept == [1] and failing_storage.writes == 4 and ckpt.is_complete(pafs.LocalFileSystem(), path)

    # a wait budget is spent by waiting alone: an outage longer than it still gives up
    failing_storage.transfer, failing_storage.fail_writes, failing_storage.writes, slept[:] = lambda: None, None, 0, []
    with pytest.raises(UploadFailed, match="failed 5 times in 15 s"):
        upload(local, str(tmp_path / "remote"), "checkpoint-00000030",
               RetryPolicy(attempts=9, first_delay_s=1, max_delay_s=8, budget_s=20), sleep=sleep,
               clock=lambda: now[0])
    assert slept == [1, 2, 4, 8]  # 15 s waited; the next 8 s would pass 20

    # a deadline (a preemption's final save) bounds the wall clock, the transfer included
    failing_storage.transfer, failing_storage.fail_writes, failing_storage.writes, slept[:] = transfer, {2}, 0, []
    with pytest.raises(UploadFailed, match="failed 1 times in 300 s"):
        upload(local, str(tmp_path / "remote"), "checkpoint-00000040", policy.within(200), sleep=sleep,
               clock=lambda: now[0])
    assert slept == []


def test_a_preemption_upload_gets_what_the_deadline_leaves():
    assert synchronous_upload_budget_s(deadline_s=1_000.0, now_s=970.0) == pytest.approx(28.0)
    assert synchronous_upload_budget_s(deadline_s=1_000.0, now_s=1_005.0) == 0.0
    assert 0 < synchronous_upload_budget_s(None, now_s=0.0) <= 10.0  # no deadline known: a final save's least margin
    # a spent budget is one attempt, no wait
    assert RetryPolicy().within(0).delay_s(1, waited_s=0.0, elapsed_s=0.0) is None
    assert RetryPolicy(budget_s=5).within(60).budget_s == 5
    assert RetryPolicy(budget_s=120).within(60).delay_s(1, waited_s=0.0, elapsed_s=59.5) is None
