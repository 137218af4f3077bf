"""The built-in `digits_mlp` and `digits_cnn` families (built on the workers, checked on the driver):
small classifiers for the digits data (8x8 images as 64 features). Their networks:
training/models/digits_nn.py."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from training.errors import UserError
from training.models.family import MAX_LAYERS, MAX_WIDTH, ModelFamily, ModelSection
from training.schema import Section
from training.tasks import CLASSIFICATION

Width = Annotated[int, Field(ge=1, le=MAX_WIDTH)]  # (a layer's size: torch refuses 0 and below at the build)


class MLPOptions(Section):
    hidden: list[Width] = Field(default_factory=lambda: [128, 64], min_length=1, max_length=MAX_LAYERS)
    dropout: float = Field(0.1, ge=0, lt=1)


class CNNOptions(Section):
    channels: list[Width] = Field(default_factory=lambda: [16, 32], min_length=1, max_length=3)
    dropout: float = Field(0.1, ge=0, lt=1)


class MLPModel(ModelSection):
    name: Literal["digits_mlp"] = "digits_mlp"
    options: MLPOptions = Field(default_factory=MLPOptions)


class CNNModel(ModelSection):
    name: Literal["digits_cnn"] = "digits_cnn"
    options: CNNOptions = Field(default_factory=CNNOptions)


class MLP(ModelFamily):
    name = "digits_mlp"
    Config = MLPModel
    tasks = (CLASSIFICATION.name,)

    def build(self, section: MLPModel, spec: dict):
        from training.models.digits_nn import build_mlp  # (torch: see training/models/family.py)

        return build_mlp(spec, section.options)


class CNN(ModelFamily):
    name = "digits_cnn"
    Config = CNNModel
    tasks = (CLASSIFICATION.name,)

    def build(self, section: CNNModel, spec: dict):
        from training.models.digits_nn import build_cnn  # (torch: see training/models/family.py)

        try:
            return build_cnn(spec, section.options)
        except ValueError as exc:  # the data does not suit the model (non-square images)
            raise UserError(f"model.name {self.name}: {exc}") from None


MLP_FAMILY, CNN_FAMILY = MLP(), CNN()
