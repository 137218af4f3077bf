"""The driver: runs where `python -m training` runs (a laptop, or the head in a submitted job).

It checks the job, prepares the data, opens the MLflow run, joins or starts Ray, fits a
TorchTrainer whose workers run `training.worker`, and logs the final model.
"""
