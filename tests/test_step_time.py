"""Where a step's time goes (training/worker/progress.py), without Ray: the real Progress of a
worker, on CPU, timing a data wait, forward and backward, and the optimizer over a window."""

import time

import torch

from training.worker.progress import PHASES, Progress, RunFacts


def test_a_window_reports_the_mean_time_of_each_phase_per_step():
    facts = RunFacts(global_batch_size=8, steps_per_epoch=10, total_steps=10, world_size=1, start_step=0,
                     worker_start_s=time.time())
    progress = Progress(facts, rank=0, device=torch.device("cpu"))
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        fetch_s = time.perf_counter()
        time.sleep(0.02)  # a loader stall
        batch = torch.randn(8, 4)
        progress.waited_for_data(time.perf_counter() - fetch_s)
        compute = progress.mark()
        loss = model(batch).pow(2).sum()
        loss.backward()
        time.sleep(0.01)
        progress.add(loss.detach(), 8)
        optimize = progress.phase_done("forward_backward", compute)
        optimizer.step()
        optimizer.zero_grad()
        progress.phase_done("optimizer", optimize)
        progress.step_done()
    totals = progress.reduce(False)
    metrics = progress.metrics(3, totals, lr=0.1)
    assert set(f"time_{p}_ms" for p in PHASES) <= metrics.keys()
    # (lower bounds only: the sleeps; a loaded machine only makes each phase longer)
    assert metrics["time_data_wait_ms"] >= 20 and metrics["time_forward_backward_ms"] >= 10
    assert metrics["time_optimizer_ms"] > 0
    # the three phases are parts of the window's wall time
    assert sum(metrics[f"time_{p}_ms"] for p in PHASES) * 3 <= totals.elapsed_s * 1000 + 1
    progress.next_window()
    assert progress.phase_s == dict.fromkeys(PHASES, 0.0)
