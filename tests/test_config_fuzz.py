"""Property tests over the config schemas: whatever mapping a YAML file or `--set` can hold, loading
it gives a valid config or the one bad-input error (exit code 2) with a message; never another
exception (a traceback). In-process, no Ray."""

import math
import tempfile
from pathlib import Path
from typing import Annotated, Literal, Union, get_args, get_origin

import annotated_types
import pytest
import yaml
from conftest import CONFIGS
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from training import config as config_lib
from training.data.registry import SOURCES
from training.errors import UserError
from training.models.registry import MODELS
from tuning import config as sweep_config
from tuning.space import KINDS

SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True,
                    database=None)  # the same examples every run, and nothing written

ODD_TEXT = st.text(st.sampled_from(list("aZ09_.-:/ \t\n$`'\"!(){}[]*&|;<>\\é\x00\u202e")), max_size=12)
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-2 ** 70, 2 ** 70),
                    st.floats(allow_nan=True, allow_infinity=True), ODD_TEXT)
# Any YAML value: scalars, lists and mappings (keys of odd types too, as YAML allows), nested.
JUNK = st.recursive(SCALARS, lambda inner: st.one_of(
    st.lists(inner, max_size=3),
    st.dictionaries(st.one_of(ODD_TEXT, st.integers(-3, 3), st.none()), inner, max_size=3)), max_leaves=8)


def _section_type(annotation):
    """The config section (a pydantic model) a field holds, directly or as Optional[...]."""
    for candidate in (annotation, *get_args(annotation)):
        if get_origin(candidate) is Annotated:  # (a member of a chosen section: model, data)
            candidate = get_args(candidate)[0]
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


def _typical_values(annotation, info) -> list:
    """Values a field is likely to be given: its default, its literals, both sides of its bounds."""
    values = []
    if info is not None and info.default is not PydanticUndefined:
        values.append(info.default)
    stack = [annotation]
    while stack:
        current = stack.pop()
        if get_origin(current) is Literal:
            values += list(get_args(current))
        elif get_origin(current) in (Union, tuple, list, dict) or get_args(current):
            stack += [a for a in get_args(current) if a is not type(None)]
        elif current is bool:
            values += [True, False]
        elif current in (int, float):
            values += [0, 1, -1, 3]
    for bound in (info.metadata if info is not None else []):
        for name in ("ge", "gt", "le", "lt"):
            edge = getattr(bound, name, None)
            if isinstance(bound, getattr(annotated_types, name.capitalize())) and edge is not None:
                values += [edge, edge + 1, edge - 1, edge * 0.5 if edge else 1e-9]
    return [v for v in values if not callable(v)] or [None]


def section(model: type[BaseModel], special: dict = {}) -> st.SearchStrategy[dict]:
    """Mappings for one config section: some of its fields (mostly plausible values, sometimes junk),
    sometimes an unknown key."""
    fields = {}
    for name, info in model.model_fields.items():
        nested = _section_type(info.annotation)
        if name in special:
            fields[name] = st.one_of(special[name], JUNK)
        elif nested is not None:
            fields[name] = st.one_of(section(nested, special), JUNK)
        else:
            typical = st.sampled_from(_typical_values(info.annotation, info))
            fields[name] = st.one_of(typical, typical, typical, JUNK)
    fields["unknown_key"] = JUNK
    return st.fixed_dictionaries({}, optional=fields)


def _options(types) -> st.SearchStrategy[dict]:
    return st.one_of(*[section(t) for t in types], st.dictionaries(ODD_TEXT, JUNK, max_size=2))


SPECIAL = {
    "name": st.one_of(st.sampled_from([*MODELS, "plugins.examples:linear", "a:b:c"]), ODD_TEXT),
    "source": st.one_of(st.sampled_from([*SOURCES, "plugins.examples:blobs"]), ODD_TEXT),
    "options": _options([c.Config.model_fields["options"].annotation for c in [*MODELS.values(), *SOURCES.values()]]),
}
JOBS = st.one_of(section(config_lib.JobConfig, SPECIAL), JUNK)


def _loads_or_refuses(load):
    try:
        return load()
    except UserError as exc:  # what the command lines turn into exit code 2
        assert str(exc).strip(), "a bad-input error without a message"
        return None


@SETTINGS
@given(raw=JOBS)
@example(raw={"model": {"name": "gpt", "options": {"preset": []}}})  # (an unhashable preset was a TypeError)
@example(raw={"data": {"source": "tinylm", "options": {"seq_len": 2 ** 70}}})
def test_any_job_mapping_is_a_valid_config_or_a_bad_input_error(raw):
    job = _loads_or_refuses(lambda: config_lib.validate(raw, "fuzz.yaml"))
    if job is not None:  # and a valid config is stored and read back as itself
        assert config_lib.validate(yaml.safe_load(config_lib.to_yaml(job))) == job
        config_lib.identity_of(job), config_lib.flatten(job)


@SETTINGS
@given(overrides=st.lists(st.one_of(ODD_TEXT, st.builds(lambda k, v: f"{k}={v}", ODD_TEXT, ODD_TEXT),
                                    st.builds(lambda k, v: f"{k}={yaml.safe_dump(v, default_flow_style=True).strip()}",
                                              st.sampled_from(["optim.lr", "train", "scaling.num_workers",
                                                               "model.options", "seed", "optim.betas",
                                                               "train.max_steps.x"]), JUNK)),
                          max_size=3))
@example(overrides=["name=\x00"])  # (a control character was a YAML reader error, not a message)
def test_any_set_override_is_applied_or_refused(overrides):
    _loads_or_refuses(lambda: config_lib.load(CONFIGS / "digits.yaml", overrides))


DIMENSIONS = st.one_of(
    st.fixed_dictionaries({}, optional={kind: st.one_of(st.lists(SCALARS, max_size=3), JUNK) for kind in KINDS}),
    JUNK)
SPACE_PATHS = st.sampled_from(["optim.lr", "optim.weight_decay", "train.global_batch_size", "seed",
                               "model.options.dropout", "tracking.experiment", "name", "optim", "x.y",
                               "train.max_steps"])
SWEEPS = st.one_of(section(sweep_config.SweepConfig, {
    "base": st.one_of(st.just(str(CONFIGS / "digits.yaml")), st.just("missing.yaml"), JOBS),
    "space": st.one_of(st.dictionaries(SPACE_PATHS, DIMENSIONS, max_size=3), JUNK),
    "set": st.one_of(st.lists(st.sampled_from(["train.max_steps=5", "optim.lr=-1", "x=1", "=", "optim.lr"]),
                              max_size=2),
                     JUNK),
}), JUNK)


@pytest.fixture(scope="module")
def sweep_folder():
    with tempfile.TemporaryDirectory() as folder:
        yield Path(folder)


@settings(SETTINGS, max_examples=120)
@given(raw=SWEEPS)
def test_any_sweep_file_is_a_valid_sweep_or_a_bad_input_error(sweep_folder, raw):
    path = sweep_folder / "sweep.yaml"
    path.write_text(yaml.safe_dump(raw))
    _loads_or_refuses(lambda: sweep_config.load(path))


def test_the_typical_values_come_from_the_schema():
    lr = config_lib.OptimConfig.model_fields["lr"]
    assert 1e-3 in _typical_values(lr.annotation, lr) and 0 in _typical_values(lr.annotation, lr)
    precision = config_lib.TrainConfig.model_fields["precision"]
    assert {"auto", "fp32", "bf16"} <= set(_typical_values(precision.annotation, precision))
    assert not math.isnan(sum(v for v in _typical_values(lr.annotation, lr) if isinstance(v, (int, float))))
