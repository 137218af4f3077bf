"""`python -m training status [RUN] [--storage PATH] [--watch] [--json]`: how a run in storage is
doing, read from its files alone (no Ray, no MLflow): works from a laptop against s3:// storage.

Exit codes: 0 shown; 2 the storage or the run is not there, or not readable (the message says which).
A run whose files are not what this service writes is listed as unreadable, with the file and field.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from typing import Callable, Optional

import pyarrow.fs as pafs

from training import storage
from training.errors import UserError, first_line
from training.metrics import KEY_METRICS
from training.observe import files
from training.observe.state import decide_state
from training.redaction import redact
from training.run.paths import base_dir

EPILOG = """\
examples:
  python -m training status                          # every run in ./runs, one line each
  python -m training status my-run                   # one run: state, step, metrics, checkpoints, restarts
  python -m training status my-run --watch           # refresh every 5 s until the run ends (Ctrl-C stops)
  python -m training status my-run --storage s3://my-bucket/runs   # from a laptop (AWS credentials as usual)

states: running (its driver's heartbeat is fresh), finished, failed (with the error's line),
interrupted (Ctrl-C or SIGTERM) and resumable (stopped without an end): the same command with the
same --name resumes these three; scheduler_stopped (a sweep's trial its scheduler ended: not resumed).
unreadable: a run whose files are not what this service writes (the file and field are named).
exit codes: 0 shown, 2 no such storage or run, a run that cannot be read, or a bad option."""
MAX_INTERVAL_S = 86400.0  # (a day: time.sleep refuses some finite numbers, and nobody waits longer)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m training status", description="Show how a training run is doing.",
                                epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run", nargs="?", help="run name (default: list every run in the storage)")
    p.add_argument("--storage", default="runs",
                   help="the runs' storage, checkpoint.storage_path (default: runs, under $TRAINING_BASE_DIR "
                        "or the working directory); s3://bucket/prefix works from anywhere")
    p.add_argument("--watch", action="store_true", help="refresh until the run is no longer running")
    p.add_argument("--interval", type=float, default=5.0, help="seconds between refreshes with --watch (default 5)")
    p.add_argument("--json", action="store_true", help="print the status as JSON")
    return p


def run_report(storage_path: str, name: str, now_s: float) -> dict:
    """Everything `status` shows of one run, as JSON values; files.UnreadableFile if one of its
    files is not what this service writes."""
    run_dir = storage.join(storage_path, name)
    status = files.read_json(storage.join(run_dir, files.STATUS_FILE))
    progress = files.read_json(storage.join(run_dir, files.PROGRESS_FILE)) or {}
    record = files.read_json(storage.join(run_dir, files.RECORD_FILE)) or {}
    summary = files.read_json(storage.join(run_dir, files.SUMMARY_FILE))
    checkpoints = files.checkpoints(run_dir)
    newest = next((c["step"] for c in checkpoints if c["complete"]), None)
    state = decide_state(status, now_s, summary is not None, newest)
    metrics = dict(progress.get("metrics") or {})
    step, total = progress.get("step"), progress.get("total_steps")
    if summary and (step is None or summary.get("steps", 0) >= step):  # the final word, if there is one
        metrics = {k: v for k, v in (summary.get("metrics") or {}).items() if k in KEY_METRICS} or metrics
        step = summary.get("steps", step)
    status = status or {}
    return {"name": name, "run_dir": redact(run_dir), "state": state.state, "detail": state.detail,
            "step": step, "total_steps": total, "metrics": metrics,
            "progress_updated_s_ago": round(now_s - progress["updated"], 1) if progress.get("updated") else None,
            "restarts": progress.get("restarts", 0), "preemptions": progress.get("preemptions", 0),
            "attempts": status.get("attempt"), "checkpoints": checkpoints,
            "mlflow_run_id": status.get("mlflow_run_id") or record.get("mlflow_run_id"),
            "mlflow_url": status.get("mlflow_url"),
            "tracking_uri": redact(status.get("tracking_uri") or record.get("tracking_uri") or "") or None}


def unreadable_report(storage_path: str, name: str, exc: files.UnreadableFile) -> dict:
    """A run `status` cannot read, listed with the reason among the others."""
    return {"name": name, "run_dir": redact(storage.join(storage_path, name)), "state": "unreadable",
            "detail": redact(first_line(exc)), "step": None}


def describe(report: dict) -> list[str]:
    """The report as the lines a person reads."""
    lines = [f"run {report['name']}: {report['state']}", f"  {report['detail']}"]
    if report["step"] is not None:
        where = f"step {report['step']}" + (f"/{report['total_steps']}" if report["total_steps"] else "")
        shown = " | ".join(f"{k} {v:.4g}" for k, v in report["metrics"].items()
                           if k in KEY_METRICS and v is not None)
        ago = report["progress_updated_s_ago"]
        lines.append(f"  {where}" + (f" | {shown}" if shown else "")
                     + (f"  (reported {ago:.0f} s ago)" if ago is not None else ""))
    else:
        lines.append("  no step reported yet")
    lines.append(f"  restarts: {report['restarts']} worker-group restart(s), {report['preemptions']} preemption(s)"
                 + (f"; driver started {report['attempts']} time(s)" if report["attempts"] else ""))
    checkpoints = report["checkpoints"]
    if checkpoints:
        shown = ", ".join(f"{c['step']} ({'complete' if c['complete'] else 'incomplete'})" for c in checkpoints[:6])
        more = f" and {len(checkpoints) - 6} older" if len(checkpoints) > 6 else ""
        lines.append(f"  checkpoints (step): {shown}{more}")
    else:
        lines.append("  checkpoints: none yet")
    if report["mlflow_run_id"]:
        lines.append(f"  MLflow run {report['mlflow_run_id']}"
                     + (f": {report['mlflow_url']}" if report["mlflow_url"] else
                        f" at {report['tracking_uri']}" if report["tracking_uri"] else ""))
    lines.append(f"  storage: {report['run_dir']}")
    return lines


def list_line(report: dict) -> str:
    if report["state"] == "unreadable":
        return f"{report['name']:40} unreadable: {report['detail']}"
    where = "-" if report["step"] is None else \
        f"step {report['step']}" + (f"/{report['total_steps']}" if report["total_steps"] else "")
    return f"{report['name']:40} {report['state']:17} {where:16} restarts {report['restarts']}"


def storage_of(value: str) -> str:
    path = storage.absolute(value, base_dir())
    try:
        fs, base = storage.filesystem(path)
        found = fs.get_file_info(base)
    except (OSError, ValueError) as exc:
        raise UserError(redact(f"--storage {value}: not reachable: {first_line(exc)}")) from None

    if found.type == pafs.FileType.NotFound and not storage.is_remote(path):
        raise UserError(f"--storage {value}: {path} does not exist; pass the runs' checkpoint.storage_path")
    if found.type == pafs.FileType.File:
        raise UserError(redact(f"--storage {value}: {path} is a file; pass the runs' folder, checkpoint.storage_path"))
    return path


def check_run_name(name: str) -> None:
    """A run is one folder in the storage: a name that is a path (`..`, `a/b`, `/etc`, a URI) would
    read outside it."""
    if name in ("", ".", "..") or any(c in name for c in "/\\\0"):
        raise UserError(f"run {name!r}: a run's name is one folder in --storage, not a path "
                        "(no '/' or '\\'; not '.' or '..'); list the runs with `python -m training status`")


def report_or_unreadable(path: str, name: str, now_s: float) -> dict:
    try:
        return run_report(path, name, now_s)
    except files.UnreadableFile as exc:
        return unreadable_report(path, name, exc)


def show(args, out: Callable[[str], None], now: Callable[[], float]) -> bool:
    """Print once; True while the run (or, listing, any run) is running."""
    path = storage_of(args.storage)
    if args.run is None:
        reports = [report_or_unreadable(path, name, now()) for name in files.runs_in(path)]
        if args.json:
            out(json.dumps(reports, indent=2, default=str))
        for report in [] if args.json else reports:
            out(list_line(report))
        if not reports and not args.json:
            out(f"no runs in {redact(path)}")
        return any(report["state"] == "running" for report in reports)
    if not storage.exists(storage.join(path, args.run, files.RECORD_FILE)):
        names = files.runs_in(path)
        raise UserError(f"run {args.run!r} is not in {redact(path)}"
                        + (f"; runs there: {', '.join(names[:10])}" + (" ..." if len(names) > 10 else "") if names
                           else "; no runs there (is --storage right?)"))
    try:
        report = run_report(path, args.run, now())
    except files.UnreadableFile as exc:
        raise UserError(redact(f"run {args.run!r} cannot be shown: {first_line(exc)}")) from None
    if args.json:
        out(json.dumps(report, indent=2, default=str))
    else:
        for line in describe(report):
            out(line)
    return report["state"] == "running"


def main(argv: Optional[list[str]] = None, out: Callable[[str], None] = print,
         now: Callable[[], float] = time.time, sleep: Callable[[float], None] = time.sleep) -> int:
    args = parser().parse_args(argv)
    if not (math.isfinite(args.interval) and 0 < args.interval <= MAX_INTERVAL_S):  # (float() takes nan and inf)
        print(f"error: --interval {args.interval:g}: must be a number of seconds above 0 and at most "
              f"{MAX_INTERVAL_S:g}", file=sys.stderr)
        return 2
    try:
        if args.run is not None:
            check_run_name(args.run)
        while True:
            if args.watch and sys.stdout.isatty():
                out("\033[H\033[J" + time.strftime("%H:%M:%S"))
            running = show(args, out, now)
            if not (args.watch and running):
                return 0
            sleep(args.interval)
            out("")
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 0
