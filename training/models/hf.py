"""The `hf` family (built on the workers, checked on the driver): a Hugging Face `transformers` model,
from an inline architecture (`config`) or a pretrained folder (`pretrained`: local, or s3:// and
other pyarrow URIs, read once per node). Its network, and every check of the folder:
training/models/hf_nn.py.

    model:
      name: hf
      options: {config: {model_type: llama, hidden_size: 64, num_hidden_layers: 2, ...}}

What it learns (`task`): causal_lm, the `language_model` data (token rows) or the
`packed_language_model` data (chat and instruction samples packed in rows, their labels and
positions); sequence_classification, the `sequence_classification` data (padded token rows, their
attention mask, a label); image_classification (ResNet, ViT...), the `image_classification` data
(images as the data's image processor makes them, a label).
"""

from __future__ import annotations

import os
import re
from typing import Any, Literal, Optional

from pydantic import field_validator, model_serializer, model_validator

from training import storage
from training.models import hf_adapter, hf_load
from training.models.family import ModelFamily, ModelSection
from training.models.hf_adapter import AdapterSection, check_fits
from training.models.hf_load import HUB
from training.schema import Section, printable
from training.tasks import IMAGE_CLASSIFICATION, LANGUAGE_MODEL, PACKED_LANGUAGE_MODEL, SEQUENCE_CLASSIFICATION

# ORG/NAME[@REVISION] of a Hub model (a relative path of that form that exists is the folder).
HUB_ID = re.compile(r"[\w.-]+/[\w.-]+(@[\w./-]+)?")

# The model's task -> the data's (training/tasks.py).
DATA_TASK = {"causal_lm": LANGUAGE_MODEL.name, "sequence_classification": SEQUENCE_CLASSIFICATION.name,
             "image_classification": IMAGE_CLASSIFICATION.name}
# Other data a task learns too: samples packed in rows (training/data/packing.py).
ALSO_LEARNS = {"causal_lm": (PACKED_LANGUAGE_MODEL.name,)}


def data_task(task: str, spec: dict) -> str:
    """The data's task that the model's `task` learns: the data's own where the task learns it."""
    learns = (DATA_TASK[task], *ALSO_LEARNS.get(task, ()))
    return spec["task"] if spec.get("task") in learns else DATA_TASK[task]


class HFOptions(Section):
    # A folder written by `save_pretrained` (config.json and *.safetensors): a local path or a URI; or
    # a model on the Hugging Face Hub, hf://ORG/NAME[@REVISION] (ORG/NAME where no such folder exists).
    pretrained: Optional[str] = None
    # Or an architecture to train from scratch: a transformers config's keys, `model_type` among them.
    # vocab_size (and num_labels) left out are the data's.
    config: Optional[dict[str, Any]] = None
    task: Literal["causal_lm", "sequence_classification", "image_classification"] = "causal_lm"
    dtype: Literal["float32", "bfloat16"] = "float32"
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2"] = "sdpa"
    # Run the Python code a pretrained folder ships for an architecture transformers does not have.
    trust_remote_code: bool = False

    @field_validator("pretrained")
    @classmethod
    def _printable(cls, value: Optional[str]) -> Optional[str]:
        if value is not None and not value.strip():
            raise ValueError("must not be empty: a folder written by save_pretrained, or an s3:// URI of one")
        if value is None or storage.is_remote(value):
            return printable(value)
        if HUB_ID.fullmatch(value) and not os.path.exists(os.path.expanduser(value)):
            return printable(HUB + value)  # (ORG/NAME, as the Hub and from_pretrained name it)
        # A local folder relative to the driver's working directory, as data paths are: made absolute
        # here, on the driver, because Ray's workers run in another working directory.
        return printable(os.path.abspath(os.path.expanduser(storage.local_path(value))))

    @field_validator("config")
    @classmethod
    def _has_model_type(cls, value: Optional[dict]) -> Optional[dict]:
        if value is not None and not (isinstance(value.get("model_type"), str) and value["model_type"]):
            raise ValueError("needs a model_type (an architecture of transformers, e.g. llama, bert)")
        return value

    @model_validator(mode="after")
    def _one_source(self) -> "HFOptions":
        if (self.pretrained is None) == (self.config is None):
            raise ValueError("set exactly one of pretrained (a folder of weights) and config (an inline architecture); "
                             f"{'both are' if self.pretrained is not None else 'neither is'} set")
        return self


class HFModel(ModelSection):
    name: Literal["hf"] = "hf"
    options: HFOptions
    # A LoRA adapter trained on the frozen pretrained model (training/models/hf_adapter.py); none: all of it trains.
    adapter: Optional[AdapterSection] = None

    @model_serializer(mode="wrap")
    def _no_adapter_left_out(self, handler):
        # (a run without one is written, and identified on resume, as before adapters were an option)
        dumped = handler(self)
        if self.adapter is None and isinstance(dumped, dict):
            dumped.pop("adapter", None)
        return dumped

    def refuses(self, job) -> Optional[str]:
        """Why the job's other sections cannot train this model (None: they can); the job's config asks."""
        return hf_adapter.qlora_refusal(self.adapter, job.parallel.strategy, job.scaling.use_gpu)

    @model_validator(mode="after")
    def _adapter_fits(self) -> "HFModel":
        if self.adapter is not None:
            check_fits(self.adapter, self.options)
        return self


class HFFamily(ModelFamily):
    name = "hf"
    Config = HFModel
    tasks = tuple(DATA_TASK.values()) + tuple(t for also in ALSO_LEARNS.values() for t in also)
    exports_onnx = False  # (its final model is an HF folder: training/run/hf_export.py)

    def build(self, section: HFModel, spec: dict):
        from training.models import hf_nn  # (torch, transformers: see training/models/family.py)

        model = hf_nn.build(section.options, spec, data_task(section.options.task, spec),
                            hf_adapter.load_kwargs(section.adapter))
        if section.adapter is not None:
            hf_adapter.apply(section.adapter, model, section.options)
            if torch_device(model) != "meta":  # (on the meta device: drawn once the model has memory)
                hf_adapter.init_weights(model, initial_seed())
        return model

    def blocks(self, model) -> list:
        from training.models import hf_nn  # (torch, transformers: see training/models/family.py)

        return hf_nn.layers(model)

    def check_shardable(self, model) -> None:
        from training.models import hf_nn  # (torch, transformers: see training/models/family.py)

        hf_nn.check_layers(model)

    def loads_after_sharding(self, section: HFModel) -> bool:
        return section.options.pretrained is not None

    def load_after_sharding(self, section: HFModel, model, device) -> None:
        from training.models import hf_nn  # (torch, transformers: see training/models/family.py)

        if section.adapter is None:
            hf_nn.load_sharded(section.options, model, device)
            return
        model.to_empty(device=device)
        hf_load.load_sharded(model, hf_nn.local_folder(section.options), file_key=hf_adapter.base_key)
        hf_adapter.init_weights(model, initial_seed())

    def checkpoints_frozen(self, section: HFModel) -> bool:
        return section.adapter is None  # (an adapter's base is read again from its folder, its digest pinned)

    def pinned(self, section: HFModel) -> dict[str, str]:
        if section.adapter is None:
            return {}
        from training.models import hf_nn  # (torch, transformers: see training/models/family.py)

        return {"model.options.pretrained": hf_adapter.base_digest(hf_nn.local_folder(section.options))}

    def flops_per_token(self, model) -> Optional[float]:
        from training.models import hf_nn  # (torch, transformers: see training/models/family.py)

        return hf_nn.flops_per_token(model)

    def hf_model(self, model):
        """The transformers.PreTrainedModel the family built (for save_pretrained and export); an
        adapter's merged into its base, in place."""
        return hf_adapter.merge(model) if hf_adapter.has_adapter(model) else model

    def hf_folder(self, section: HFModel) -> Optional[str]:
        """The local folder of the pretrained weights (read once per node); None for an inline config."""
        from training.models import hf_nn  # (torch, transformers: see training/models/family.py)

        return hf_nn.local_folder(section.options) if section.options.pretrained else None


def torch_device(model) -> str:
    return next(model.parameters()).device.type


def initial_seed() -> int:
    """The seed the worker set before it built the model (torch.manual_seed(config.seed)): the adapter's
    weights are drawn from it alone."""
    import torch  # (lazy: torch)

    return torch.initial_seed()


FAMILY = HFFamily()
