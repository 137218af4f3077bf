"""Every model family by name: adding one is a module (see training/models/family.py) and a line
here. The job config's `model` section is the union of their sections, chosen by `model.name`; an
import string names a plug-in (training/models/plugin.py)."""

from __future__ import annotations

from training.errors import UserError
from training.models import digits, gpt, hf, plugin
from training.models.family import ModelFamily, ModelSection, check_spec
from training.registry import Registry

MODELS: Registry[ModelFamily] = Registry("model", "name", "model", [
    digits.MLP_FAMILY,
    digits.CNN_FAMILY,
    gpt.FAMILY,
    hf.FAMILY,
], plugin.FAMILY)

ModelConfig = MODELS.union


def family_of(name: str) -> ModelFamily:
    return MODELS[name]


def model_section(raw: dict) -> ModelSection:
    """A `model` section from its mapping (ConfigError naming the bad field's dotted path)."""
    return MODELS.section(raw)


def check_fits_task(section: ModelSection, task: str) -> None:
    """UserError if the model's family does not learn the data's task."""
    family = family_of(section.name)
    if family.tasks and task not in family.tasks:
        fits = [f.name for f in MODELS.values() if task in f.tasks]
        raise UserError(f"model.name: {section.name} is for {' or '.join(family.tasks)} data, but the data is "
                        f"{task}; use one of {', '.join(fits)} or a plug-in")


def build_model(section: ModelSection, spec: dict):
    """The section's model for data described by `spec` (the task's keys; see family.py); UserError
    if the data asks for a model of absurd size (family.MAX_SPEC)."""
    check_spec(spec)
    return family_of(section.name).build(section, spec)
