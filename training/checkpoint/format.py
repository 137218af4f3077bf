"""The checkpoint format: one directory, complete and versioned.

    state.pt   model (unwrapped state dict), optimizer, scheduler, loop state, resolved config
    meta.json  format version, step, epoch, position in the epoch, world size, metrics, and the
               size of state.pt: written last, it is what makes a checkpoint complete

A sharded checkpoint (parallel.strategy: fsdp) holds instead, written by every worker at once:

    __<rank>_0.distcp  each worker's shard of the model and optimizer (torch.distributed.checkpoint)
    .metadata          the shards' manifest (rank 0): which slice of which tensor is where
    train_state.pt     scheduler, loop state, resolved config (rank 0)
    meta.json          as above (rank 0), with "layout": "sharded" and the size of every other file

Every worker uploads its own files; rank 0 uploads meta.json after its own. The workers' uploads
run side by side, so meta.json may land before another worker's shard: such a directory is still
incomplete (a file missing or shorter than recorded) and is never chosen. It becomes complete the
moment the last shard lands, whatever the order, with synchronous and asynchronous uploads alike.
The manifest lets it be loaded at any world size, re-sharded (or consolidated) on the way in.

The sample order and every random stream are pure functions of (seed, step, rank) (see
training/data/loader.py and training/worker/seeding.py), so (seed, step) is the complete RNG state: a run resumed
at step s draws exactly what it would have drawn.

A run resumes from the newest *complete* checkpoint in its directory, which may be newer than the
one Ray Train has registered (registration lags the upload, and a worker killed in between would
otherwise redo a whole interval); a directory whose upload was cut short is never chosen.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional

import pyarrow.fs as pafs
import torch

FORMAT_VERSION = 1
STATE_FILE = "state.pt"
META_FILE = "meta.json"
TRAIN_STATE_FILE = "train_state.pt"  # sharded layout
DIR_PATTERN = re.compile(r"^checkpoint-(\d{8})$")


@dataclass
class LoopState:
    step: int = 0
    best_metric: Optional[float] = None
    evals_without_improvement: int = 0
    stopped_early: bool = False


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
                 metrics: dict) -> None:
    """Every worker calls this at once (it is a collective), each with its own local directory:
    each writes its shard there, rank 0 also the manifest, train_state.pt and, last, meta.json."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    directory = Path(directory)
    model_state, optimizer_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=directory)
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0:
        torch.save({"format_version": FORMAT_VERSION, "scheduler": scheduler_state, "loop": asdict(loop),
                    "config": config}, directory / TRAIN_STATE_FILE)
    mine = {p.name: p.stat().st_size for p in directory.iterdir()}
    everyone = [mine]
    if dist.is_initialized() and dist.get_world_size() > 1:
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
    if rank == 0:
        files = {name: size for sizes in everyone for name, size in sizes.items()}
        _write_meta(directory, loop, config, steps_per_epoch, world_size, metrics,
                    {"layout": "sharded", "files": dict(sorted(files.items()))})


def is_sharded(directory: str | Path) -> bool:
    return (Path(directory) / TRAIN_STATE_FILE).is_file() or (Path(directory) / ".metadata").is_file()


def load_sharded(directory: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Every worker calls this at once: load its part of the model and optimizer (re-sharded to the
    current world size) in place; returns the scheduler state, loop state and config."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    directory = Path(directory)
    if not (directory / TRAIN_STATE_FILE).is_file():
        raise ValueError(f"checkpoint {directory} is not a sharded checkpoint (parallel.strategy: fsdp); "
                         "it was written with parallel.strategy: ddp, which this run cannot load")
    state = torch.load(directory / TRAIN_STATE_FILE, map_location="cpu", weights_only=True)
    _check_version(directory, state)
    model_state, optimizer_state = get_state_dict(model, optimizer)
    shards = {"model": model_state, "optimizer": optimizer_state}
    dcp.load(shards, checkpoint_id=directory)
    set_state_dict(model, optimizer, model_state_dict=shards["model"], optim_state_dict=shards["optimizer"])
    state["loop"] = LoopState(**state["loop"])
    return state


def load_model_state(directory: str | Path, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's full (consolidated) state dict from either layout, in one process: `model`, an
    unsharded instance of the same architecture, gives the keys and shapes."""
    if not is_sharded(directory):
        return load(directory)["model"]
    import torch.distributed.checkpoint as dcp

    state = {"model": {k: v.clone() for k, v in model.state_dict().items()}}
    dcp.load(state, checkpoint_id=Path(directory), no_dist=True)
    return state["model"]


def _check_version(directory, state: dict) -> None:
    if state.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"checkpoint {directory} has format {state.get('format_version')}; "
                         f"this version reads format {FORMAT_VERSION}")


def load(directory: str | Path) -> dict[str, Any]:
    path = Path(directory) / STATE_FILE
    if not path.is_file():
        if is_sharded(directory):
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
            return json.loads(stream.read())
    except (OSError, ValueError):
        return None


def is_complete(fs: pafs.FileSystem, directory: str) -> bool:
    """A checkpoint is complete when meta.json is there and every file it records (state.pt, or
    each shard of a sharded checkpoint) has the size it records."""
    meta = read_meta(fs, directory)
    if meta is None:
        return False
    if meta.get("format_version") != FORMAT_VERSION:
        return False
    expected = meta["files"] if meta.get("layout") == "sharded" else {STATE_FILE: meta.get("state_bytes")}
    if not expected:
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
