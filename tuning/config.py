"""The sweep file: a base job config, overrides, a search space, the search algorithm and scheduler.

Validated once, here, without Ray: unknown keys and bad spaces raise `ConfigError` naming the
dotted path (`space.optim.lr.loguniform: ...`), and every value a dimension can take is checked
against the job config, so a trial never starts with a config the training run would refuse.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Optional, Union

from pydantic import Field, ValidationError

from training import config as config_lib
from training import storage
from training.config import JobConfig, ScalingConfig
from training.errors import ConfigError
from training.run.paths import base_dir
from training.run.preflight import check_cluster_config
from training.schema import Section, format_validation_error, set_path
from training.tasks import ALL_VALIDATION_METRICS
from tuning.space import FIXED_PREFIXES, PBT_FIXED_FIELDS, PBT_FIXED_PREFIXES, Dimension, flatten_space

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"


class SearchConfig(Section):
    # random: independent draws; grid: every combination of choice/grid values; optuna: TPE.
    algorithm: Literal["random", "grid", "optuna"] = "random"
    # Seeds the draws (numpy's RandomState, in Tune and in Optuna, takes 0 to 2**32 - 1); null: unseeded.
    seed: Optional[int] = Field(0, ge=0, lt=2 ** 32)


class SchedulerConfig(Section):
    # fifo: every trial runs to the end; asha: stops poor trials at rungs; pbt: population-based training.
    name: Literal["fifo", "asha", "pbt"] = "fifo"
    # ASHA: trials are first compared at this step; rungs at grace * reduction_factor^k steps.
    grace_period_steps: int = Field(50, ge=1)
    reduction_factor: float = Field(2.0, gt=1)
    # PBT: every this many steps the bottom quantile continues from a top trial's checkpoint
    # with perturbed hyperparameters.
    perturbation_interval_steps: int = Field(100, ge=1)
    quantile_fraction: float = Field(0.25, gt=0, le=0.5)
    resample_probability: float = Field(0.25, ge=0, le=1)
    # PBT: true makes every trial wait at each interval until all have reached it (a waiting trial
    # is paused, and later resumes its own run from its checkpoint). Exploits then compare trials
    # at the same step, whatever their start times, at the cost of a restart per interval.
    synch: bool = False


class TrialConfig(Section):
    # CPUs held by each trial's driver (the training run's driver: tracking, checks, final model).
    driver_cpus: float = Field(0.25, ge=0)
    # The training workers of every trial; replaces the base job's scaling section.
    scaling: Optional[ScalingConfig] = None
    # Times Tune restarts a trial that failed (it resumes its own training run). Worker deaths
    # inside a trial are the training run's own business (the job's failure section).
    max_failures: int = Field(0, ge=0)


class SweepConfig(Section):
    # The sweep's name; default: the sweep file's name. An existing sweep of that name is resumed.
    name: Optional[str] = Field(None, pattern=NAME_PATTERN)
    # The job config every trial starts from: a path (relative to the working directory) or inline.
    base: Union[str, dict[str, Any]]
    # Overrides on the base, as with `python -m training --set`.
    set: list[str] = Field(default_factory=list)
    # Job-config fields by dotted path -> {uniform|loguniform|randint|choice|grid: ...}.
    space: dict[str, Any] = Field(min_length=1)
    search: SearchConfig = Field(default_factory=SearchConfig)
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig)
    metric: Literal[ALL_VALIDATION_METRICS] = "val_accuracy"
    mode: Literal["min", "max"] = "max"
    # Trials to draw (with grid: times through the grid).
    num_samples: int = Field(8, ge=1)
    # Default: as many trials as fit on the cluster at once.
    max_concurrent_trials: Optional[int] = Field(None, ge=1)
    trial: TrialConfig = Field(default_factory=TrialConfig)


@dataclass(frozen=True)
class Sweep:
    """A validated sweep: its settings, the space by dotted path, and the base job (raw and typed)."""
    config: SweepConfig
    name: str
    space: dict[str, Dimension]
    base_raw: dict
    base: JobConfig

    def identity(self) -> dict:
        """What defines the sweep: resuming it with any of these changed is refused."""
        return {"space": {path: dim.describe() for path, dim in self.space.items()},
                "search": self.config.search.model_dump(), "scheduler": self.config.scheduler.model_dump(),
                "metric": self.config.metric, "mode": self.config.mode, "num_samples": self.config.num_samples,
                "base": config_lib.identity_of(self.base)}


def load(path: Optional[str | Path], overrides: list[str] = (), name: Optional[str] = None) -> Sweep:
    """Read a sweep file; `--set` keys naming a sweep field apply to the sweep, all others to the base job."""
    path = Path(path)
    raw = config_lib.read_yaml_mapping(path, "sweep file", "shipped examples are in tuning/sweeps/")
    sweep_keys = set(SweepConfig.model_fields)
    own = [text for text in overrides if text.partition("=")[0].split(".")[0].strip() in sweep_keys]
    raw = config_lib.apply_overrides(raw, own)
    if not isinstance(raw.get("set") or [], list):
        raise ConfigError(f"{path}: set: must be a list of KEY=VALUE overrides, such as "
                          f"[train.max_steps=320, optim.lr=0.01]; got {type(raw['set']).__name__}")
    raw["set"] = list(raw.get("set") or []) + [text for text in overrides if text not in own]
    if isinstance(raw.get("space"), dict):
        raw["space"] = flatten_space(raw["space"])
    try:
        sweep = SweepConfig.model_validate(raw)
    except ValidationError as exc:
        raise config_lib.invalid(exc, str(path), SweepConfig, own) from None
    final_name = name or sweep.name or path.stem
    if not re.fullmatch(NAME_PATTERN, final_name):
        raise ConfigError(f"name: {final_name!r} must start with a letter or digit and hold only letters, digits, "
                          "'_', '.' and '-' (at most 64)")
    base_raw, base = _load_base(sweep, path, [text for text in overrides if text not in own])
    space = _check_space(sweep, base_raw)
    if base.tracking.cluster_config:  # trials price themselves by it at their end: refused now if unusable
        check_cluster_config(storage.absolute(base.tracking.cluster_config, base_dir()))
    return Sweep(config=sweep, name=final_name, space=space, base_raw=base_raw, base=base)


def _load_base(sweep: SweepConfig, sweep_path: Path, cli_overrides: list[str] = ()) -> tuple[dict, JobConfig]:
    if isinstance(sweep.base, dict):
        raw, source = sweep.base, f"{sweep_path}: base"
    else:
        # Relative to the sweep file's folder first (as compose files are), then the working directory.
        base_path = Path(sweep.base)
        if not base_path.is_absolute() and (sweep_path.parent / base_path).is_file():
            base_path = sweep_path.parent / base_path
        raw = config_lib.read_yaml_mapping(base_path, "base: job config",
                                           "a relative path is looked up next to the sweep file, "
                                           "then in the working directory")
        source = f"base {base_path}"
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: the top level must be a mapping of sections")
    raw = config_lib.apply_overrides(raw, sweep.set)
    if sweep.trial.scaling is not None:
        raw["scaling"] = sweep.trial.scaling.model_dump(mode="json")
    raw.pop("name", None)  # each trial's run is named after the trial
    return raw, config_lib.validate(raw, source, cli_overrides)


def _check_space(sweep: SweepConfig, base_raw: dict) -> dict[str, Dimension]:
    space = {}
    for path, value in sweep.space.items():
        where = f"space.{path}"
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping such as {{uniform: [0.0, 0.5]}}, got {value!r}")
        try:
            dim = Dimension.model_validate(value)
        except ValidationError as exc:
            raise ConfigError("sweep file is invalid:\n" + format_validation_error(
                exc, prefix=where, root=Dimension)) from None
        fixed = next((p for p in FIXED_PREFIXES if path == p or path.startswith(p + ".")), None)
        if fixed:
            raise ConfigError(f"{where}: {fixed} is the same for every trial of a sweep and cannot be searched")
        if sweep.scheduler.name == "pbt" and path.split(".")[0] in PBT_FIXED_PREFIXES:
            raise ConfigError(f"{where}: PBT copies weights between trials, so it cannot vary model.* or data.*")
        if sweep.scheduler.name == "pbt" and path in PBT_FIXED_FIELDS:
            raise ConfigError(f"{where}: PBT continues trials from each other's checkpoints, data position "
                              "included, and the data order depends on the batch size: every trial needs the "
                              "same one; set it with set: instead, or use scheduler asha or fifo")
        if sweep.search.algorithm == "grid" and dim.values is None:
            raise ConfigError(f"{where}: search.algorithm grid needs choice or grid values, not {dim.kind}")
        if sweep.search.algorithm == "optuna" and dim.kind == "grid":
            raise ConfigError(f"{where}: grid is not supported by Optuna; use choice")
        for sample in dim.representatives():
            try:
                config_lib.validate(set_path(base_raw, path, sample), "trial")
            except (ConfigError, ValueError) as exc:
                detail = str(exc).split("\n", 1)[-1].strip()
                raise ConfigError(f"{where}: the value {sample!r} makes an invalid job config: {detail}") from None
        space[path] = dim
    if sweep.scheduler.name == "pbt" and sweep.search.algorithm == "optuna":
        raise ConfigError("search.algorithm: PBT draws its own trials; use random or grid with it")
    return space
