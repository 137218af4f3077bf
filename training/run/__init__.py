"""The driver: runs where `python -m training` runs (a laptop, or the head in a submitted job).

It checks the job, plans and prepares the data, joins or starts Ray, opens the MLflow run, fits a
TorchTrainer whose workers run `training.worker`, and logs the final model.
"""
