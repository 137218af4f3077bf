"""On the driver, after a run: checkpoints that `checkpoint.keep` outlived removed, the final model
written as a Hugging Face folder into the run's storage (<run_dir>/hf, for the families that have one)
and logged to MLflow (and registered), a learning-curve plot, a summary."""

from __future__ import annotations

import json
import os
import re
import shlex
import sys
import tempfile
from pathlib import Path
from typing import Optional

import numpy as np
import pyarrow.fs as pafs
import torch

from training import storage
from training.checkpoint import format as ckpt
from training.config import JobConfig
from training.data.registry import source_of
from training.metrics import KEY_METRICS, PLOTTED, mlflow_name
from training.models.registry import family_of
from training.observe.notify import mlflow_run_url
from training.redaction import redact, redact_values
from training.run import generate, hf_export
from training.run.cost import cluster_config_path, estimate_cost_metrics, gpu_nodes
from training.run.export import export_onnx
from training.run.final_model import load_final_model
from training.tasks import TASKS, logits_of
from training.tracking import registry
from training.tracking.tracker import RUN_NAME_TAG, fluent_mlflow
from training.worker.profile import PROFILE_DIR


def sample_input(manifest) -> torch.Tensor:
    """A few validation rows, as the model takes them (a signature's example, an export's sample).
    Contiguous: torch.export guards on the strides of the tensor it traces, and a graph traced on a
    slice (a language model's inputs are tokens[:, :-1]) refuses every ordinary array. At least two
    rows: it fixes a dimension of size 1 as a constant, which would make the batch size one."""
    rows = source_of(manifest.source).rows(manifest, "validation").take(np.arange(min(4, manifest.rows("validation"))))
    sample = TASKS[manifest.task].model_input({name: torch.from_numpy(column) for name, column in rows.items()})
    if sample.shape[0] == 1:
        sample = torch.cat([sample, sample])
    return sample.contiguous()


def registered_model_name(job: JobConfig) -> str:
    if job.tracking.registered_model_name:
        return job.tracking.registered_model_name
    name = f"{job.data.source.split(':')[-1]}-{job.model.name.split(':')[-1]}"
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", name)


def logged_model_name(job: JobConfig) -> str:
    """The logged model's name in its run (MLflow refuses '.' there, which a registry name may hold)."""
    return re.sub(r"[^A-Za-z0-9_-]+", "-", registered_model_name(job))


def log_model(job: JobConfig, manifest, model: torch.nn.Module, tracker) -> dict:
    """Log the final model, link the run's final metrics to it, and register it
    (training/tracking/registry.py). A model that is a `transformers` model (the hf family) with a
    tokenizer and a pipeline task: MLflow's transformers flavor, which serving stacks and
    `mlflow.transformers.load_model` (a pipeline) read. Else `tracking.model_format` (log_pytorch_model)."""
    import mlflow  # (lazy: mlflow)

    transformers_model = as_transformers_model(job, manifest, model)
    with fluent_mlflow(tracker.tracking_uri), mlflow.start_run(run_id=tracker.run_id):
        if transformers_model is not None:
            model_format = "transformers"
            info = hf_export.log_transformers_model(*transformers_model, name=logged_model_name(job))
        else:
            model_format = job.tracking.model_format
            info = log_pytorch_model(job, manifest, model, model_format)
        client = mlflow.MlflowClient(tracker.tracking_uri)
        score_metric = job.checkpoint.score_metric
        final = registry.link_final_metrics(client, tracker.run_id, info.model_id, 
                                                   [mlflow_name(k) for k in (*KEY_METRICS, score_metric)])
        logged = {"model_uri": info.model_uri, "model_id": info.model_id, "model_format": model_format,
                  "model_metrics": final, "registered_model": None, "registered_version": None}
        if job.tracking.register_model:
            logged.update(register_model(job, manifest, client, info.model_id, tracker.run_id))
    return logged


def as_transformers_model(job: JobConfig, manifest, model: torch.nn.Module):
    """(model, tokenizer, pipeline task) when the trained network is itself a `transformers` model
    whose data task has a pipeline and a tokenizer goes with it; else None. A network converted
    into one (the built-in gpt as GPT-2) keeps its own flavor: its folder is logged beside it (hf/)."""
    if not hf_export.exports_hf(job.model):
        return None
    task = hf_export.pipeline_task(manifest.task)
    if task is None:
        return None
    hf = hf_export.hf_model(job.model, model)
    if not hf_export.is_transformers_model(model, hf):
        return None
    # (images: their image processor goes where a tokenizer would)
    tokenizer = hf_export.hf_tokenizer(job.model, job.data.options, manifest) or hf_export.hf_image_processor(manifest)
    if tokenizer is None:
        return None
    hf_export.with_special_tokens(hf, tokenizer)
    return hf, tokenizer, task


def log_pytorch_model(job: JobConfig, manifest, model: torch.nn.Module, model_format: str):
    """Log the final model in `model_format` ("pt2", a torch.export graph that loads without
    unpickling anything, or "pickle", opted into, for what cannot be exported) inside the active run;
    returns the ModelInfo. The exported graph takes any batch size: MLflow marks the signature's batch
    dimension (-1) dynamic when it exports."""
    import mlflow.pytorch  # (lazy: mlflow.pytorch)
    from mlflow.models import infer_signature  # (lazy: mlflow)

    sample = sample_input(manifest)
    with torch.no_grad():
        raw = model(sample)
    signature = infer_signature(sample.numpy(), logits_of(raw).numpy())  # the batch dimension is left dynamic (-1)
    by_format = {}
    if model_format == "pickle":  # unpickling imports the model's classes: ship this package with it
        by_format["code_paths"] = [str(Path(__file__).resolve().parents[1])]
    # The example is shown in MLflow's UI and checked by it (the logged model called on it); pt2 is
    # traced on it. A pickled model whose forward returns an object (`.logits`) would fail the check.
    if model_format == "pt2" or torch.is_tensor(raw):
        by_format["input_example"] = sample.numpy()
    try:
        return mlflow.pytorch.log_model(
            model, name=logged_model_name(job), signature=signature, serialization_format=model_format,
            pip_requirements=[f"torch=={torch.__version__.split('+')[0]}"], **by_format)
    except Exception as exc:
        if model_format != "pt2":
            raise
        raise RuntimeError("the model could not be exported with torch.export for tracking.model_format pt2; "
                           "set tracking.model_format: pickle to log it as a pickle (loading one runs code) "
                           f"[{type(exc).__name__}: {str(exc)[:200]}]") from exc


def register_model(job: JobConfig, manifest, client, model_id: str, run_id: str) -> dict:
    """Register the logged model `model_id` of the MLflow run `run_id` (scored by the run's last
    `checkpoint.score_metric`) as `tracking.register_when` says, `@best` moved if it beats @best's.
    "registered_version" is None when nothing was registered ("registry_reason" says why)."""
    name, ckpt_config = registered_model_name(job), job.checkpoint
    run = client.get_run(run_id)
    score = run.data.metrics.get(ckpt_config.score_metric)
    decision = registry.decide(score, ckpt_config.score_metric, ckpt_config.score_mode, job.tracking.register_when,
                               registry.current_best(client, name))
    digest = getattr(manifest, "digest", None)
    shown = "no score" if score is None else f"{ckpt_config.score_metric} {score:.4g}"
    run_name = run.data.tags.get(RUN_NAME_TAG, run_id)
    description = (f"{job.model.name} trained on {job.data.source} data {(digest or '?')[:12]} by run {run_name}: "
                   f"{shown}")
    version = registry.register(client, name, model_id, run_id,
                                registry.version_tags(run_id, digest, ckpt_config.score_metric, score),
                                description, decision)
    return {"registered_model": name if version else None, "registered_version": version,
            "registry_name": name, "best_moved": decision.move_best and version is not None,
            "registry_reason": decision.reason, "score_metric": ckpt_config.score_metric, "score": score}


def plot_learning_curves(tracker, run_name: str, path: Path) -> bool:
    import matplotlib  # (lazy: matplotlib)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # (lazy: matplotlib)

    histories = {key: tracker.client.get_metric_history(tracker.run_id, key) for key in PLOTTED}
    histories = {k: sorted(v, key=lambda m: m.step) for k, v in histories.items() if v}
    if "train_loss" not in histories:
        return False
    extra = [k for k in ("val_accuracy", "val_perplexity") if k in histories]
    fig, axes = plt.subplots(1, 1 + len(extra), figsize=(6 * (1 + len(extra)), 4), squeeze=False)
    for key in ("train_loss", "val_loss"):
        if key in histories:
            axes[0][0].plot([m.step for m in histories[key]], [m.value for m in histories[key]], label=key)
    axes[0][0].set(xlabel="step", ylabel="loss", title=f"{run_name}: loss")
    axes[0][0].legend()
    for axis, key in zip(axes[0][1:], extra):
        axis.plot([m.step for m in histories[key]], [m.value for m in histories[key]], color="tab:green")
        axis.set(xlabel="step", ylabel=key, title=key)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def remove_unregistered_checkpoints(result, run_dir: str, log) -> list[str]:
    """Apply `checkpoint.keep` to what Ray Train's own cleanup cannot see: checkpoints in the run's
    directory that it never registered and that are older than its latest (see
    format.unregistered_to_remove). Run after the fit, when no upload is in flight; returns their
    names. A storage error only warns: the run is done and its checkpoints are intact."""
    if result.checkpoint is None:
        return []
    latest = ckpt.step_of(result.checkpoint.path)
    if latest is None:
        return []
    kept = {c.path.rstrip("/").rsplit("/", 1)[-1] for c, _ in (result.best_checkpoints or [])}
    kept.add(result.checkpoint.path.rstrip("/").rsplit("/", 1)[-1])
    fs, base = storage.filesystem(run_dir)
    try:
        entries = fs.get_file_info(pafs.FileSelector(base, allow_not_found=True))
        names = [e.base_name for e in entries if e.type == pafs.FileType.Directory]
        newest = ckpt.newest_complete(fs, base)
        stale = ckpt.unregistered_to_remove(names, kept, latest, newest[0] if newest else None)
        for name in stale:
            fs.delete_dir(f"{base}/{name}")
    except OSError as exc:
        log(f"warning: could not remove checkpoints that checkpoint.keep has outlived in {redact(run_dir)}: {exc}")
        return []
    if stale:
        log(f"removed {len(stale)} checkpoint(s) that Ray Train never registered and checkpoint.keep has "
            f"outlived: {', '.join(stale)}")
    return stale


def finalize(job: JobConfig, manifest, result, checkpoint, tracker, summary, log) -> None:
    """Log the final model, the plot and the summary to MLflow, and write summary.json next to the
    checkpoints. MLflow being away costs the MLflow part only: the run still ends well, with the
    model in its last checkpoint and the summary in its storage, and a warning says so."""

    remove_unregistered_checkpoints(result, summary.run_dir, log)
    cluster_config = cluster_config_path(job.tracking.cluster_config)
    if cluster_config:
        try:
            workers = int(summary.metrics.get("world_size", job.scaling.max_workers))
            summary.extra["cost"] = estimate_cost_metrics(cluster_config, summary.wall_s,
                                                          gpu_nodes(workers, summary.use_gpu))
        except Exception as exc:  # an estimate must never fail a finished run
            log(f"warning: no cost estimate from {cluster_config}: {exc}")
        else:
            tracker.log_metrics(summary.extra["cost"], step=0)
    summary_uri = storage.join(summary.run_dir, "summary.json")
    # A machine-readable result next to the checkpoints, with or without tracking; written first so
    # that it is there whatever happens to MLflow, and again once the model is logged.
    storage.write_text(summary_uri, json.dumps(summary_dict(summary), indent=2, default=str))
    model = None
    if checkpoint is not None and hf_export.exports_hf(job.model):
        model = write_run_hf_folder(job, manifest, checkpoint, summary, log)
    if checkpoint is not None:
        model = generate.generate_at_end(job, manifest, checkpoint, model, summary, log)
    if checkpoint is not None and tracker.run_id is not None:
        if not tracker.catch_up():  # the metrics first (the plot reads them back), and is MLflow there?
            summary.extra["mlflow_model_logged"] = False
            log(f"warning: MLflow at {redact(tracker.tracking_uri)} is unreachable: the final model is not logged or "
                f"registered there; it is in the checkpoint {summary.checkpoint_path}, the summary in {summary_uri}")
        else:
            log_profile_traces(tracker, summary.run_dir, log)
            try:
                log_final_artifacts(job, manifest, checkpoint, tracker, summary, log, model=model)
                generate.log_table(tracker, summary.extra.get(generate.SUMMARY_KEY), log)
            except Exception as exc:
                summary.extra["mlflow_model_logged"] = False
                log(redact(f"warning: could not log the final model to MLflow at {tracker.tracking_uri} "
                           f"({type(exc).__name__}: {str(exc)[:300]}); it is in the checkpoint "
                           f"{summary.checkpoint_path}, the summary in {summary_uri}"))
        storage.write_text(summary_uri, json.dumps(summary_dict(summary), indent=2, default=str))
    for line in summary_lines(summary):
        log(line)


def log_profile_traces(tracker, run_dir: str, log) -> list[str]:
    """The torch.profiler traces the run's rank 0 wrote (train.profile) into MLflow, under profile/;
    a failure only warns (the traces stay in the run's storage)."""

    fs, base = storage.filesystem(storage.join(run_dir, PROFILE_DIR))
    try:
        entries = fs.get_file_info(pafs.FileSelector(base, allow_not_found=True))
        names = sorted(e.base_name for e in entries if e.type == pafs.FileType.File and e.base_name.endswith(".json"))
        with tempfile.TemporaryDirectory() as tmp:
            for name in names:
                pafs.copy_files(f"{base}/{name}", str(Path(tmp) / name), source_filesystem=fs,
                                destination_filesystem=pafs.LocalFileSystem())
                tracker.client.log_artifact(tracker.run_id, str(Path(tmp) / name), PROFILE_DIR)
    except Exception as exc:
        log(f"warning: could not log the profile traces in {redact(storage.join(run_dir, PROFILE_DIR))} to MLflow: "
            f"{type(exc).__name__}: {str(exc)[:200]}")
        return []
    return names


def write_run_hf_folder(job: JobConfig, manifest, checkpoint, summary, log) -> Optional[torch.nn.Module]:
    """The final model as a Hugging Face folder in <run_dir>/hf (training/run/hf_export.py); returns
    the loaded model (logged next). A failure only warns: the model is in the checkpoint, and
    `python -m training export` writes the folder again from it."""
    out = storage.join(summary.run_dir, hf_export.HF_DIR)
    try:
        model = load_final_model(job.model, manifest, checkpoint)
        summary.extra["hf_files"] = hf_export.write_hf_folder(job, manifest, checkpoint, out, model=model)
    except Exception as exc:
        summary.extra["hf_exported"] = False
        log(redact(f"warning: the Hugging Face folder was not written to {out} ({type(exc).__name__}: "
                   f"{str(exc)[:300]}); `python -m training export {summary.name} --format hf --out DIR` "
                   "writes it from the checkpoint"))
        return None
    summary.extra.update(hf_exported=True, hf_folder=out)
    return model


def log_hf_folder(tracker, folder_uri: str, artifact_path: str = hf_export.HF_DIR) -> None:
    """The run's HF folder as the MLflow artifacts hf/ (copied through a local folder from remote storage)."""
    if not storage.is_remote(folder_uri):
        tracker.client.log_artifacts(tracker.run_id, storage.local_path(folder_uri), artifact_path)
        return
    fs, path = storage.filesystem(folder_uri)
    with tempfile.TemporaryDirectory() as tmp:
        pafs.copy_files(path, tmp, source_filesystem=fs, destination_filesystem=pafs.LocalFileSystem())
        tracker.client.log_artifacts(tracker.run_id, tmp, artifact_path)


def log_final_artifacts(job: JobConfig, manifest, checkpoint, tracker, summary, log=print,
                        model: Optional[torch.nn.Module] = None) -> None:
    """`checkpoint`: the run's last (training.checkpoint.restore.final_checkpoint); `model`, loaded
    from it already (else loaded here)."""
    model = model if model is not None else load_final_model(job.model, manifest, checkpoint)
    logged = log_model(job, manifest, model, tracker)
    summary.registered_model = logged["registered_model"]
    summary.extra.update(logged)
    # A model logged in its own flavor (the built-in gpt's pt2 graph) has its HF folder beside it.
    if summary.extra.get("hf_folder") and logged["model_format"] != "transformers":
        log_hf_folder(tracker, summary.extra["hf_folder"])
    # An adapter run's PEFT folder (hf/adapter), beside its merged model.
    elif any(name.startswith(hf_export.ADAPTER_DIR + "/") for name in summary.extra.get("hf_files") or ()):
        log_hf_folder(tracker, storage.join(summary.extra["hf_folder"], hf_export.ADAPTER_DIR), hf_export.ADAPTER_DIR)
    experiment_id = tracker.client.get_run(tracker.run_id).info.experiment_id
    summary.extra["mlflow_url"] = mlflow_run_url(tracker.tracking_uri, experiment_id, tracker.run_id)
    with tempfile.TemporaryDirectory() as tmp:
        export = job.tracking.export_onnx
        if export or (export is None and family_of(job.model.name).exports_onnx):  # default: built-in models
            try:
                summary.extra.update(export_onnx(model, sample_input(manifest), Path(tmp) / "model.onnx"))
                tracker.client.log_artifact(tracker.run_id, str(Path(tmp) / "model.onnx"), "onnx")
                summary.extra["onnx_exported"] = True
            except Exception as exc:  # the model is logged already; an export must not fail the run
                summary.extra["onnx_exported"] = False
                log(f"warning: ONNX export failed ({type(exc).__name__}: {str(exc)[:300]}); "
                    "the PyTorch model is logged")
        plot = Path(tmp) / "learning_curve.png"
        if plot_learning_curves(tracker, summary.name, plot):
            tracker.client.log_artifact(tracker.run_id, str(plot), "plots")
        (Path(tmp) / "summary.json").write_text(json.dumps(summary_dict(summary), indent=2, default=str))
        tracker.client.log_artifact(tracker.run_id, str(Path(tmp) / "summary.json"))


def summary_dict(summary) -> dict:
    return redact_values({"name": summary.name, "steps": summary.steps, "wall_s": round(summary.wall_s, 1),
                          "resumed": summary.resumed, "metrics": summary.metrics, "checkpoint": summary.checkpoint_path,
                          "mlflow_run_id": summary.mlflow_run_id, **summary.extra})


def summary_lines(summary) -> list[str]:
    shown = {k: summary.metrics[k] for k in KEY_METRICS if k in summary.metrics}
    lines = [f"run {summary.name} finished: {summary.steps} steps in {summary.wall_s:.0f} s"
             + (" (resumed)" if summary.resumed else ""),
             "  " + ", ".join(f"{k} {v:.4g}" for k, v in shown.items()),
             f"  checkpoint: {summary.checkpoint_path}"]
    if summary.extra.get("hf_folder"):
        lines.append(f"  Hugging Face folder: {redact(summary.extra['hf_folder'])}")
    if "samples_skipped" in summary.metrics:  # failure.mode continue
        lines.append(f"  steps taken by fewer than all replica groups: {int(summary.metrics.get('short_steps', 0))}; "
                     f"samples skipped: {int(summary.metrics['samples_skipped'])}")
    if summary.mlflow_run_id:
        lines.append(f"  MLflow run {summary.mlflow_run_id} at {redact(summary.tracking_uri or '')}")
    lines += registry_lines(summary)
    lines += generate.summary_lines(summary.extra.get(generate.SUMMARY_KEY))
    if summary.mlflow_run_id and summary.tracking_uri:
        lines.append(f"  MLflow UI: {ui_hint(summary.tracking_uri, summary.extra.get('mlflow_url'))}")
    return lines


def registry_lines(summary) -> list[str]:
    """What became of the model in the registry, and how to load it."""
    extra, name = summary.extra, summary.extra.get("registry_name")
    if summary.registered_model:
        lines = [f"  registered model: {name} version {extra.get('registered_version')}"
                 + (", now @best" if extra.get("best_moved") else "") + f" ({extra.get('registry_reason')})"]
    elif name and extra.get("registry_reason"):  # tracking.register_when improved, and it did not
        lines = [f"  not registered (tracking.register_when improved): {extra['registry_reason']}"]
    elif extra.get("model_uri"):
        return [f'  load it: mlflow.pyfunc.load_model("{extra["model_uri"]}")']
    else:
        return []
    this_run = f"models:/{name}/{extra['registered_version']}" if summary.registered_model else extra.get("model_uri")
    return lines + [f'  load the best: mlflow.pyfunc.load_model("models:/{name}@best")  (this run\'s: {this_run})']


def ui_hint(tracking_uri: str, run_url: Optional[str] = None) -> str:
    """How to see the runs: a tracking server's page, or the command that serves a local store's."""
    if tracking_uri.startswith(("http://", "https://")):
        return run_url or redact(tracking_uri)
    mlflow = os.path.join(os.path.dirname(os.path.abspath(sys.executable)), "mlflow")  # (the venv's, if any)
    if os.path.exists(mlflow):
        relative = os.path.relpath(mlflow)
        mlflow = relative if not relative.startswith("..") else mlflow
    else:
        mlflow = "mlflow"
    return f"{mlflow} ui --backend-store-uri {shlex.quote(redact(tracking_uri))}, then open http://127.0.0.1:5000"
