"""`python -m tuning SWEEP.yaml [--set key=value ...] [--name SWEEP]`: one hyperparameter sweep.

Exit codes: 0 the sweep finished (some trials may have failed: see the table); 2 bad input (nothing
was started); 1 the sweep itself failed.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional

from training import storage
from training.errors import UserError, exit_code
from training.run.console import RunLog
from training.run.paths import base_dir
from tuning import config as sweep_config
from tuning.console import sweep_console
from tuning.sweep import run_sweep, sweep_dir

EPILOG = """\
examples:
  python -m tuning tuning/sweeps/digits_asha.yaml
  python -m tuning tuning/sweeps/digits_asha.yaml --set num_samples=16 --set train.max_steps=200
  python -m tuning tuning/sweeps/digits_pbt.yaml --name pbt-2
  ray job submit --working-dir . -- python -m tuning tuning/sweeps/digits_asha.yaml

--set: keys of the sweep file (num_samples, scheduler.name, ...) change the sweep; any other key
changes the base job config of every trial (train.max_steps, optim.name, ...).
Resume: a sweep whose name exists in storage is resumed (the name defaults to the sweep file's),
so after the driver dies the same command continues it.
Ray: joins the cluster at $RAY_ADDRESS (set inside a Ray job), else starts a local one.
Console: one line per trial event; Tune's tables and the trials' own output are in the sweep's log
(<storage>/sweeps/<name>/sweep.log, named at the end).
exit codes: 0 finished, 1 the sweep failed, 2 bad input (nothing started)."""


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tuning", description="Run a hyperparameter sweep of training runs.",
                                epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("sweep", help="sweep file (YAML); examples in tuning/sweeps/")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a sweep or base-job field by dotted path (repeatable)")
    p.add_argument("--name", help="sweep name; a sweep whose name exists in storage is resumed")
    return p


def main(argv: Optional[list[str]] = None) -> int:
    args = parser().parse_args(argv)

    try:
        sweep = sweep_config.load(args.sweep, args.overrides, args.name)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"sweep {sweep.name}: {sweep.config.num_samples} sample(s) of "
          + ", ".join(f"{path} ~ {dim.describe()}" for path, dim in sweep.space.items()), flush=True)

    path = sweep_dir(sweep)
    log = RunLog(Path(path) / "sweep.log" if not storage.is_remote(path)
                 else Path(base_dir()) / "logs" / f"sweep-{sweep.name}.log")

    def sweep_and_report() -> None:
        # (an error leaves the console first: exit_code's message is shown whatever the router does)
        with sweep_console(log) as say:
            summary = run_sweep(sweep, log=say, started=log.start)
            counts = ", ".join(f"{sum(r.status == s for r in summary.rows)} {s}"
                               for s in ("finished", "stopped", "failed"))
            say(f"sweep {summary.name} finished in {summary.wall_s:.0f} s: {counts}")

    code = exit_code(sweep_and_report, interrupted="run the same command to resume the sweep")
    if log.started:
        print(f"log: {log.path}", flush=True)
    return code
