"""`python -m training [CONFIG] [--set key=value ...] [--name RUN]`: one training run;
`python -m training status [RUN]`: how a run in storage is doing (training/observe/status_cli.py).

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


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["status"]:  # `python -m training status [RUN]`: how a run in storage is doing
        return status_main(argv[1:])
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
