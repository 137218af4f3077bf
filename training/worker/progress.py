"""The training metrics a worker reports: the loss and throughput of the window since the last
report, summed across workers, where the step time went (waiting for data, forward and backward,
the optimizer), and when this worker group started. Run on every worker."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional

import torch

from training.data.order import DIGEST_MODULUS
from training.worker.evaluate import sum_across_workers

# Where a step's time goes, each summed over a window's steps: the data wait on the host clock (a
# loader stall is the host's), the rest on the device's (CUDA events, read once per window, after
# the report's all-reduce has synchronised; on CPU the host clock).
PHASES = ("data_wait", "forward_backward", "optimizer")


@dataclass(frozen=True)
class WindowTotals:
    """The window's sums over every worker, and rank 0's view of time and of a preemption."""

    loss_sum: float
    units: float
    elapsed_s: float
    final_save: bool
    data_digest: int  # the window's global batches' digest (training.data.order.batch_digest)
    phase_s: tuple = (0.0,) * len(PHASES)  # summed over the window's steps and every worker


@dataclass(frozen=True)
class RunFacts:
    """What the metrics say about the run beside the window, fixed for this worker group."""

    global_batch_size: int
    steps_per_epoch: int
    total_steps: int
    world_size: int
    start_step: int  # where this worker group took over (steps redone after a failure)
    worker_start_s: float
    seq_len: Optional[int] = None  # language models: tokens per sample
    flops_per_token: Optional[float] = None
    peak_flops_per_s: Optional[float] = None  # per device; None where the peak is not known


class Progress:
    """This worker's window since the last report (loss, units, steps, time), and the metrics of a report."""

    def __init__(self, facts: RunFacts, rank: int, device: torch.device):
        self.facts, self.rank, self.device = facts, rank, device
        self.cuda = device.type == "cuda"
        self.first_step_s: Optional[float] = None
        self.next_window()

    def next_window(self) -> None:
        self.losses: list = []  # each micro-batch's summed loss, a tensor: no device sync per step
        self.units = self.steps = 0.0
        self.digest = 0
        self.start_s = time.perf_counter()
        self.phase_s = dict.fromkeys(PHASES, 0.0)
        self._device_phases: list = []  # (phase, start event, end event), read in reduce

    def waited_for_data(self, seconds: float) -> None:
        self.phase_s["data_wait"] += seconds

    def mark(self):
        """A point in the step, for `phase_done`: a CUDA event on a GPU, the host clock otherwise."""
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def phase_done(self, phase: str, started):
        """The phase that began at `started` (a mark) ends now; returns the mark of its end."""
        ended = self.mark()
        if self.cuda:
            self._device_phases.append((phase, started, ended))
        else:
            self.phase_s[phase] += ended - started
        return ended

    def add_digest(self, digest: int) -> None:
        """This worker's part of a global batch's data digest (training.data.order.batch_digest)."""
        self.digest = (self.digest + digest) % DIGEST_MODULUS

    def add(self, loss_sum: torch.Tensor, units: float) -> None:
        self.losses.append(loss_sum.detach())  # (summed when the window is reduced: one op, not one a step)
        self.units += units

    def snapshot(self) -> tuple:
        """The window's sums now, to `rewind` to if the step that follows is not taken after all
        (failure.mode continue: a step that did not commit, a sync round)."""
        return len(self.losses), self.units

    def rewind(self, snapshot: tuple) -> None:
        count, self.units = snapshot
        del self.losses[count:]

    def step_done(self) -> None:
        self.steps += 1
        if self.first_step_s is None:
            self.first_step_s = time.time()

    def reduce(self, final_save_wanted: bool) -> WindowTotals:
        """A collective. Rank 0's clock and its view of a preemption decide for all: they travel
        in the all-reduce that sums the losses (every other rank adds zero). The data digest of the
        steps since the last reduce is handed over: the caller adds it to the run's."""
        elapsed_s = time.perf_counter() - self.start_s if self.rank == 0 else 0.0
        if self._device_phases:
            self._device_phases[-1][2].synchronize()
            for phase, started, ended in self._device_phases:
                self.phase_s[phase] += started.elapsed_time(ended) / 1000.0
            self._device_phases = []
        loss_sum = float(torch.stack(self.losses).sum()) if self.losses else 0.0
        loss_sum, units, elapsed_s, final_save, digest, *phase_s = sum_across_workers(
            [loss_sum, self.units, elapsed_s, float(final_save_wanted), float(self.digest),
             *(self.phase_s[p] for p in PHASES)], self.device)
        self.digest = 0  # taken into the run's digest now, even when the window goes on unreported
        return WindowTotals(loss_sum, units, elapsed_s, final_save > 0, int(digest) % DIGEST_MODULUS, tuple(phase_s))

    def metrics(self, step: int, totals: WindowTotals, lr: float, data_digest: Optional[int] = None) -> dict:
        facts = self.facts
        samples_per_s = self.steps * facts.global_batch_size / totals.elapsed_s
        metrics = {"step": step, "epoch": step / facts.steps_per_epoch,
                   # (no units: a window of sync rounds only, failure.mode continue)
                   "train_loss": totals.loss_sum / totals.units if totals.units else float("nan"),
                   "samples_per_s": samples_per_s,
                   "lr": lr, "world_size": facts.world_size, "total_steps": facts.total_steps,
                   # wall clock (rank 0) for throughput over any span, and when this worker group
                   # started and finished its first step (cold start, recovery time)
                   "wall_time": time.time(), "worker_start_time": facts.worker_start_s,
                   "first_step_time": self.first_step_s, "start_step": facts.start_step}
        if data_digest is not None:
            metrics["data_digest"] = data_digest
        for phase, total_s in zip(PHASES, totals.phase_s):  # per step, the mean over the workers
            metrics[f"time_{phase}_ms"] = 1000.0 * total_s / (max(self.steps, 1) * facts.world_size)
        if facts.seq_len is not None:
            metrics["tokens_per_s"] = samples_per_s * facts.seq_len
            if facts.flops_per_token and facts.peak_flops_per_s:  # model FLOPs utilisation (GPUs in the peak table)
                peak = facts.peak_flops_per_s * facts.world_size
                metrics["mfu"] = metrics["tokens_per_s"] * facts.flops_per_token / peak
        if self.device.type == "cuda":
            metrics["peak_memory_bytes"] = torch.cuda.max_memory_allocated(self.device)
        return metrics
