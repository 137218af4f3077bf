"""What state a run is in, from what its storage holds (pure: `python -m training status` and its
tests call it with the files read and the clock read).

    running            the driver's heartbeat is fresh
    finished           the driver recorded the end (or, for a run older than status.json, a summary.json is there)
    failed             the run failed beyond its failure budget (the error's line is shown); the same
                       command with the same --name resumes it
    interrupted        stopped by Ctrl-C (SIGINT) or SIGTERM, on purpose: resumable, as below
    scheduler_stopped  a sweep's trial that the sweep's scheduler (ASHA, PBT, median stopping) ended on
                       purpose: its end, not offered for resume (the reason is shown)
    resumable          the driver stopped without an end (killed, its machine gone): the same command
                       with the same --name resumes it from its newest complete checkpoint
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from training.errors import first_line

# A driver rewrites status.json every heartbeat_every_s (10 s); on a loaded machine or a slow store
# a write can be late: the driver counts as gone after this many missed heartbeats (and this floor).
MISSED_HEARTBEATS = 4
STALE_FLOOR_S = 45.0


@dataclass(frozen=True)
class RunState:
    state: str                    # running | finished | failed | interrupted | scheduler_stopped | resumable
    detail: str                   # one line: why, and what to do
    heard_s_ago: Optional[float] = None


def stale_after_s(heartbeat_every_s: float) -> float:
    return max(STALE_FLOOR_S, MISSED_HEARTBEATS * heartbeat_every_s)


def decide_state(status: Optional[dict], now_s: float, has_summary: bool,
                 newest_complete_step: Optional[int]) -> RunState:
    """`status`: the run's status.json (None if absent); `now_s`: wall-clock time (time.time());
    `has_summary`: summary.json exists; `newest_complete_step`: of its checkpoints, if any."""
    resume = ("run the same command with the same --name to resume it"
              + (f" from step {newest_complete_step}" if newest_complete_step is not None else " from the start"))
    if status is None:
        if has_summary:
            return RunState("finished", "finished (recorded before status files existed)")
        return RunState("resumable", f"no driver has recorded a state; {resume}")
    state = status.get("state")
    heard = status.get("heartbeat") or status.get("updated")
    ago = max(0.0, now_s - float(heard)) if isinstance(heard, (int, float)) else None
    if state == "finished":
        return RunState("finished", f"finished {_ago(ago)}", ago)
    error = first_line(status.get("error") or "")
    if state == "failed":
        return RunState("failed", f"failed {_ago(ago)}: {error or 'no error recorded'}; {resume}", ago)
    if state in ("interrupted", "stopped"):  # ("stopped": what drivers wrote for an interrupt before)
        return RunState("interrupted", f"{error or 'interrupted'} {_ago(ago)}, resumable; {resume}", ago)
    if state == "scheduler_stopped":
        return RunState("scheduler_stopped", f"stopped by the sweep's scheduler: {error or 'no reason recorded'} "
                        f"({_ago(ago)}; its end, on purpose: not to be resumed)", ago)
    if state == "running":
        limit = stale_after_s(float(status.get("heartbeat_every_s") or 10.0))
        if ago is not None and ago <= limit:
            return RunState("running", f"running (driver on {status.get('host', '?')}, heard {_ago(ago)})", ago)
        gone = _ago(ago)
        return RunState("resumable", f"its driver stopped without ending the run (last heard {gone}); {resume}", ago)
    return RunState("resumable", f"unknown state {state!r} in status.json; {resume}", ago)


def _ago(seconds: Optional[float]) -> str:
    if seconds is None:
        return "at an unknown time"
    if seconds < 120:
        return f"{seconds:.0f} s ago"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min ago"
    return f"{seconds / 3600:.1f} h ago"
