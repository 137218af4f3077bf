"""The job config: one typed section per component, composed into `JobConfig` (the driver; the CLIs).

YAML is validated once, here, at the boundary. Unknown keys and bad values raise `ConfigError`
naming the dotted path of the field and what is allowed, before anything starts. The `model` and
`data` sections are chosen by `model.name` and `data.source` among the members their registries
hand them (each family's and source's own typed options); `failure.mode` names a failure mode.
No torch or Ray is imported here.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Annotated, Any, Literal, Optional, Union

import yaml
from pydantic import Field, StrictInt, ValidationError, field_validator, model_validator

from training.data.registry import DataConfig
from training.errors import ConfigError
from training.failure.registry import FAILURE_MODES
from training.models.registry import ModelConfig
from training.observe.notify import shown_url
from training.redaction import redact_values
from training.run.generate_config import EvalConfig, check_generates
from training.schema import Section, load_yaml, set_path, storage_location, validation_problems
from training.tracking_config import TrackingConfig


class OptimConfig(Section):
    name: Literal["adamw", "sgd"] = "adamw"
    lr: float = Field(1e-3, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    # Adam's moment decay rates, each in [0, 1).
    betas: tuple[Annotated[float, Field(ge=0, lt=1)], Annotated[float, Field(ge=0, lt=1)]] = (0.9, 0.999)
    momentum: float = Field(0.9, ge=0, lt=1)
    # Linear warmup for this many steps, then cosine decay to lr * min_lr_ratio.
    warmup_steps: int = Field(0, ge=0)
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    # Clip the global gradient norm; null turns clipping off.
    grad_clip_norm: Optional[float] = Field(1.0, gt=0)


class EarlyStoppingConfig(Section):
    metric: str = "val_loss"
    mode: Literal["min", "max"] = "min"
    # Stop after this many evaluations without an improvement larger than min_delta.
    patience_evals: int = Field(3, ge=1)
    min_delta: float = Field(0.0, ge=0)


class ProfileConfig(Section):
    # Steps a..b (counted from 1, both included) traced with torch.profiler on rank 0; the trace
    # (Chrome trace format) is written to <run dir>/profile/ and logged to MLflow under profile/.
    steps: tuple[Annotated[int, Field(ge=1)], Annotated[int, Field(ge=1)]]

    @field_validator("steps")
    @classmethod
    def _ordered(cls, steps):
        first, last = steps
        if last < first:
            raise ValueError(f"[{first}, {last}]: the first step comes after the last; write [a, b] with a <= b")
        if last - first >= 1000:
            raise ValueError(f"[{first}, {last}]: at most 1000 steps are traced (a trace grows with every step)")
        return steps


class TrainConfig(Section):
    # Length of the run: exactly one of max_steps and epochs.
    max_steps: Optional[int] = Field(None, ge=1, le=10 ** 12)
    epochs: Optional[float] = Field(None, gt=0, le=10 ** 6)
    # Samples per optimizer step across all workers; constant whatever the world size.
    global_batch_size: int = Field(64, ge=1)
    # Largest batch one worker runs forward at once; more is gradient accumulation.
    micro_batch_size: Optional[int] = Field(None, ge=1)
    # auto: bf16 autocast on CUDA, fp32 on CPU.
    precision: Literal["auto", "fp32", "bf16"] = "auto"
    eval_every_n_steps: int = Field(50, ge=1)
    log_every_n_steps: int = Field(10, ge=1)
    # Metrics are reported at most this often (Ray Train's controller takes one report per poll);
    # evaluations and checkpoints are always reported.
    min_report_interval_s: float = Field(1.0, ge=0)
    early_stopping: Optional[EarlyStoppingConfig] = None
    # Threads torch may use in each worker; default: the worker's CPUs.
    torch_threads: Optional[int] = Field(None, ge=1)
    # torch.compile the model (each transformer block, or the whole model); needs a C++ compiler on CPU.
    compile: bool = False
    # A torch.profiler trace of a few steps on rank 0: {steps: [a, b]}.
    profile: Optional[ProfileConfig] = None

    def total_steps(self, steps_per_epoch: int) -> int:
        """The run's length in steps, once the data (its steps per epoch) is known."""
        if self.max_steps is not None:
            return self.max_steps
        return max(1, int(round(self.epochs * steps_per_epoch)))

    @model_validator(mode="after")
    def _one_length(self) -> "TrainConfig":
        if (self.max_steps is None) == (self.epochs is None):
            raise ValueError("set exactly one of train.max_steps and train.epochs")
        if self.profile is not None and self.max_steps is not None:
            check_profile_range(self.profile, self.max_steps, "train.max_steps")
        return self


def check_profile_range(profile: ProfileConfig, total_steps: int, what: str) -> None:
    """The profiled steps lie within the run (ConfigError naming the field otherwise)."""
    first, last = profile.steps
    if last > total_steps:
        raise ConfigError(f"train.profile.steps [{first}, {last}] ends after the run's last step ({what}: "
                          f"{total_steps}); profile steps within 1..{total_steps}")


class ScalingConfig(Section):
    # A fixed number of workers, or [min, max] for elastic training.
    num_workers: Union[StrictInt, tuple[StrictInt, StrictInt]] = 2
    # auto: GPUs when the cluster has any, or can grow to have some ($TRAINING_CLUSTER_CONFIG, the
    # launcher's config, which cluster.yaml names on the head).
    use_gpu: Union[bool, Literal["auto"]] = "auto"
    cpus_per_worker: float = Field(1.0, gt=0)
    resources_per_worker: dict[str, Annotated[float, Field(ge=0)]] = Field(default_factory=dict)
    # Elastic runs: how often Ray Train checks whether more workers fit (each grow is a restart
    # from the latest checkpoint, so not too often).
    resize_check_interval_s: float = Field(60.0, ge=0)

    @field_validator("num_workers")
    @classmethod
    def _workers(cls, value):
        low, high = (value, value) if isinstance(value, int) else value
        if low < 1 or high < low:
            raise ValueError("must be a positive int, or [min, max] with 1 <= min <= max")
        return value

    @property
    def min_workers(self) -> int:
        return self.num_workers if isinstance(self.num_workers, int) else self.num_workers[0]

    @property
    def max_workers(self) -> int:
        return self.num_workers if isinstance(self.num_workers, int) else self.num_workers[1]


class ParallelConfig(Section):
    # ddp: a full replica per worker, gradients all-reduced. fsdp: FSDP2 (fully_shard per
    # transformer block, then the root): parameters, gradients and optimizer state sharded across
    # workers, checkpoints written as one shard per worker (torch.distributed.checkpoint).
    strategy: Literal["ddp", "fsdp"] = "ddp"
    # fsdp: dtype of the parameters used in forward/backward. auto: bf16 on CUDA, fp32 on CPU.
    # Gradients are reduced in fp32 and the sharded master weights stay fp32.
    mixed_precision: Literal["auto", "fp32", "bf16"] = "auto"
    # Recompute each transformer block's activations in backward instead of keeping them.
    activation_checkpointing: bool = False
    # fsdp on CUDA: keep sharded parameters, gradients and optimizer state in host memory.
    cpu_offload: bool = False

    @model_validator(mode="after")
    def _offload_needs_fsdp(self) -> "ParallelConfig":
        if self.cpu_offload and self.strategy != "fsdp":
            raise ValueError("parallel.cpu_offload needs parallel.strategy: fsdp")
        return self


class FailureConfig(Section):
    # restart: a dead worker restarts the whole worker group from the latest checkpoint.
    # continue: every worker is a torchft replica group; the others keep stepping without it, Ray
    # Train replaces only the lost one, and it takes the live state from a peer (parallel.strategy
    # ddp, a fixed scaling.num_workers >= 2; see README "Continuous training").
    mode: Literal[tuple(FAILURE_MODES)] = "restart"
    # Worker or node failures the run survives (each restart, or each replaced worker, counts one).
    max_failures: int = Field(3, ge=-1)
    # Spot preemptions have their own budget; -1 is unlimited.
    max_preemption_failures: int = Field(-1, ge=-1)
    # A worker group that cannot be placed (too few free CPUs, GPUs or resources) this long in a row
    # fails the run; long enough for an autoscaler to bring nodes up.
    placement_timeout_s: float = Field(600.0, gt=0)


class CheckpointConfig(Section):
    # Local path or s3://bucket/prefix. Runs live in <storage_path>/<run name>.
    storage_path: str = "runs"
    every_n_steps: int = Field(100, ge=1)
    # Keep this many checkpoints, the best by score_metric (the latest is always kept too).
    keep: int = Field(2, ge=1)
    score_metric: str = "val_loss"
    score_mode: Literal["min", "max"] = "min"
    # sync: training waits while a checkpoint is copied to storage; async: training goes on and
    # Ray Train uploads in the background (the checkpoint counts once uploaded).
    upload: Literal["sync", "async"] = "sync"

    @field_validator("storage_path")
    @classmethod
    def _storage_path(cls, value):
        return storage_location(value)


class JobConfig(Section):
    # Run name: a run whose name exists in storage is resumed. Default: <config>-<timestamp>.
    name: Optional[str] = Field(None, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
    # Seeds the model's initial weights, the data order and every step's random draws.
    seed: int = Field(0, ge=0, lt=2 ** 32)
    # A model family (training/models/registry.py) or a plug-in "package.module:function", and its options.
    model: ModelConfig = Field(default_factory=dict, validate_default=True)
    # A data source (training/data/registry.py) or a plug-in "package.module:function", and its options.
    data: DataConfig = Field(default_factory=dict, validate_default=True)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    train: TrainConfig = Field(default_factory=lambda: TrainConfig(max_steps=200))
    scaling: ScalingConfig = Field(default_factory=ScalingConfig)
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    failure: FailureConfig = Field(default_factory=FailureConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    # Checks of the final model at the run's end: {generate: {prompts, max_new_tokens}} (training/run/generate.py).
    eval: EvalConfig = Field(default_factory=EvalConfig)

    @model_validator(mode="after")
    def _consistent(self) -> "JobConfig":
        if self.train.global_batch_size < self.scaling.max_workers:
            raise ConfigError(f"train.global_batch_size ({self.train.global_batch_size}) must be at least "
                              f"scaling.num_workers ({self.scaling.max_workers}): every worker needs samples")
        refusal = FAILURE_MODES[self.failure.mode].refuses(self)
        if refusal:
            raise ConfigError(refusal)
        # (a model the job's other sections cannot train: a family's section may say why, hf's qlora under fsdp)
        refusal = getattr(self.model, "refuses", lambda job: None)(self)
        if refusal:
            raise ConfigError(refusal)
        if self.eval.generate is not None:
            check_generates(self.model)
        bind_model = getattr(self.data, "bind_model", None)  # (a source that reads the model's files: its tokenizer)
        if bind_model is not None:
            bind_model(self.model)
        return self


# Fields that define what a run computes: resuming a run with any of them changed is refused. A run
# keeps its parallel strategy: its checkpoints are written in that strategy's layout.
IDENTITY_FIELDS = ("seed", "model", "data.source", "data.options", "optim", "train.global_batch_size",
                   "parallel.strategy")
# Fields that joined the identity after runs had been recorded: a record without one predates it,
# and is not compared on it.
LATER_IDENTITY_FIELDS = ("parallel.strategy",)


def parse_override(text: str) -> tuple[list[str], Any]:
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set {text!r}: expected KEY=VALUE, such as --set train.max_steps=100")
    try:
        value = load_yaml(raw, "the value") if raw.strip() else None
    except ValueError as exc:
        raise ConfigError(f"--set {text!r}: {exc}") from None
    path = key.strip().split(".")
    if not all(part.strip() for part in path):
        raise ConfigError(f"--set {text!r}: {key.strip()!r} has an empty part; keys are dotted paths such as optim.lr")
    return path, value


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    """Apply `a.b=value` overrides to a raw config mapping (values parsed as YAML)."""
    result = copy.deepcopy(raw)
    for text in overrides:
        path, value = parse_override(text)
        try:
            result = set_path(result, ".".join(path), value)
        except ValueError as exc:
            raise ConfigError(f"--set {text!r}: {exc}") from None
    return result


def validate(raw: Any, source: str = "config", overrides: list[str] = ()) -> JobConfig:
    """`overrides`: the `--set` texts applied to `raw`, which a message blames for what they set."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: the top level must be a mapping of sections")
    try:
        return JobConfig.model_validate(raw)
    except ValidationError as exc:
        raise invalid(exc, source, JobConfig, overrides) from None
    except ConfigError as exc:
        raise ConfigError(f"{source} is invalid:\n  {exc}") from None


def invalid(error: ValidationError, source: str, root, overrides: list[str] = ()) -> ConfigError:
    """The message for a config that failed validation: a problem at, under or just above a key that
    a `--set` set is that --set's (`--set train.lr: unknown key; ...`), not the file's; the rest are
    the file's (`digits.yaml is invalid: ...`). The value is not repeated: it may hold a secret
    (a webhook's token), which the field's own message masks."""
    keys = [".".join(parse_override(text)[0]) for text in overrides]
    from_file, from_set = [], []
    for path, message in validation_problems(error, root=root):
        blamed = next((key for key in reversed(keys)  # (the last --set of a key is the one that holds)
                       if path == key or path.startswith(key + ".") or key.startswith(path + ".")), None)
        if blamed is None:
            from_file.append(f"  {path}: {message}")
        else:
            from_set.append(f"--set {blamed}: {message}" if path == blamed else f"--set {blamed}: {path}: {message}")
    head = [f"{source} is invalid:", *from_file] if from_file else []
    return ConfigError("\n".join(head + from_set))


def read_yaml_mapping(path: Path, what: str, hint: str) -> dict:
    """A YAML file whose top level is a mapping, or a ConfigError saying what is wrong with it."""
    if not path.is_file():
        raise ConfigError(f"{what} {path} does not exist; {hint}")
    try:
        raw = load_yaml(path.read_bytes(), str(path))
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if raw is None:
        raise ConfigError(f"{what} {path} is empty; {hint}")
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections")
    return raw


def load(path: Optional[str | Path], overrides: list[str] = (), name: Optional[str] = None) -> JobConfig:
    """Read a YAML job config, apply `--set` overrides and `--name`, and validate it."""
    raw: Any = {}
    source = "config"
    if path is not None:
        path = Path(path)
        source = str(path)
        raw = read_yaml_mapping(path, "config file", "shipped examples are in training/configs/")
    raw = apply_overrides(raw, list(overrides))
    if name is not None:
        raw["name"] = name
    return validate(raw, source, list(overrides))


def shown(config: JobConfig) -> dict:
    """The config as it may be shown and stored: passwords in URIs masked, webhook URLs as written
    when they reference variables, else masked (training.observe.notify.shown_url)."""
    dumped = redact_values(config.model_dump(mode="json"))
    for target in dumped["tracking"]["notify"]:
        target["url"] = shown_url(target["url"])
    return dumped


def without_notify(raw: dict) -> dict:
    """A raw (dumped) job config without webhooks, for the processes that never post (the workers, a
    sweep's trials): a webhook URL then travels to no other process and is stored nowhere."""
    return set_path(raw, "tracking.notify", []) if raw.get("tracking", {}).get("notify") else raw


def to_yaml(config: JobConfig) -> str:
    """The config as it is shown and stored (config.yaml, MLflow): see `shown`."""
    return yaml.safe_dump(shown(config), sort_keys=False)


def flatten(config: JobConfig) -> dict[str, str]:
    """The config as dotted keys, for MLflow params (passwords in URIs masked)."""
    flat: dict[str, str] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict) and value:
            for key, child in value.items():
                walk(f"{prefix}.{key}" if prefix else key, child)
        else:
            flat[prefix] = "null" if value is None else str(value)

    walk("", shown(config))
    return flat


def identity_of(config: JobConfig) -> dict[str, Any]:
    dumped = redact_values(config.model_dump(mode="json"))  # (stored in run.json)
    identity = {}
    for dotted in IDENTITY_FIELDS:
        node = dumped
        for part in dotted.split("."):
            node = node[part]
        identity[dotted] = node
    return identity
