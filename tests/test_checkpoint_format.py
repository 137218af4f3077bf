"""The checkpoint format's functions, without Ray: write and restore, the upload order, the metrics a
checkpoint recorded, and PBT's optimizer rebase on both layouts: the full one in this process, the
sharded one from a real FSDP2 save by 2 gloo processes, loaded back at world size 1 and 2."""

import json
import shutil
import socket
from pathlib import Path

import pyarrow.fs as pafs
import pytest
import torch

from training.checkpoint import format as ckpt
from training.config import OptimConfig

FS = pafs.LocalFileSystem()
DONOR = OptimConfig(lr=0.01, weight_decay=0.1, betas=(0.9, 0.95))
TRIAL = OptimConfig(lr=0.002, weight_decay=0.0, betas=(0.8, 0.99))


def _half(step: int) -> float:  # a schedule at half its base rate: the rebase must keep the half
    return 0.5


def _training_state(model, optim: OptimConfig):
    if optim.name == "sgd":
        optimizer = torch.optim.SGD(model.parameters(), lr=optim.lr, momentum=optim.momentum,
                                    weight_decay=optim.weight_decay)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=optim.lr, betas=optim.betas,
                                      weight_decay=optim.weight_decay)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, _half)


def _train(model, optimizer, scheduler, inputs, steps: int = 2) -> None:
    for _ in range(steps):
        model(inputs).float().pow(2).mean().backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()


def _write(directory, model, optimizer, scheduler, optim: OptimConfig, sharded: bool, world_size: int = 1):
    ckpt.write(directory, model=model, optimizer=optimizer, scheduler=scheduler, sharded=sharded,
               loop=ckpt.LoopState(step=2), config={"seed": 0, "optim": optim.model_dump(mode="json")},
               steps_per_epoch=10, world_size=world_size, metrics={"val_loss": 1.5, "note": "text"})


# --- the full layout ------------------------------------------------------------------------------

def test_metrics_upload_order_and_written_bytes(tmp_path):
    model = torch.nn.Linear(3, 2)
    optimizer, scheduler = _training_state(model, DONOR)
    _write(tmp_path, model, optimizer, scheduler, DONOR, sharded=False)
    assert ckpt.metrics_of(FS, str(tmp_path)) == {"val_loss": 1.5, "step": 2}
    assert ckpt.metrics_of(FS, str(tmp_path / "missing")) == {}
    assert ckpt.upload_order(["meta.json", "b", "a"]) == ["b", "a", "meta.json"]
    assert ckpt.written_bytes(tmp_path) == sum(p.stat().st_size for p in tmp_path.iterdir()) > 0
    assert not ckpt.has_sharded_layout(tmp_path)


@pytest.mark.parametrize("name", ["adamw", "sgd"])
def test_rebase_of_a_full_checkpoint(tmp_path, name):
    donor_optim, trial_optim = (o.model_copy(update={"name": name}) for o in (DONOR, TRIAL))
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    optimizer, scheduler = _training_state(model, donor_optim)
    _train(model, optimizer, scheduler, torch.ones(4, 3))
    donor = tmp_path / "donor"
    donor.mkdir()
    _write(donor, model, optimizer, scheduler, donor_optim, sharded=False)
    ckpt.rebase_optimizer(donor, tmp_path / "seed", trial_optim)
    assert ckpt.is_complete(FS, str(tmp_path / "seed"))

    fresh = torch.nn.Linear(3, 2)
    fresh_optimizer, fresh_scheduler = _training_state(fresh, OptimConfig(name=name, lr=1.0, weight_decay=0.5))
    assert ckpt.restore(tmp_path / "seed", fresh, fresh_optimizer, fresh_scheduler, sharded=False).step == 2
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in model.state_dict().items())
    for mine, donors in zip(fresh_optimizer.state.values(), optimizer.state.values()):  # moments kept
        assert mine.keys() == donors.keys() and all(torch.equal(mine[k], donors[k]) for k in mine)
    group = fresh_optimizer.param_groups[0]
    assert group["lr"] == pytest.approx(0.5 * TRIAL.lr) and group["initial_lr"] == TRIAL.lr
    assert group["weight_decay"] == 0.0
    assert group["betas"] == (0.8, 0.99) if name == "adamw" else group["momentum"] == TRIAL.momentum
    assert fresh_scheduler.base_lrs == [TRIAL.lr] and fresh_scheduler.get_last_lr() == [pytest.approx(0.001)]
    assert ckpt.load(tmp_path / "seed")["config"]["optim"] == trial_optim.model_dump(mode="json")


def test_rebase_refuses_an_incomplete_checkpoint(tmp_path):
    model = torch.nn.Linear(3, 2)
    optimizer, scheduler = _training_state(model, DONOR)
    (tmp_path / "donor").mkdir()
    _write(tmp_path / "donor", model, optimizer, scheduler, DONOR, sharded=False)
    (tmp_path / "donor" / ckpt.META_FILE).unlink()  # the upload was cut short
    with pytest.raises(ValueError, match="not a complete checkpoint"):
        ckpt.rebase_optimizer(tmp_path / "donor", tmp_path / "seed", TRIAL)


# --- the sharded layout, from 2 gloo processes ---------------------------------------------------

def _fsdp_state(seed: int, optim: OptimConfig):
    from training.config import ParallelConfig
    from training.models.gpt import FAMILY, GPTOptions
    from training.models.gpt_nn import GPT
    from training.worker.parallel import wrap

    torch.manual_seed(seed)
    model = GPT(256, 16, GPTOptions(n_layer=1, n_head=2, d_model=16))
    wrap(model, ParallelConfig(strategy="fsdp"), torch.device("cpu"), blocks=FAMILY.blocks(model))
    return (model, *_training_state(model, optim))


def _save_donor(rank: int, world_size: int, out_dir: str) -> None:
    """Each worker trains 2 steps and writes its own directory, as on Ray Train's workers."""
    model, optimizer, scheduler = _fsdp_state(0, DONOR)
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(rank))
    _train(model, optimizer, scheduler, tokens)
    directory = Path(out_dir) / f"rank{rank}"
    directory.mkdir()
    _write(directory, model, optimizer, scheduler, DONOR, sharded=True, world_size=world_size)


def _load(rank: int, world_size: int, directories: list[str], out_file: str) -> None:
    """Restore each checkpoint into a fresh sharded model whose weights and optimizer settings are
    unlike the checkpoint's; rank 0 writes what the workers then hold, gathered in full."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    held = []
    for directory in directories:
        model, optimizer, scheduler = _fsdp_state(123, OptimConfig(lr=1.0, weight_decay=0.5))
        loop = ckpt.restore(directory, model, optimizer, scheduler, sharded=True)  # load_sharded, then the schedule
        full_model, full_optimizer = get_state_dict(model, optimizer,
                                                    options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        held.append({"model": full_model, "moments": full_optimizer.get("state"), "step": loop.step,
                     "groups": [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups],
                     "base_lrs": scheduler.base_lrs, "last_lr": scheduler.get_last_lr()})
    if rank == 0:
        torch.save(held, out_file)


def _donor_and_seed_at_two(rank: int, world_size: int, out_dir: str) -> None:
    """Write the donor on 2 workers; rank 0 gathers their files, meta.json last, as the upload leaves
    them, and rebases the donor onto TRIAL in one process; both workers then load both back."""
    import torch.distributed as dist

    out = Path(out_dir)
    _save_donor(rank, world_size, out_dir)
    dist.barrier()
    if rank == 0:
        (out / "donor").mkdir()
        for directory in (out / "rank0", out / "rank1"):
            for name in ckpt.upload_order(p.name for p in directory.iterdir()):
                shutil.copyfile(directory / name, out / "donor" / name)
        ckpt.rebase_optimizer(out / "donor", out / "seed", TRIAL)
    dist.barrier()
    _load(rank, world_size, [str(out / "donor"), str(out / "seed")], str(out / "held-2.pt"))


def _in_gloo_group(rank: int, world_size: int, port: int, work, *args) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        work(rank, world_size, *args)
        # Both ranks done before either tears its connections down: a rank that exits while its peer
        # still holds a gloo connection open to it can abort the peer ("terminate called without an
        # active exception", seen on a loaded machine).
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _worker_process(rank: int, *args) -> None:
    torch.set_num_threads(1)
    _in_gloo_group(rank, *args)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_rebase_of_a_sharded_checkpoint_loads_at_any_world_size(tmp_path):
    import torch.multiprocessing as mp

    mp.start_processes(_worker_process, args=(2, _free_port(), _donor_and_seed_at_two, str(tmp_path)), nprocs=2,
                       join=True, start_method="spawn")
    donor, seed = tmp_path / "donor", tmp_path / "seed"
    assert {"__0_0.distcp", "__1_0.distcp"} <= set(json.loads((donor / ckpt.META_FILE).read_text())["files"])
    assert ckpt.is_complete(FS, str(donor)) and ckpt.has_sharded_layout(donor)
    assert ckpt.is_complete(FS, str(seed)) and ckpt.has_sharded_layout(seed)
    meta = json.loads((seed / ckpt.META_FILE).read_text())
    assert set(meta["files"]) == {p.name for p in seed.iterdir()} - {ckpt.META_FILE}
    assert meta["step"] == 2 and meta["world_size"] == 2 and meta["metrics"] == {"val_loss": 1.5}
    train_state = torch.load(seed / ckpt.TRAIN_STATE_FILE, weights_only=True)
    assert train_state["config"]["optim"] == TRIAL.model_dump(mode="json")

    # world size 1: this process, a gloo group of one
    _in_gloo_group(0, 1, _free_port(), _load, [str(donor), str(seed)], str(tmp_path / "held-1.pt"))
    for world_size in (1, 2):
        as_donor, as_seed = torch.load(tmp_path / f"held-{world_size}.pt", weights_only=True)
        # the donor's weights and moments, exactly
        assert as_seed["model"].keys() == as_donor["model"].keys()
        assert all(torch.equal(as_seed["model"][k], v) for k, v in as_donor["model"].items())
        assert as_seed["moments"].keys() == as_donor["moments"].keys() and as_donor["moments"]
        for name, moments in as_donor["moments"].items():
            assert all(torch.equal(as_seed["moments"][name][k], v) for k, v in moments.items()), name
        assert as_seed["step"] == as_donor["step"] == 2
        # the donor's settings before, the trial's after, at the same point of the schedule
        donor_group, seed_group = as_donor["groups"][0], as_seed["groups"][0]
        assert donor_group["lr"] == pytest.approx(0.5 * DONOR.lr) and donor_group["weight_decay"] == 0.1
        assert seed_group["lr"] == pytest.approx(0.5 * TRIAL.lr) and seed_group["initial_lr"] == TRIAL.lr
        assert seed_group["weight_decay"] == 0.0 and tuple(seed_group["betas"]) == (0.8, 0.99)
        assert as_seed["base_lrs"] == [TRIAL.lr] and as_seed["last_lr"] == [pytest.approx(0.5 * TRIAL.lr)]


@pytest.mark.parametrize("model_format", ["pt2", "pickle"])
def test_the_final_model_is_logged_in_the_configured_format(tmp_path, monkeypatch, model_format):
    """The final model (from the last checkpoint) is logged as a torch.export graph by default,
    which loads with pickle deserialisation refused and takes any batch size; pickle is opt-in."""
    from types import SimpleNamespace

    import mlflow

    from training import config as config_lib
    from training.models.registry import build_model, model_section
    from training.run import finalize

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    model = build_model(model_section({"name": "digits_mlp"}),
                        {"task": "classification", "input_dim": 64, "num_classes": 10}).eval()
    monkeypatch.setattr(finalize, "sample_input", lambda manifest: torch.rand(4, 64))
    job = config_lib.JobConfig(tracking={"register_model": False, "model_format": model_format})
    run_id = mlflow.MlflowClient(uri).create_run(mlflow.MlflowClient(uri).create_experiment("e")).info.run_id
    logged = finalize.log_model(job, None, model, SimpleNamespace(tracking_uri=uri, run_id=run_id))
    assert logged["model_format"] == model_format

    mlflow.set_tracking_uri(uri)
    try:
        files = {Path(p).name for p in Path(mlflow.artifacts.download_artifacts(logged["model_uri"])).rglob("*")}
        if model_format == "pickle":
            assert "model.pth" in files and "model.pt2" not in files
            return
        assert "model.pt2" in files and "model.pth" not in files
        monkeypatch.setenv("MLFLOW_ALLOW_PICKLE_DESERIALIZATION", "false")
        loaded = mlflow.pytorch.load_model(logged["model_uri"])
    finally:
        mlflow.set_tracking_uri(None)
    x = torch.rand(7, 64)
    assert torch.allclose(loaded(x), model(x), atol=1e-6)


def _saved(run_dir: Path, step: int, complete: bool = True) -> Path:
    directory = run_dir / ckpt.checkpoint_dir_name(step)
    directory.mkdir(parents=True)
    ckpt.save(directory, model_state={"w": torch.ones(8) * step}, optimizer_state={}, scheduler_state={},
              loop=ckpt.LoopState(step=step), config={"seed": 0}, steps_per_epoch=10, world_size=1, metrics={})
    if not complete:  # an upload cut short: meta.json not there yet
        (directory / ckpt.META_FILE).unlink()
    return directory


def test_keep_removes_what_ray_train_never_registered_once_a_newer_checkpoint_is(tmp_path):
    """A run resumed from checkpoint 60, which a save wrote but Ray Train never registered (the
    driver died first), went on to register 80 and 100 with checkpoint.keep 2: 60 and a directory
    cut short at 70 are removed after the fit; 80 and 100 (kept), and 120 (newer than anything
    registered: perhaps being written) stay."""
    from types import SimpleNamespace

    from training.run.finalize import remove_unregistered_checkpoints

    run_dir = tmp_path / "runs" / "r"
    paths = {step: _saved(run_dir, step, complete=step not in (70, 120)) for step in (60, 70, 80, 100, 120)}
    (run_dir / "run.json").write_text("{}")
    (run_dir / "checkpoint_manager_snapshot.json").write_text("{}")

    def checkpoint(step):
        return SimpleNamespace(path=str(paths[step]))

    result = SimpleNamespace(checkpoint=checkpoint(100), best_checkpoints=[(checkpoint(80), {}), (checkpoint(100), {})])
    lines = []
    removed = remove_unregistered_checkpoints(result, str(run_dir), lines.append)
    assert removed == ["checkpoint-00000060", "checkpoint-00000070"] and "checkpoint-00000060" in lines[0]
    left = sorted(p.name for p in run_dir.iterdir())
    assert left == ["checkpoint-00000080", "checkpoint-00000100", "checkpoint-00000120",
                    "checkpoint_manager_snapshot.json", "run.json"]
    assert ckpt.newest_complete(FS, str(run_dir))[0] == 100
    assert remove_unregistered_checkpoints(result, str(run_dir), lines.append) == []  # nothing more
    # A run that reported no checkpoint (resumed at its last step with nothing to train) removes nothing.
    assert remove_unregistered_checkpoints(SimpleNamespace(checkpoint=None, best_checkpoints=[]), str(run_dir),
                                           lines.append) == []


def test_keep_never_removes_the_newest_complete_checkpoint():
    names = [ckpt.checkpoint_dir_name(s) for s in (20, 40, 60)]
    # the registered latest (80) is gone from storage: 60, though unregistered, is what a resume would use
    assert ckpt.unregistered_to_remove(names, kept={"checkpoint-00000080"}, latest_registered_step=80,
                                       newest_complete_step=60) == ["checkpoint-00000020", "checkpoint-00000040"]
    assert ckpt.unregistered_to_remove(names + ["notes", "checkpoint-00000099"], kept=set(),
                                       latest_registered_step=40, newest_complete_step=99) == ["checkpoint-00000020"]
