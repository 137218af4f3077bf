"""Metric names every process agrees on, and which of them a person reads first (no torch here: the
CLIs check configs against them). Which validation metrics a task reports is the task's
(training/tasks.py); this module only names them."""

TRAIN_LOSS = "train_loss"
SAMPLES_PER_S = "samples_per_s"
VAL_LOSS = "val_loss"
VAL_ACCURACY = "val_accuracy"
VAL_PERPLEXITY = "val_perplexity"
VAL_TOKEN_ACCURACY = "val_token_accuracy"

# What a run's summary, its notifications and `status` show, in this order (those it has).
KEY_METRICS = (TRAIN_LOSS, VAL_LOSS, VAL_ACCURACY, VAL_PERPLEXITY, VAL_TOKEN_ACCURACY, SAMPLES_PER_S)
# The learning curves plotted when a run ends (the loss panel, then one panel per other metric it has).
PLOTTED = (TRAIN_LOSS, VAL_LOSS, VAL_ACCURACY, VAL_PERPLEXITY)
