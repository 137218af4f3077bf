"""The search space: job-config fields by dotted path, each with one distribution.

    optim.lr:               {loguniform: [1.0e-4, 3.0e-2]}
    model.options.dropout:  {uniform: [0.0, 0.5]}
    train.global_batch_size: {choice: [32, 64, 128]}
    seed:                   {grid: [0, 1, 2]}

Validated without Ray (`Dimension`, `flatten_space`); turned into Tune's domains only when the
sweep starts (`tune_param_space`, `pbt_mutations`).
"""

from __future__ import annotations

import math
from typing import Any, Optional

from pydantic import model_validator

from training.schema import Section

KINDS = ("uniform", "loguniform", "randint", "choice", "grid")
# Fields a sweep cannot vary: a trial's name is its trial's; all trials write to one tracking store
# and one storage path, so that the sweep can find and compare them.
FIXED_PREFIXES = ("name", "tracking", "checkpoint.storage_path", "data.cache_dir")
# PBT copies weights from one trial into another: their models and data must be the same.
PBT_FIXED_PREFIXES = ("model", "data")
# PBT continues a trial from another's checkpoint, data position included: the data order (and what
# a position in it means) depends on the global batch size, so all trials must share it.
PBT_FIXED_FIELDS = ("train.global_batch_size",)


class Dimension(Section):

    # A float drawn uniformly from [low, high].
    uniform: Optional[tuple[float, float]] = None
    # A float whose logarithm is uniform: for learning rates and weight decays (low > 0).
    loguniform: Optional[tuple[float, float]] = None
    # An int from [low, high) (high excluded, as in Python's range).
    randint: Optional[tuple[int, int]] = None
    # One of the values, drawn at random (or each in turn with search.algorithm: grid).
    choice: Optional[list[Any]] = None
    # Every value, each in its own trial (times num_samples).
    grid: Optional[list[Any]] = None

    @model_validator(mode="after")
    def _one_kind(self) -> "Dimension":
        given = [kind for kind in KINDS if getattr(self, kind) is not None]
        if len(given) != 1:
            raise ValueError(f"give exactly one of {', '.join(KINDS)}")
        low_high = self.uniform or self.loguniform or self.randint
        if low_high is not None and not low_high[0] < low_high[1]:
            raise ValueError(f"{self.kind}: low ({low_high[0]}) must be below high ({low_high[1]})")
        if self.loguniform is not None and self.loguniform[0] <= 0:
            raise ValueError("loguniform: low must be above 0")
        if self.values is not None and not self.values:
            raise ValueError(f"{self.kind}: give at least one value")
        return self

    @property
    def kind(self) -> str:
        return next(kind for kind in KINDS if getattr(self, kind) is not None)

    @property
    def values(self) -> Optional[list[Any]]:
        return self.choice if self.choice is not None else self.grid

    def representatives(self) -> list[Any]:
        """Values that stand for the whole range when validating it against the job config."""
        if self.values is not None:
            return list(self.values)
        low, high = self.uniform or self.loguniform or self.randint
        if self.randint is not None:
            return [low, high - 1]
        middle = math.sqrt(low * high) if self.loguniform else (low + high) / 2
        return [low, middle, high]

    def describe(self) -> str:
        if self.values is not None:
            return f"{self.kind}({self.values})"
        return f"{self.kind}{tuple(getattr(self, self.kind))}"


def flatten_space(raw: dict, prefix: str = "") -> dict[str, Any]:
    """Nested sections are allowed (`optim: {lr: {...}}`) and flattened to dotted paths. A mapping
    is a section when each of its values is a mapping; otherwise it is a dimension."""
    flat: dict[str, Any] = {}
    for key, value in raw.items():
        path = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, dict) and value and all(isinstance(v, dict) for v in value.values()):
            flat.update(flatten_space(value, path))
        else:
            flat[path] = value
    return flat


def plain(value: Any) -> Any:
    """Tune's samples as plain Python values (numpy scalars become int/float)."""
    if hasattr(value, "item") and not isinstance(value, (list, dict, str)):
        return value.item()
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value


def tune_param_space(space: dict[str, Dimension], algorithm: str) -> dict[str, Any]:
    from ray import tune  # (lazy: ray)

    def domain(dim: Dimension):
        if dim.kind == "uniform":
            return tune.uniform(*dim.uniform)
        if dim.kind == "loguniform":
            return tune.loguniform(*dim.loguniform)
        if dim.kind == "randint":
            return tune.randint(*dim.randint)
        if dim.kind == "grid" or algorithm == "grid":
            return tune.grid_search(list(dim.values))
        return tune.choice(list(dim.values))

    return {path: domain(dim) for path, dim in space.items()}


def pbt_mutations(space: dict[str, Dimension]) -> dict[str, Any]:
    """PBT resamples from the same distributions (lists for choices: it may also step to a neighbour)."""
    from ray import tune  # (lazy: ray)

    mutations = {}
    for path, dim in space.items():
        if dim.values is not None:
            mutations[path] = list(dim.values)
        elif dim.kind == "uniform":
            mutations[path] = tune.uniform(*dim.uniform)
        elif dim.kind == "loguniform":
            mutations[path] = tune.loguniform(*dim.loguniform)
        else:
            mutations[path] = tune.randint(*dim.randint)
    return mutations
