"""`python -m training [CONFIG] [--set key=value ...] [--name RUN]`: one training run;
`python -m training status [RUN]`: how a run in storage is doing (training/observe/status_cli.py);
`python -m training export RUN --format hf --out DIR`: a run's model as a Hugging Face folder.

Exit codes: 0 the run finished; 2 bad input, or a worker group the cluster cannot hold (nothing was
started); 1 the run failed; 130 / 143 stopped by Ctrl-C / SIGTERM (resumable).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional

from training import config as config_lib
from training import storage
from training.errors import UserError, exit_code
from training.observe.status_cli import main as status_main
from training.run import interrupt
from training.run.console import RunLog, console_log, opening_line
from training.run.driver import run_training
from training.run.hf_export import export_run
from training.run.interrupt import stop_on_signals
from training.run.paths import base_dir, default_run_name, resolve_paths

DEFAULT_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "digits.yaml"

EPILOG = """\
examples:
  python -m training                                   # the default job: digits, 2 workers
  python -m training training/configs/tinylm.yaml --set train.max_steps=50
  python -m training --name my-run                     # run again with the same name to resume it
  ray job submit --working-dir . -- python -m training training/configs/digits.yaml
  python -m training status [RUN] [--watch]            # how a run in storage is doing (see status --help)
  python -m training export RUN --format hf --out DIR  # its model as a Hugging Face folder (see export --help)

Ray: joins the cluster at $RAY_ADDRESS (set inside a Ray job), else starts a local one.
Tracking: tracking.tracking_uri, else $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db.
Relative paths resolve against $TRAINING_BASE_DIR, else the working directory (~/training
inside a submitted Ray job).
Ctrl-C or SIGTERM stops a run within seconds; the same command with the same --name resumes it.
exit codes: 0 finished, 1 the run failed, 2 bad input or a worker group the cluster cannot hold
(nothing started), 130 Ctrl-C, 143 SIGTERM."""


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m training", description="Run one distributed training job on Ray.",
                                epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", nargs="?", help=(
        "job config YAML (default: "
        f"{DEFAULT_CONFIG.relative_to(Path.cwd()) if DEFAULT_CONFIG.is_relative_to(Path.cwd()) else DEFAULT_CONFIG})"))
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config field by dotted path, e.g. --set optim.lr=3e-4 (repeatable)")
    p.add_argument("--name", help="run name; a run whose name exists in storage is resumed")
    p.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    return p


EXPORT_EPILOG = """\
formats:
  hf   a Hugging Face model folder: config.json, model.safetensors (sharded above 50GB, with
       model.safetensors.index.json), generation_config.json and the tokenizer (the pretrained
       folder's, else the data's tokenizer.json). transformers' AutoModelForCausalLM.from_pretrained,
       vLLM and TGI load it. model.name hf: its own architecture; gpt: GPT-2 (an exact mapping).

examples:
  python -m training export my-run --format hf --out ./my-model          # its newest complete checkpoint
  python -m training export my-run --checkpoint 200 --format hf --out s3://bucket/models/my-model
  python -m training export my-run --storage s3://my-bucket/runs --format hf --out ./my-model

exit codes: 0 written; 2 no such run or checkpoint, a model with no such format, an --out that holds
files, or a bad option (nothing is written)."""


def export_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m training export", epilog=EXPORT_EPILOG,
                                description="Write a run's trained model in a format other tools load.",
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run", help="run name in the storage")
    p.add_argument("--checkpoint", type=int, metavar="STEP", help="the checkpoint at this step (default: the newest "
                   "complete one)")
    p.add_argument("--format", required=True, choices=["hf"], help="hf: a Hugging Face model folder")
    p.add_argument("--out", required=True, metavar="DIR", help="a new or empty folder, local or s3://")
    p.add_argument("--storage", default="runs", help="the runs' storage, checkpoint.storage_path (default: runs, "
                   "under $TRAINING_BASE_DIR or the working directory)")
    return p


def export_main(argv: list[str]) -> int:
    args = export_parser().parse_args(argv)
    run_dir = storage.join(storage.absolute(args.storage, base_dir()), args.run)
    out = storage.absolute(args.out, base_dir())
    try:
        step, files = export_run(run_dir, args.checkpoint, out)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"run {args.run} step {step} written as a Hugging Face folder to {out}: {', '.join(files)}")
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["status"]:  # `python -m training status [RUN]`: how a run in storage is doing
        return status_main(argv[1:])
    if argv[:1] == ["export"]:  # `python -m training export RUN --format hf --out DIR`
        return export_main(argv[1:])
    args = parser().parse_args(argv)

    config_path = args.config or str(DEFAULT_CONFIG)
    try:
        job = config_lib.load(config_path, args.overrides, args.name)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.print_config:
        print(config_lib.to_yaml(job), end="", flush=True)
        return 0

    job = job.model_copy(update={"name": job.name or default_run_name(config_path)})
    paths = resolve_paths(job, job.name)
    # The full resolved config is in --print-config, the run's config.yaml and MLflow's
    # config/resolved_config.yaml; the console opens with one line.
    print(opening_line(job.name, config_path, job.scaling.num_workers, paths.run_dir, paths.tracking_uri), flush=True)
    local = not storage.is_remote(paths.run_dir)
    log = RunLog(Path(paths.run_dir) / "driver.log" if local else Path(base_dir()) / "logs" / f"{job.name}.log")
    with console_log(log), stop_on_signals():
        code = exit_code(lambda: run_training(job, config_path=config_path, started=log.start),
                         interrupted="run the same command with the same --name to resume")
    if code == 130:  # (Ctrl-C or SIGTERM: the shell's convention, 128 + the signal)
        code = interrupt.exit_code()
    if log.started:
        print(f"log: {log.path}", flush=True)
    return code
