"""What a model learns from the data (the task; driver and workers), defined once: the prepared data's columns and their
dtypes, what the model is given and what it must return, the loss, the validation metrics, and the
shape of a sample for the driver's checks. A data source says which task its data serves, a model
family which tasks it can learn; the driver checks that they agree, the workers compute the loss.

Imported by the driver's config checks and by the workers. Torch is imported inside the methods
that compute, not here: a config is checked (and refused) without loading it.

Losses are sums, not means, so a global batch split unevenly across workers and micro-batches
still yields exactly the mean over the global batch (see the loop's loss scaling).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

from training.metrics import VAL_ACCURACY, VAL_LOSS, VAL_PERPLEXITY, VAL_TOKEN_ACCURACY


def logits_of(output: Any):
    """A model's logits: its forward's tensor, or the `.logits` of the object it returns (a Hugging
    Face `ModelOutput`, a plug-in's dataclass)."""
    logits = getattr(output, "logits", output)
    if not hasattr(logits, "shape"):
        raise TypeError(f"forward returns {type(output).__name__}, not a tensor of logits or an object with .logits")
    return logits


@dataclass(frozen=True)
class Task:
    name: str
    # The prepared data's columns, as the workers receive them: name -> numpy dtype.
    columns: tuple[tuple[str, str], ...]
    validation_metrics: tuple[str, ...]
    # The data's description a model is built for (training.data: SourceData.spec, Manifest.spec).
    spec_keys: tuple[str, str]

    def inputs_and_targets(self, batch: dict):
        raise NotImplementedError

    def units_per_sample(self, spec: dict) -> int:
        """What the loss is summed over, per sample: 1 (a label) or seq_len (a token each)."""
        raise NotImplementedError

    def tokens_per_sample(self, spec: dict) -> Optional[int]:
        """Tokens per sample, for tokens/s and MFU; None where the data is not tokens."""
        return None

    def sample(self, spec: dict, rows: int) -> tuple[tuple[int, ...], str]:
        """(shape, dtype name) of the model's input for `rows` rows of the data."""
        raise NotImplementedError

    def logits_shape(self, spec: dict, rows: int) -> tuple[tuple[int, ...], str]:
        """(shape, what sizes it) of the logits a model must return for `rows` rows."""
        raise NotImplementedError

    def logits_fit(self, shape: tuple[int, ...], expected: tuple[int, ...]) -> bool:
        """Whether logits of `shape` serve where logits_shape gives `expected`."""
        return shape == expected

    def model_input(self, batch: dict):
        return self.inputs_and_targets(batch)[0]

    def call(self, model, batch: dict, inputs):
        """The model's output for a batch whose input is `inputs`."""
        return model(inputs)

    def forward_loss(self, model, batch: dict, count_correct: bool = False):
        """Summed loss, units, and (for evaluation) correct predictions; training skips the argmax."""
        import torch.nn.functional as F  # (torch, not at import: the config path does not load it)

        inputs, targets = self.inputs_and_targets(batch)
        logits = logits_of(self.call(model, batch, inputs))
        if logits.dim() > 2:  # (a prediction per token: one row each)
            logits, targets = logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)
        loss_sum = F.cross_entropy(logits.float(), targets, reduction="sum")
        correct = (logits.argmax(dim=-1) == targets).sum() if count_correct else None
        return loss_sum, targets.numel(), correct

    def metrics_of(self, loss_sum: float, units: float, correct: float) -> dict[str, float]:
        loss, accuracy = loss_sum / max(units, 1), correct / max(units, 1)
        values = {VAL_LOSS: loss, VAL_ACCURACY: accuracy, VAL_PERPLEXITY: math.exp(min(loss, 50.0)),
                  VAL_TOKEN_ACCURACY: accuracy}
        return {name: values[name] for name in self.validation_metrics}


class Classification(Task):
    """One label per row: features `x` (a fixed-length float vector), label `y`."""

    def inputs_and_targets(self, batch: dict):
        return batch["x"], batch["y"]

    def units_per_sample(self, spec: dict) -> int:
        return 1

    def sample(self, spec: dict, rows: int) -> tuple[tuple[int, ...], str]:
        return (rows, spec["input_dim"]), "float32"

    def logits_shape(self, spec: dict, rows: int) -> tuple[tuple[int, ...], str]:
        return (rows, spec["num_classes"]), f"num_classes {spec['num_classes']}"


class LanguageModel(Task):
    """Next-token prediction: `tokens`, seq_len + 1 ids per row; the model sees the first seq_len
    and predicts each next one."""

    def inputs_and_targets(self, batch: dict):
        tokens = batch["tokens"]
        return tokens[:, :-1], tokens[:, 1:]

    def units_per_sample(self, spec: dict) -> int:
        return spec["seq_len"]

    def tokens_per_sample(self, spec: dict) -> Optional[int]:
        return spec["seq_len"]

    def sample(self, spec: dict, rows: int) -> tuple[tuple[int, ...], str]:
        return (rows, spec["seq_len"]), "int64"

    def logits_shape(self, spec: dict, rows: int) -> tuple[tuple[int, ...], str]:
        return (rows, spec["seq_len"], spec["vocab_size"]), f"vocab_size {spec['vocab_size']}"

    def logits_fit(self, shape: tuple[int, ...], expected: tuple[int, ...]) -> bool:
        # More logits than the data's vocabulary serve: a pretrained model's embeddings are often
        # padded beyond its tokenizer's ids (the loss never targets the extra ones).
        return shape[:-1] == expected[:-1] and shape[-1] >= expected[-1]


class SequenceClassification(Task):
    """One label per row of tokens: `tokens` (seq_len ids, padded with the tokenizer's pad id),
    `attention` (1 for a real token, 0 for padding), `label`. The model is called as
    `model(tokens, attention)` and returns [rows, num_classes] logits."""

    def inputs_and_targets(self, batch: dict):
        return batch["tokens"], batch["label"]

    def call(self, model, batch: dict, inputs):
        return model(inputs, batch["attention"])

    def units_per_sample(self, spec: dict) -> int:
        return 1

    def tokens_per_sample(self, spec: dict) -> Optional[int]:
        return spec.get("seq_len")

    def sample(self, spec: dict, rows: int) -> tuple[tuple[int, ...], str]:
        return (rows, spec["seq_len"]), "int64"

    def logits_shape(self, spec: dict, rows: int) -> tuple[tuple[int, ...], str]:
        return (rows, spec["num_classes"]), f"num_classes {spec['num_classes']}"


class PackedLanguageModel(LanguageModel):
    """Next-token prediction on rows of one or more whole samples (chat or instruction data, packed):
    `tokens` (seq_len input ids), `labels` (each position's target, IGNORE where it has none: a
    token the loss leaves out, a sample's last token, padding) and `positions` (each token's position
    in its own sample: a sample starts where it is 0). The model is called as `model(tokens,
    positions)` and must keep each sample to itself (a block-diagonal causal mask); the loss and the
    validation metrics are over the labelled tokens alone."""

    IGNORE = -100  # (transformers' and torch's ignore_index)

    def inputs_and_targets(self, batch: dict):
        return batch["tokens"], batch["labels"]

    def call(self, model, batch: dict, inputs):
        return model(inputs, batch["positions"])

    def forward_loss(self, model, batch: dict, count_correct: bool = False):
        import torch.nn.functional as F  # (torch, not at import: the config path does not load it)

        inputs, targets = self.inputs_and_targets(batch)
        logits = logits_of(self.call(model, batch, inputs))
        logits, targets = logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)
        loss_sum = F.cross_entropy(logits.float(), targets, ignore_index=self.IGNORE, reduction="sum")
        labelled = targets != self.IGNORE
        correct = ((logits.argmax(dim=-1) == targets) & labelled).sum() if count_correct else None
        return loss_sum, int(labelled.sum()), correct


CLASSIFICATION = Classification("classification", (("x", "float32"), ("y", "int64")), (VAL_LOSS, VAL_ACCURACY),
                                ("input_dim", "num_classes"))
LANGUAGE_MODEL = LanguageModel("language_model", (("tokens", "int64"),),
                               (VAL_LOSS, VAL_PERPLEXITY, VAL_TOKEN_ACCURACY), ("vocab_size", "seq_len"))
SEQUENCE_CLASSIFICATION = SequenceClassification(
    "sequence_classification", (("tokens", "int64"), ("attention", "int8"), ("label", "int64")),
    (VAL_LOSS, VAL_ACCURACY), ("vocab_size", "num_classes"))
# (the loss is summed over the labelled tokens but scaled, as language_model's, by seq_len per row: a
# step's weight does not depend on how many of its tokens are an assistant's)
PACKED_LANGUAGE_MODEL = PackedLanguageModel(
    "packed_language_model", (("tokens", "int64"), ("labels", "int64"), ("positions", "int64")),
    (VAL_LOSS, VAL_PERPLEXITY, VAL_TOKEN_ACCURACY), ("vocab_size", "seq_len"))


class ImageClassification(Task):
    """One label per image: `pixel_values` (float32 [channels, height, width], as the data's image
    processor makes them: training/data/image.py), `label`. The model is called as
    `model(pixel_values)` and returns [rows, num_classes] logits."""

    def inputs_and_targets(self, batch: dict):
        return batch["pixel_values"], batch["label"]

    def units_per_sample(self, spec: dict) -> int:
        return 1

    def sample(self, spec: dict, rows: int) -> tuple[tuple[int, ...], str]:
        return (rows, spec["channels"], spec["height"], spec["width"]), "float32"

    def logits_shape(self, spec: dict, rows: int) -> tuple[tuple[int, ...], str]:
        return (rows, spec["num_classes"]), f"num_classes {spec['num_classes']}"


IMAGE_CLASSIFICATION = ImageClassification("image_classification", (("pixel_values", "float32"), ("label", "int64")),
                                           (VAL_LOSS, VAL_ACCURACY), ("channels", "num_classes"))
TASKS = {task.name: task for task in (CLASSIFICATION, LANGUAGE_MODEL, SEQUENCE_CLASSIFICATION,
                                      PACKED_LANGUAGE_MODEL, IMAGE_CLASSIFICATION)}
ALL_VALIDATION_METRICS = tuple(dict.fromkeys(m for task in TASKS.values() for m in task.validation_metrics))
