"""A torch.profiler trace of steps a..b (`train.profile.steps`) on rank 0 (the workers), written to
the run's storage as `<run dir>/profile/trace-steps-A-B.json` (Chrome trace format: open it in
https://ui.perfetto.dev or chrome://tracing); the driver logs it to MLflow when the run ends.

A profiler that fails is a warning: training goes on. A run resumed after step a traces only what
is left of the range (nothing, after b).
"""

from __future__ import annotations

import os
import tempfile
from typing import Optional

import torch

from training import storage
from training.config import ProfileConfig

PROFILE_DIR = "profile"


def trace_name(first: int, last: int) -> str:
    return f"trace-steps-{first}-{last}.json"


class StepProfiler:
    def __init__(self, config: Optional[ProfileConfig], rank: int, device: torch.device, run_dir: str):
        self.config, self.device, self.run_dir = config, device, run_dir
        self.active = config is not None and rank == 0
        self._profiler = None
        self._first: Optional[int] = None

    def before_step(self, step: int) -> None:
        """`step`: the number (from 1) of the step about to run."""
        if not self.active or self._profiler is not None:
            return
        first, last = self.config.steps
        if first <= step <= last:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            try:
                self._profiler = torch.profiler.profile(activities=activities, record_shapes=True)
                self._profiler.__enter__()
                self._first = step
            except Exception as exc:
                self._give_up(exc)

    def after_step(self, step: int) -> None:
        """`step`: the number of the step just done."""
        if self._profiler is None or step < self.config.steps[1]:
            return
        profiler, self._profiler, self.active = self._profiler, None, False
        try:
            profiler.__exit__(None, None, None)
            with tempfile.TemporaryDirectory() as tmp:
                local = os.path.join(tmp, "trace.json")
                profiler.export_chrome_trace(local)
                with open(local, encoding="utf-8") as trace:
                    text = trace.read()
            uri = storage.join(self.run_dir, PROFILE_DIR, trace_name(self._first, step))
            storage.write_text(uri, text)
            print(f"profile: steps {self._first}-{step} traced on rank 0: {uri}", flush=True)
        except Exception as exc:
            self._give_up(exc)

    def _give_up(self, exc: Exception) -> None:
        self._profiler, self.active = None, False
        print(f"warning: profile: no trace ({type(exc).__name__}: {str(exc)[:200]}); training goes on", flush=True)
