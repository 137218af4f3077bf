"""The checkpoint format: one directory, complete and versioned.

    state.pt   model (unwrapped state dict), optimizer, scheduler, loop state, resolved config
    meta.json  format version, step, epoch, position in the epoch, world size, metrics, and the
               size of state.pt: written last, it is what makes a checkpoint complete

The sample order and every random stream are pure functions of (seed, step, rank) (see
training/data/loader.py and `step_seed`), so (seed, step) is the complete RNG state: a run resumed
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

import numpy as np
import pyarrow.fs as pafs
import torch

FORMAT_VERSION = 1
STATE_FILE = "state.pt"
META_FILE = "meta.json"
DIR_PATTERN = re.compile(r"^checkpoint-(\d{8})$")


@dataclass
class LoopState:
    step: int = 0
    best_metric: Optional[float] = None
    evals_without_improvement: int = 0
    stopped_early: bool = False


def step_seed(seed: int, step: int, rank: int) -> int:
    return int(np.random.SeedSequence([seed, step, rank]).generate_state(1)[0])


def checkpoint_dir_name(step: int) -> str:
    return f"checkpoint-{step:08d}"


def save(directory: str | Path, *, model_state: dict, optimizer_state: dict, scheduler_state: dict,
         loop: LoopState, config: dict, steps_per_epoch: int, world_size: int, metrics: dict) -> None:
    directory = Path(directory)
    epoch, position = divmod(loop.step, steps_per_epoch)
    torch.save({"format_version": FORMAT_VERSION, "model": model_state, "optimizer": optimizer_state,
                "scheduler": scheduler_state, "loop": asdict(loop), "config": config}, directory / STATE_FILE)
    meta = {"format_version": FORMAT_VERSION, "step": loop.step, "epoch": epoch, "position_in_epoch": position,
            "steps_per_epoch": steps_per_epoch, "world_size": world_size,
            "state_bytes": (directory / STATE_FILE).stat().st_size,
            "rng": {"scheme": "seeded per (seed, step, rank)", "seed": config["seed"]},
            "metrics": {k: v for k, v in metrics.items() if isinstance(v, (int, float))}}
    (directory / META_FILE).write_text(json.dumps(meta, indent=2))


def load(directory: str | Path) -> dict[str, Any]:
    path = Path(directory) / STATE_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{directory} holds no {STATE_FILE}: not a checkpoint of this service")
    state = torch.load(path, map_location="cpu", weights_only=True)
    if state.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"checkpoint {directory} has format {state.get('format_version')}; "
                         f"this version reads format {FORMAT_VERSION}")
    state["loop"] = LoopState(**state["loop"])
    return state


def step_of(directory_name: str) -> Optional[int]:
    match = DIR_PATTERN.match(directory_name.rstrip("/").rsplit("/", 1)[-1])
    return int(match.group(1)) if match else None


def is_complete(fs: pafs.FileSystem, directory: str) -> bool:
    """A checkpoint is complete when meta.json is there and state.pt has the size it records."""
    meta_info, state_info = fs.get_file_info([f"{directory}/{META_FILE}", f"{directory}/{STATE_FILE}"])
    if meta_info.type != pafs.FileType.File or state_info.type != pafs.FileType.File:
        return False
    try:
        with fs.open_input_stream(f"{directory}/{META_FILE}") as stream:
            meta = json.loads(stream.read())
    except (OSError, ValueError):
        return False  # meta.json cut short
    return meta.get("format_version") == FORMAT_VERSION and meta.get("state_bytes") == state_info.size


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
