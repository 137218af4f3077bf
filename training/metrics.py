"""Metric names every process agrees on (no torch here: the CLIs check configs against them).

The validation metrics each task reports are the one list that `checkpoint.score_metric`,
`train.early_stopping.metric` and a sweep's `metric` are checked against.
"""

VALIDATION_METRICS = {"classification": ("val_loss", "val_accuracy"),
                      "language_model": ("val_loss", "val_perplexity", "val_token_accuracy")}
ALL_VALIDATION_METRICS = tuple(dict.fromkeys(m for names in VALIDATION_METRICS.values() for m in names))
