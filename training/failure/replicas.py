"""What a worker records and decides in `failure.mode: continue`, where each worker is a torchft
replica group: run on every worker. Pure (no torch, no Ray): tested without either.

`ReplicaLedger` keeps the data accounting: every step that fewer than all replica groups took
(the replicas that took it, the samples it used), the samples skipped in all, and when a group was
lost and when the full set was back. It travels with the live state when a new group heals from a
peer, and with every checkpoint, so the count survives a replaced worker and a resumed run.

`ReportGate` decides when a report may happen: `ray.train.report` is a barrier over every worker
(Ray 2.60), so it is only called at a step that every replica group took; a report due at a short
step is carried to the next full one.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Optional

from training.worker.policy import NOTHING_DUE, StepDue

LOST, REJOINED = "replica_lost", "replica_rejoined"


@dataclass(frozen=True)
class ShortStep:
    """A step taken by fewer than all replica groups: the parts of the absent ones were not read."""

    step: int  # the step's number (steps finished before it)
    replicas: int
    samples_used: int


@dataclass(frozen=True)
class ReplicaEvent:
    kind: str  # LOST or REJOINED
    step: int
    replicas: int
    time_s: float  # wall clock (time.time()) of the worker that recorded it


@dataclass
class ReplicaLedger:
    world_size: int
    global_batch_size: int
    samples_skipped: int = 0
    short_steps: int = 0
    last_replicas: Optional[int] = None  # None: no step recorded yet
    # Since the last report (drained into it):
    pending_steps: list = field(default_factory=list)
    pending_events: list = field(default_factory=list)

    def observe(self, step: int, replicas: int, now_s: float) -> None:
        """The replica groups in a quorum: a change from the last one is an event (a group lost, or
        the full set back). Called for every committed step, and for a sync round (a finished
        group waiting for a replaced one), where the rejoin happens."""
        if self.last_replicas is not None and replicas != self.last_replicas:
            kind = LOST if replicas < self.last_replicas else REJOINED
            self.pending_events.append(ReplicaEvent(kind, step, replicas, now_s))
        elif self.last_replicas is None and replicas < self.world_size:
            self.pending_events.append(ReplicaEvent(LOST, step, replicas, now_s))
        self.last_replicas = replicas

    def record(self, step: int, replicas: int, samples_used: int, now_s: float) -> None:
        """One committed step, `step` being its number, taken by `replicas` replica groups that
        together used `samples_used` samples of its global batch."""
        self.observe(step, replicas, now_s)
        if replicas < self.world_size:
            self.short_steps += 1
            self.samples_skipped += self.global_batch_size - samples_used
            self.pending_steps.append(ShortStep(step, replicas, samples_used))

    def report_metrics(self) -> dict:
        """What a report carries, and empties the pending records: the counts as metrics, and the
        short steps and events as lists (the tracking callback logs them at their own steps)."""
        metrics = {"replicas": self.last_replicas or self.world_size, "samples_skipped": self.samples_skipped,
                   "short_steps": self.short_steps,
                   "replica_steps": [asdict(s) for s in self.pending_steps],
                   "replica_events": [asdict(e) for e in self.pending_events]}
        self.pending_steps, self.pending_events = [], []
        return metrics

    def state(self) -> dict:
        return {"samples_skipped": self.samples_skipped, "short_steps": self.short_steps,
                "last_replicas": self.last_replicas,
                "pending_steps": [asdict(s) for s in self.pending_steps],
                "pending_events": [asdict(e) for e in self.pending_events]}

    def load(self, state: dict) -> None:
        self.samples_skipped, self.short_steps = int(state["samples_skipped"]), int(state["short_steps"])
        self.last_replicas = state.get("last_replicas")
        self.pending_steps = [ShortStep(**s) for s in state.get("pending_steps", ())]
        self.pending_events = [ReplicaEvent(**e) for e in state.get("pending_events", ())]


def waits_for_all(started: bool, replicas: int, world_size: int, participating: bool) -> bool:
    """Whether a group holds back a step it would take with fewer than all groups because the run
    has not yet started with all of them. Workers of a group that starts (a new run, a resume, a
    full restart) come up seconds apart on a busy machine; without this, the first one would train
    alone and the others heal from it, counting every step until then as short. A group that
    heals (not participating) takes its step: healing happens in it."""
    return not started and replicas < world_size and participating


@dataclass(frozen=True)
class GateDecision:
    report: bool
    due: StepDue  # what the report is for (carried dues included), or what stays carried


@dataclass(frozen=True)
class ReportGate:
    world_size: int

    def decide(self, due: StepDue, carried: StepDue, replicas: int) -> GateDecision:
        """At a step every replica group took, report what is due now and what was carried; at a
        short step, carry it all (a survivor must not wait at Ray's report barrier for a group that
        is being replaced)."""
        merged = StepDue(log=due.log or carried.log, evaluate=due.evaluate or carried.evaluate,
                         checkpoint=due.checkpoint or carried.checkpoint)
        if not merged.any:
            return GateDecision(False, NOTHING_DUE)
        return GateDecision(replicas >= self.world_size, merged)


def carried_after(decision: GateDecision) -> StepDue:
    """What the next step carries after `decision`."""
    return NOTHING_DUE if decision.report else replace(decision.due)
