"""The sweep file's search algorithm and scheduler as Tune's objects, and the base job every trial
starts from (its paths made absolute: Tune runs each trial in a directory of its own)."""

from __future__ import annotations

import math

from training import storage
from training.config import without_notify
from training.schema import set_path
from tuning.config import Sweep
from tuning.space import pbt_mutations, tune_param_space

# Trials report the training step with every result; schedulers count in steps.
TIME_ATTR = "step"


def trial_count(sweep: Sweep) -> int:
    """Trials the sweep will run: num_samples, times the grid's size where there is a grid."""
    grid = [len(dim.values) for dim in sweep.space.values()
            if dim.kind == "grid" or (sweep.config.search.algorithm == "grid" and dim.values is not None)]
    return sweep.config.num_samples * (math.prod(grid) if grid else 1)


def param_space(sweep: Sweep) -> dict:
    if sweep.config.search.algorithm == "optuna":
        return {}  # Optuna's searcher holds the space
    return tune_param_space(sweep.space, sweep.config.search.algorithm)


def tune_config(sweep: Sweep, max_concurrent_trials: int):
    from ray import tune  # (lazy: ray)

    cfg = sweep.config
    # reuse_actors off (Tune's default, which PBT invites changing): a trial runs its training run in
    # a thread of its actor, and only the actor's end ends the run's Train controller and workers.
    # Tune applies max_concurrent_trials by wrapping a Searcher (Optuna) in a ConcurrencyLimiter; the
    # random and grid generator limits itself (its max_concurrent), and Tune would only warn that it
    # ignores the setting.
    limit = max_concurrent_trials if cfg.search.algorithm == "optuna" else None
    return tune.TuneConfig(metric=cfg.metric, mode=cfg.mode, num_samples=cfg.num_samples,
                           max_concurrent_trials=limit, reuse_actors=False,
                           search_alg=_search(sweep, max_concurrent_trials), scheduler=_scheduler(sweep))


def _search(sweep: Sweep, max_concurrent_trials: int):
    cfg = sweep.config.search
    if cfg.algorithm == "optuna":
        import optuna  # (lazy: optuna)
        from ray.tune.search.optuna import OptunaSearch  # (lazy: ray.tune)

        return OptunaSearch(space=tune_param_space(sweep.space, "optuna"), metric=sweep.config.metric,
                            mode=sweep.config.mode, sampler=optuna.samplers.TPESampler(seed=cfg.seed))
    from ray.tune.search.basic_variant import BasicVariantGenerator  # (lazy: ray.tune)

    return BasicVariantGenerator(random_state=cfg.seed, max_concurrent=max_concurrent_trials)


def _scheduler(sweep: Sweep):
    cfg = sweep.config.scheduler
    if cfg.name == "asha":
        from ray.tune.schedulers import ASHAScheduler  # (lazy: ray.tune)

        return ASHAScheduler(time_attr=TIME_ATTR, grace_period=cfg.grace_period_steps,
                             reduction_factor=cfg.reduction_factor, max_t=_max_steps(sweep))
    if cfg.name == "pbt":
        from ray.tune.schedulers import PopulationBasedTraining  # (lazy: ray.tune)

        return PopulationBasedTraining(time_attr=TIME_ATTR, perturbation_interval=cfg.perturbation_interval_steps,
                                       hyperparam_mutations=pbt_mutations(sweep.space),
                                       quantile_fraction=cfg.quantile_fraction,
                                       resample_probability=cfg.resample_probability, synch=cfg.synch)
    from ray.tune.schedulers import FIFOScheduler  # (lazy: ray.tune)

    return FIFOScheduler()


def _max_steps(sweep: Sweep) -> int:
    """Past the longest run, so that ASHA never stops a trial at its last step (it would end the
    trial before the run logs its final model). Epochs are counted in steps only once data is loaded."""
    steps = sweep.base.train.max_steps
    return steps + 1 if steps is not None else 10 ** 9


def absolute_base(sweep: Sweep, paths) -> dict:
    """The base job as trials receive it: storage, data cache and tracking at absolute locations."""
    # (trials do not post: the sweep does; no webhook URL goes into Tune's saved state)
    raw = without_notify(sweep.base.model_dump(mode="json"))
    raw = set_path(raw, "checkpoint.storage_path", paths.storage_path)
    raw = set_path(raw, "data.cache_dir", paths.data_cache)
    if paths.tracking_uri is not None:
        raw = set_path(raw, "tracking.tracking_uri", paths.tracking_uri)
    if sweep.base.tracking.cluster_config:
        raw = set_path(raw, "tracking.cluster_config", storage.absolute(sweep.base.tracking.cluster_config,
                                                                       paths.base_dir))
    return raw
