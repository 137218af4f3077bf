"""The checkpoint format: one directory, complete and versioned. Used by the workers (write,
restore, upload order), the driver (metrics of the final checkpoint, the final model) and sweeps
(PBT's rebase of a donor's optimizer); this is the one module that knows file names, state keys
and meta.json's fields.

    state.pt   model (unwrapped state dict), optimizer, scheduler, loop state, resolved config

A model whose family reads its frozen parameters again from elsewhere (an adapter over a pretrained
base: family.checkpoints_frozen) has only its trainable ones (and any buffers) in either layout.
    meta.json  format version, step, epoch, position in the epoch, world size, metrics, and the
               size of state.pt: written last, it is what makes a checkpoint complete

A sharded checkpoint (parallel.strategy: fsdp) holds instead, written by every worker at once:

    __<rank>_0.distcp  each worker's shard of the model and optimizer (torch.distributed.checkpoint),
                       the optimizer's param_groups (lr, weight_decay, ...) among them
    .metadata          the shards' manifest (rank 0): which slice of which tensor is where
    train_state.pt     scheduler, loop state, resolved config (rank 0)
    meta.json          as above (rank 0), with "layout": "sharded" and the size of every other file

Every worker uploads its own files; rank 0 uploads meta.json after its own. The workers' uploads
run side by side, so meta.json may land before another worker's shard: such a directory is still
incomplete (a file missing or shorter than recorded) and is never chosen. It becomes complete the
moment the last shard lands, whatever the order, with synchronous and asynchronous uploads alike.
The manifest lets it be loaded at any world size, re-sharded (or consolidated) on the way in.

PBT's exploit copies a donor's checkpoint onto another trial's optimizer settings
(rebase_optimizer), in one process: a sharded one comes out as one shard (__0_0.distcp) with its
manifest, which loads at any world size like the rest.

The sample order and every random stream are pure functions of (seed, step, rank) (see
training/data/order.py and training/worker/seeding.py), so (seed, step) is the complete RNG state: a run resumed
at step s draws exactly what it would have drawn.

A run resumes from the newest *complete* checkpoint in its directory, which may be newer than the
one Ray Train has registered (registration lags the upload, and a worker killed in between would
otherwise redo a whole interval); a directory whose upload was cut short is never chosen. Ray Train
never registers such a directory, so its keep-N cleanup never removes it: the driver does, once a
newer checkpoint is registered (unregistered_to_remove).
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional

import pyarrow.fs as pafs
import torch
import torch.distributed as dist

from training.redaction import redact_values

FORMAT_VERSION = 1
STATE_FILE = "state.pt"
META_FILE = "meta.json"
TRAIN_STATE_FILE = "train_state.pt"  # sharded layout
MANIFEST_FILE = ".metadata"  # sharded layout: torch.distributed.checkpoint's own name
# The prefix under which the optimizer's param_groups lie in a sharded checkpoint's flattened state
# (torch.distributed.checkpoint flattens {"optimizer": {"param_groups": [{"lr": ...}]}} so).
PARAM_GROUPS_KEY = "optimizer.param_groups."
DIR_PATTERN = re.compile(r"^checkpoint-(\d{8})$")


@dataclass
class LoopState:
    step: int = 0
    best_metric: Optional[float] = None
    evals_without_improvement: int = 0
    stopped_early: bool = False
    data_digest: int = 0  # of the global batches trained on through `step` (training.data.order.batch_digest)
    # failure.mode continue: the replica ledger (training/failure/replicas.py), samples skipped so far
    replicas: Optional[dict] = None


def checkpoint_dir_name(step: int) -> str:
    return f"checkpoint-{step:08d}"


def save(directory: str | Path, *, model_state: dict, optimizer_state: dict, scheduler_state: dict,
         loop: LoopState, config: dict, steps_per_epoch: int, world_size: int, metrics: dict) -> None:
    directory = Path(directory)
    torch.save({"format_version": FORMAT_VERSION, "model": model_state, "optimizer": optimizer_state,
                "scheduler": scheduler_state, "loop": asdict(loop), "config": config}, directory / STATE_FILE)
    _write_meta(directory, loop, config, steps_per_epoch, world_size, metrics,
                {"state_bytes": (directory / STATE_FILE).stat().st_size})


def _write_meta(directory: Path, loop: LoopState, config: dict, steps_per_epoch: int, world_size: int,
                metrics: dict, layout: dict) -> None:
    epoch, position = divmod(loop.step, steps_per_epoch)
    meta = {"format_version": FORMAT_VERSION, "step": loop.step, "epoch": epoch, "position_in_epoch": position,
            "steps_per_epoch": steps_per_epoch, "world_size": world_size, **layout,
            "rng": {"scheme": "seeded per (seed, step, rank)", "seed": config["seed"]},
            "metrics": {k: v for k, v in metrics.items() if isinstance(v, (int, float))}}
    (directory / META_FILE).write_text(json.dumps(meta, indent=2))


def save_sharded(directory: str | Path, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 scheduler_state: dict, loop: LoopState, config: dict, steps_per_epoch: int, world_size: int,
                 metrics: dict, frozen: bool = True) -> None:
    """Every worker calls this at once (it is a collective), each with its own local directory:
    each writes its shard there, rank 0 also the manifest, train_state.pt and, last, meta.json."""
    import torch.distributed.checkpoint as dcp  # (lazy: torch.distributed.checkpoint)
    from torch.distributed.checkpoint.state_dict import get_state_dict  # (lazy: torch.distributed.checkpoint)

    directory = Path(directory)
    model_state, optimizer_state = get_state_dict(model, optimizer, options=_dcp_options(frozen))
    dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=directory)
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0:
        torch.save({"format_version": FORMAT_VERSION, "scheduler": scheduler_state, "loop": asdict(loop),
                    "config": config}, directory / TRAIN_STATE_FILE)
    mine = _file_sizes(directory)
    everyone = [mine]
    if dist.is_initialized() and dist.get_world_size() > 1:
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
    if rank == 0:
        files = {name: size for sizes in everyone for name, size in sizes.items()}
        _write_meta(directory, loop, config, steps_per_epoch, world_size, metrics,
                    {"layout": "sharded", "files": dict(sorted(files.items()))})


def _file_sizes(directory: Path) -> dict[str, int]:
    """What meta.json records of a sharded checkpoint: every other file's size."""
    return {p.name: p.stat().st_size for p in directory.iterdir() if p.name != META_FILE}


def write(directory: str | Path, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
          scheduler: torch.optim.lr_scheduler.LRScheduler, sharded: bool, loop: LoopState, config: dict,
          steps_per_epoch: int, world_size: int, metrics: dict, frozen: bool = True) -> None:
    """A worker's checkpoint of its training state: sharded, every worker calls this at once (see
    save_sharded); else rank 0 alone. `model` is the unwrapped module (its own parameter names);
    `frozen`: whether its frozen parameters are kept too."""
    fields = dict(scheduler_state=scheduler.state_dict(), loop=loop, config=redact_values(config),
                  steps_per_epoch=steps_per_epoch,
                  world_size=world_size, metrics=metrics)
    if sharded:
        save_sharded(directory, model=model, optimizer=optimizer, frozen=frozen, **fields)
    else:
        frozen_names = set() if frozen else frozen_parameter_names(model)
        model_state = {k: v for k, v in model.state_dict().items() if k not in frozen_names}
        save(directory, model_state=model_state, optimizer_state=optimizer.state_dict(), **fields)


def frozen_parameter_names(model: torch.nn.Module) -> set[str]:
    """The state-dict names of the parameters that do not train (a tied one under each of its names)."""
    return {name for name, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}


def load_model_into(model: torch.nn.Module, model_state: dict, frozen: bool, where) -> None:
    """`model_state` into `model`: all of it, or (`frozen` False) all but its frozen parameters,
    which the model has already; ValueError if the checkpoint's names are not the model's."""
    if frozen:
        model.load_state_dict(model_state)
        return
    missing, unexpected = model.load_state_dict(model_state, strict=False)
    wrong = sorted(set(missing) - frozen_parameter_names(model)) + sorted(unexpected)
    if wrong:
        raise ValueError(f"checkpoint {where} does not fit the model: {len(wrong)} names differ (first: {wrong[0]})")


def _dcp_options(frozen: bool):
    from torch.distributed.checkpoint.state_dict import StateDictOptions  # (lazy: torch.distributed.checkpoint)

    # (strict off: the frozen names are left out on both sides, and the model keeps its own values)
    return StateDictOptions(ignore_frozen_params=not frozen, strict=frozen)


def restore(directory: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
            scheduler: torch.optim.lr_scheduler.LRScheduler, *, sharded: bool, frozen: bool = True) -> LoopState:
    """Load a checkpoint into the model, optimizer and scheduler in place; returns the loop state.
    Sharded, every worker calls this at once and reads its part, whatever the world size that wrote it.
    `frozen` False: the checkpoint holds no frozen parameters; the model's own stay."""
    if sharded:
        state = load_sharded(directory, model, optimizer, frozen)
    else:
        state = load(directory)
        load_model_into(model, state["model"], frozen, directory)
        optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    return state["loop"]


def written_bytes(directory: str | Path) -> int:
    """The size of what a worker wrote into a checkpoint directory."""
    return sum(p.stat().st_size for p in Path(directory).iterdir())


def upload_order(names) -> list[str]:
    """The order to upload a checkpoint's files in: meta.json last, since it marks the rest complete."""
    return sorted(names, key=lambda name: name == META_FILE)


def has_sharded_layout(directory: str | Path) -> bool:
    return (Path(directory) / TRAIN_STATE_FILE).is_file() or (Path(directory) / MANIFEST_FILE).is_file()


def load_sharded(directory: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 frozen: bool = True) -> dict[str, Any]:
    """Every worker calls this at once: load its part of the model and optimizer (re-sharded to the
    current world size) in place; returns the scheduler state, loop state and config."""
    import torch.distributed.checkpoint as dcp  # (lazy: torch.distributed.checkpoint)

    # (lazy: torch.distributed.checkpoint)
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    directory = Path(directory)
    if not (directory / TRAIN_STATE_FILE).is_file():
        raise ValueError(f"checkpoint {directory} is not a sharded checkpoint (parallel.strategy: fsdp); "
                         "it was written with parallel.strategy: ddp, which this run cannot load")
    state = torch.load(directory / TRAIN_STATE_FILE, map_location="cpu", weights_only=True)
    _check_version(directory, state)
    model_state, optimizer_state = get_state_dict(model, optimizer, options=_dcp_options(frozen))
    shards = {"model": model_state, "optimizer": optimizer_state}
    dcp.load(shards, checkpoint_id=directory)
    set_state_dict(model, optimizer, model_state_dict=shards["model"], optim_state_dict=shards["optimizer"],
                   options=_dcp_options(frozen))
    state["loop"] = LoopState(**state["loop"])
    return state


def load_model_state(directory: str | Path, model: torch.nn.Module, frozen: bool = True) -> dict[str, torch.Tensor]:
    """The model's full (consolidated) state dict from either layout, in one process: `model`, an
    unsharded instance of the same architecture, gives the keys and shapes (`frozen` False: all
    but its frozen parameters, which the checkpoint does not hold)."""
    if not has_sharded_layout(directory):
        return load(directory)["model"]
    import torch.distributed.checkpoint as dcp  # (lazy: torch.distributed.checkpoint)

    left_out = set() if frozen else frozen_parameter_names(model)
    state = {"model": {k: v.clone() for k, v in model.state_dict().items() if k not in left_out}}
    dcp.load(state, checkpoint_id=Path(directory), no_dist=True)
    return state["model"]


def sharded_model_tensors(directory: str | Path) -> dict:
    """A sharded checkpoint's model tensors by their names in the model -> DCP's TensorStorageMetadata
    (`size`, `properties.dtype`), read from its manifest alone."""
    import torch.distributed.checkpoint as dcp  # (lazy: torch.distributed.checkpoint)

    stored = dcp.FileSystemReader(str(directory)).read_metadata().state_dict_metadata
    return {key[len("model."):]: item for key, item in stored.items() if key.startswith("model.")}


def load_model_tensors(directory: str | Path, tensors: dict[str, torch.Tensor]) -> None:
    """Read the named model tensors of a sharded checkpoint into `tensors` (of the stored sizes) in
    place, in one process, each from whichever shards hold its slices; nothing else is read."""
    import torch.distributed.checkpoint as dcp  # (lazy: torch.distributed.checkpoint)

    dcp.load({"model": tensors}, checkpoint_id=Path(directory), no_dist=True)


def _check_version(directory, state: dict) -> None:
    if state.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"checkpoint {directory} has format {state.get('format_version')}; "
                         f"this version reads format {FORMAT_VERSION}")


def load(directory: str | Path) -> dict[str, Any]:
    path = Path(directory) / STATE_FILE
    if not path.is_file():
        if has_sharded_layout(directory):
            raise ValueError(f"checkpoint {directory} is sharded (written with parallel.strategy: fsdp); "
                             "this run (parallel.strategy: ddp) cannot load it")
        raise FileNotFoundError(f"{directory} holds no {STATE_FILE}: not a checkpoint of this service")
    state = torch.load(path, map_location="cpu", weights_only=True)
    _check_version(directory, state)
    state["loop"] = LoopState(**state["loop"])
    return state


def step_of(directory_name: str) -> Optional[int]:
    match = DIR_PATTERN.match(directory_name.rstrip("/").rsplit("/", 1)[-1])
    return int(match.group(1)) if match else None


def read_meta(fs: pafs.FileSystem, directory: str) -> Optional[dict]:
    """A checkpoint's meta.json, or None if it is not there (yet) or cut short."""
    try:
        with fs.open_input_stream(f"{directory}/{META_FILE}") as stream:
            meta = json.loads(stream.read())
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) else None  # (JSON, but not a meta.json this service wrote)


def metrics_of(fs: pafs.FileSystem, directory: str) -> dict:
    """The metrics a checkpoint recorded with its step, `{**metrics, "step": step}`; {} without meta.json."""
    meta = read_meta(fs, directory)
    return {**meta.get("metrics", {}), "step": meta["step"]} if meta else {}


def is_complete(fs: pafs.FileSystem, directory: str) -> bool:
    """A checkpoint is complete when meta.json is there and every file it records (state.pt, or
    each shard of a sharded checkpoint) has the size it records."""
    meta = read_meta(fs, directory)
    if meta is None or meta.get("format_version") != FORMAT_VERSION:
        return False
    expected = meta.get("files") if meta.get("layout") == "sharded" else {STATE_FILE: meta.get("state_bytes")}
    # A meta.json of the wrong shape (edited, or not this service's) marks nothing complete: resume passes it by.
    if not isinstance(expected, dict) or not expected or not all(
            isinstance(name, str) and type(size) is int for name, size in expected.items()):
        return False
    found = fs.get_file_info([f"{directory}/{name}" for name in expected])
    return all(info.type == pafs.FileType.File and info.size == size for info, size in zip(found, expected.values()))


def newest_complete(fs: pafs.FileSystem, run_dir: str, newer_than: int = -1) -> Optional[tuple[int, str]]:
    """(step, path) of the newest complete checkpoint in run_dir after step `newer_than`, if any."""
    try:
        entries = fs.get_file_info(pafs.FileSelector(run_dir, allow_not_found=True))
    except OSError:
        return None
    found = sorted(((step_of(e.base_name), e.path) for e in entries
                    if e.type == pafs.FileType.Directory and step_of(e.base_name) is not None), reverse=True)
    for step, path in found:
        if step > newer_than and is_complete(fs, path):
            return step, path
    return None


def unregistered_to_remove(names: list[str], kept: set[str], latest_registered_step: int,
                           newest_complete_step: Optional[int]) -> list[str]:
    """Which checkpoint directories (by name) in a run's directory `checkpoint.keep` has outlived:
    those Ray Train does not keep (`kept`, the names of its kept checkpoints) that are older than
    its latest registered one. Such a directory Ray Train never registered (a resume point written
    by a save it did not register before the driver died, an upload cut short), so its own keep-N
    cleanup never removes it. Newer ones may be being written, or be the next resume point: they
    stay, and so does the newest complete checkpoint, whatever its step."""
    stale = []
    for name in names:
        step = step_of(name)
        if step is None or name in kept or step >= latest_registered_step or step == newest_complete_step:
            continue
        stale.append(name)
    return sorted(stale)


# --- PBT: a donor's checkpoint on another trial's hyperparameters ----------------------------------

def rebase_optimizer(source_dir: str | Path, destination: str | Path, optim) -> None:
    """Copy the complete checkpoint `source_dir` (either layout) to the new directory `destination`,
    with the optimizer's hyperparameters replaced by `optim`'s (an OptimConfig). Weights, moments and
    step stay the source's; the learning rate keeps the source's position in its schedule (the ratio
    lr / initial_lr), and weight decay, betas or momentum, the scheduler's base rates and the stored
    config's `optim` section become `optim`'s. Runs in one process (a trial's driver): a sharded
    checkpoint is read whole and written again as one shard, which loads at any world size."""
    source, destination = Path(source_dir), Path(destination)
    if not is_complete(pafs.LocalFileSystem(), str(source)):
        raise ValueError(f"{source} is not a complete checkpoint of format {FORMAT_VERSION}")
    destination.mkdir(parents=True)
    meta = json.loads((source / META_FILE).read_text())
    sharded = meta.get("layout") == "sharded"
    state_file = TRAIN_STATE_FILE if sharded else STATE_FILE
    state = torch.load(source / state_file, map_location="cpu", weights_only=True)
    _check_version(source, state)
    if sharded:  # the param_groups are in the shards; train_state.pt holds the scheduler and config
        groups = _rebase_shards(source, destination, optim)
    else:
        groups = state["optimizer"]["param_groups"]
        _rebase_param_groups(groups, optim)
    scheduler = state["scheduler"]
    scheduler["base_lrs"] = [optim.lr] * len(scheduler.get("base_lrs", [None]))
    if "_last_lr" in scheduler:
        scheduler["_last_lr"] = [group["lr"] for group in groups]
    state["config"]["optim"] = optim.model_dump(mode="json")
    torch.save(state, destination / state_file)
    # The recorded sizes are what mark the copy complete: meta.json, written last, records them.
    if sharded:
        meta["files"] = dict(sorted(_file_sizes(destination).items()))
    else:
        meta["state_bytes"] = (destination / STATE_FILE).stat().st_size
    (destination / META_FILE).write_text(json.dumps(meta, indent=2))


def _rebase_param_groups(groups: list[dict], optim) -> None:
    settings = {"lr": optim.lr, "weight_decay": optim.weight_decay}
    settings.update({"betas": tuple(optim.betas)} if optim.name == "adamw" else {"momentum": optim.momentum})
    for group in groups:
        scale = group["lr"] / group.get("initial_lr", group["lr"])  # where the source was in its schedule
        group.update(settings, initial_lr=optim.lr, lr=optim.lr * scale)


def _rebase_shards(source: Path, destination: Path, optim) -> list[dict]:
    """The model and optimizer of a sharded checkpoint, with its param_groups rebased, written to
    `destination` as one shard (and its manifest); returns the rebased param_groups."""
    import torch.distributed.checkpoint as dcp  # (lazy: torch.distributed.checkpoint)
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata  # (lazy: torch.distributed.checkpoint)

    # The whole state as DCP flattened it ("model.<name>", "optimizer.state.<name>.exp_avg",
    # "optimizer.param_groups.0.lr", ...), into a template made from the manifest alone: a tensor
    # of each recorded size, a placeholder for each pickled value. No model is needed.
    manifest = dcp.FileSystemReader(str(source)).read_metadata().state_dict_metadata
    flat = {key: torch.empty(item.size, dtype=item.properties.dtype) if isinstance(item, TensorStorageMetadata)
            else None for key, item in manifest.items()}
    dcp.load(flat, checkpoint_id=source, no_dist=True)
    groups: dict[int, dict] = {}
    for key in [k for k in flat if k.startswith(PARAM_GROUPS_KEY)]:
        index, name = key[len(PARAM_GROUPS_KEY):].split(".", 1)
        groups.setdefault(int(index), {})[name] = flat.pop(key)
    ordered = [groups[index] for index in sorted(groups)]
    assert ordered, f"{source} holds no optimizer param_groups"
    _rebase_param_groups(ordered, optim)
    for index, group in enumerate(ordered):
        flat.update({f"{PARAM_GROUPS_KEY}{index}.{name}": value for name, value in group.items()})
    dcp.save(flat, checkpoint_id=destination, no_dist=True)
    return ordered
