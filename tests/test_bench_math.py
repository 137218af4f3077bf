"""The arithmetic behind the benchmark rows, on hand-made inputs (the harness itself runs in
test_bench.py)."""

from types import SimpleNamespace

import pytest

from bench.common import steady_samples_per_s
from bench.recovery import analyse
from bench.report import spread
from bench.sweep import steps_to_target


def test_steady_throughput_skips_the_warm_up():
    history = [(10, 100.0), (20, 105.0), (30, 106.0), (40, 107.0)]  # a slow start, then 10 steps/s
    assert steady_samples_per_s(history, warmup_steps=20, global_batch=8) == pytest.approx(20 * 8 / 2.0)
    with pytest.raises(RuntimeError, match="too few reports"):
        steady_samples_per_s(history, warmup_steps=40, global_batch=8)


def test_a_spread_says_what_the_pairs_allow():
    from bench.common import paired_ratios

    straddling = paired_ratios([1.004, 0.989, 0.982], [1.0, 1.0, 1.0])  # tinylm 1w on 2026-12-03
    assert straddling["ratio_median"] == pytest.approx(0.989) and straddling["ratio_min"] == pytest.approx(0.982)
    assert "both sides of 1: no measured difference" in spread(straddling)
    wide = paired_ratios([0.897, 0.779, 0.926], [1.0, 1.0, 1.0])  # all below 1, spread 0.15 > gap 0.10
    assert "its size is uncertain" in spread(wide) and "both sides" not in spread(wide)
    steady = paired_ratios([0.8, 0.82, 0.81], [1.0, 1.0, 1.0])  # a 19% gap, spread 0.02
    assert spread(steady) == "min 0.80, max 0.82"
    assert spread(paired_ratios([0.9], [1.0])) == "min 0.90, max 0.90"  # one pair: no spread to speak of


def test_recovery_reads_kill_to_next_step_and_steps_lost():
    metrics = {"wall_time": [(100, 10.0), (200, 20.0), (300, 30.0)],
               "first_step_time": [(100, 5.0), (250, 40.0)],  # the second group's first step, 40.0
               "start_step": [(100, 0.0), (250, 200.0)]}      # resumed from the checkpoint at 200
    (found,) = analyse([35.0], metrics)
    assert found["kill_to_next_step_s"] == pytest.approx(5.0)
    assert found["steps_lost"] == pytest.approx(350 - 200)  # reached 350 at the kill (10 steps/s)
    assert found["kill_to_train_function_s"] is None  # (no worker_start_time series)
    # with the time each group's train function started: the kill -> next step in its two parts
    (parts,) = analyse([35.0], {**metrics, "worker_start_time": [(100, 3.0), (250, 38.5)]})
    assert parts["kill_to_train_function_s"] == pytest.approx(3.5)  # Ray Train: detect, tear down, start
    assert parts["train_function_to_first_step_s"] == pytest.approx(1.5)  # ours: data, model, restore, step


def test_sweep_work_counts_every_trials_steps_until_the_first_hit():
    a = SimpleNamespace(trial_id="a", timeline=[(10, 0.5, 1.0), (20, 0.9, 3.0)])
    b = SimpleNamespace(trial_id="b", timeline=[(10, 0.96, 2.0), (20, 0.97, 4.0)])
    assert steps_to_target([a, b], 0.95) == 10 + 10  # a's 10 steps came before b hit the target
    assert steps_to_target([a, b], 0.99) is None


def test_the_sweep_rows_files_are_valid_sweeps_that_differ_only_in_their_scheduler(tmp_path):
    from bench.sweep import sweep_file
    from tuning import config as sweep_config

    asha, fifo = (sweep_config.load(sweep_file(name, 3, 6, 160, tmp_path)) for name in ("asha", "fifo"))
    assert (asha.config.scheduler.name, fifo.config.scheduler.name) == ("asha", "fifo")
    assert asha.config.scheduler.grace_period_steps == 160 // 8 and asha.config.num_samples == 6
    assert asha.config.search.seed == 3 and asha.space == fifo.space and set(asha.space) == {
        "optim.lr", "model.options.dropout", "model.options.hidden"}
    assert asha.base == fifo.base and asha.base.train.max_steps == 160 and asha.base.scaling.num_workers == 1


def test_the_sweep_row_is_the_median_asha_over_random_ratio_of_the_seeds_that_reached_the_target():
    from bench.report import markdown
    from bench.sweep import summarise

    side = lambda to_target, total: {"steps_to_target": to_target, "total_steps": total, "stopped": 0}  # noqa: E731
    per_seed = [{"seed": 0, "asha": side(300, 600), "fifo": side(600, 960)},
                {"seed": 1, "asha": side(200, 500), "fifo": side(800, 960)},
                {"seed": 2, "asha": side(None, 480), "fifo": side(700, 960)}]  # (asha never got there)
    row = summarise(per_seed, 0.95, 6, 160)
    assert row["steps_to_target_ratio"] == pytest.approx((0.5 + 0.25) / 2)
    assert row["total_steps_ratio"] == pytest.approx(500 / 960)
    machine = {"cpu": "a CPU", "cores": 2, "torch": "2", "ray": "2", "python": "3"}
    table = markdown({"machine": machine, "date": "2026-01-01", "quick": False, "rows": {"sweep": row},
                      "row_seconds": {"sweep": 60.0}, "elapsed_s": 60.0, "ratios": {}})
    assert "| sweep ASHA vs random |" in table and "**0.38**" in table


def test_interleaved_measurements_alternate_sides():
    from bench.common import interleaved

    order = []
    a, b = interleaved(lambda: order.append("a") or 2.0, lambda: order.append("b") or 1.0, rounds=3)
    assert order == ["a", "b", "a", "b", "a", "b"] and a == [2.0] * 3 and b == [1.0] * 3
    order.clear()
    assert interleaved(lambda: order.append("a") or 2.0, lambda: order.append("b") or 1.0, 2) == ([2.0] * 2, [1.0] * 2)
    assert order == ["a", "b", "a", "b"]  # (the rounds as the last positional argument, as continuous.py calls it)


def test_interleaved_measurements_take_three_sides_in_turn():
    from bench.common import interleaved

    order, count = [], iter(range(100))

    def side(name):
        return lambda: order.append(name) or float(next(count))

    service, raytrain, torchrun = interleaved(side("service"), side("raytrain"), side("torchrun"), rounds=2)
    assert order == ["service", "raytrain", "torchrun"] * 2
    assert (service, raytrain, torchrun) == ([0.0, 3.0], [1.0, 4.0], [2.0, 5.0])  # round i: index i of each


def _overhead_results(**case) -> dict:
    machine = {"cpu": "a CPU", "cores": 2, "torch": "2", "ray": "2", "python": "3"}
    return {"machine": machine, "date": "2026-01-01", "quick": False, "rows": {"overhead": {"digits_2w": case}},
            "row_seconds": {}, "elapsed_s": 0, "ratios": {}}


def test_the_overhead_row_reports_three_sides_and_the_ratio_of_each_two():
    from bench.__main__ import ratios
    from bench.common import paired_ratios
    from bench.report import markdown

    served, ray_trained, plain = [98.0, 99.0, 95.0], [100.0, 100.0, 100.0], [110.0, 100.0, 100.0]
    vs_raytrain, theirs, pairs = (paired_ratios(served, ray_trained), paired_ratios(ray_trained, plain),
                                  paired_ratios(served, plain))
    assert vs_raytrain["ratio_median"] == pytest.approx(0.98) and theirs["ratio_min"] == pytest.approx(100 / 110)
    case = {"service_samples_per_s": 98.0, "raytrain_samples_per_s": 100.0, "baseline_samples_per_s": 100.0,
            "vs_raytrain": vs_raytrain["ratio_median"], "vs_raytrain_pairs": vs_raytrain,
            "raytrain_vs_baseline": theirs["ratio_median"], "raytrain_vs_baseline_pairs": theirs,
            "overhead_ratio": pairs["ratio_median"], "pairs": pairs, "steps": 2400, "warmup_steps": 800,
            "repeats": 3, "baseline": "torchrun DDP (gloo)"}
    results = _overhead_results(**case)
    (line,) = [line for line in markdown(results).splitlines() if line.startswith("| overhead digits_2w |")]
    assert "service 98 vs plain Ray Train 100 vs torchrun DDP (gloo) 100 samples/s" in line
    assert "vs plain Ray Train **0.980** (target >= 0.97; min 0.95, max 0.99" in line
    assert "vs torchrun DDP (gloo) **0.950** (min 0.89, max 0.99" in line
    assert "plain Ray Train vs torchrun DDP (gloo) 1.000 (min 0.91, max 1.00" in line
    assert "3 interleaved round(s)" in line
    found = ratios(results["rows"])
    assert found["overhead_ratio_digits_2w"] == pytest.approx(0.95)
    assert found["overhead_vs_raytrain_digits_2w"] == pytest.approx(0.98)
    assert found["overhead_raytrain_vs_baseline_digits_2w"] == pytest.approx(1.0)


def test_an_overhead_row_from_before_the_ray_train_side_renders_as_it_did():
    from bench.__main__ import ratios
    from bench.report import markdown

    results = _overhead_results(service_samples_per_s=11348.4, baseline_samples_per_s=13216.1, overhead_ratio=0.8587,
                                steps=2400, warmup_steps=800, repeats=2, baseline="torchrun DDP (gloo)")
    assert ("| overhead digits_2w | 11348 vs 13216 samples/s | **0.859** (min 0.86, max 0.86; 1 interleaved pair(s)) "
            "| steady-state samples/s (first 800 of 2400 steps excluded), service on Ray Train vs torchrun DDP (gloo), "
            "same model, data, batch, threads |") in markdown(results)
    assert ratios(results["rows"]) == {"overhead_ratio_digits_2w": 0.8587}


def test_paired_ratios_report_median_min_and_max():
    from bench.common import paired_ratios

    found = paired_ratios([10.0, 9.0, 12.0], [10.0, 10.0, 10.0])
    assert (found["ratio_median"], found["ratio_min"], found["ratio_max"]) == (1.0, 0.9, 1.2)
    assert found["rounds"] == 3


def test_continuous_row_reads_kill_to_the_survivors_next_step():
    from bench.continuous import kill_to_next_step_s

    assert abs(kill_to_next_step_s(100.0, [99_000, 100_600, 101_000]) - 0.6) < 1e-9
    assert kill_to_next_step_s(100.0, [99_000]) is None


def test_a_subset_run_keeps_the_other_rows_with_the_run_that_measured_them():
    from bench.__main__ import merged
    from bench.report import markdown

    cpu = {"cpu": "AMD EPYC", "cores": 2, "torch": "2.13.0", "ray": "2.60.0", "python": "3.11.7"}
    memory = {"model": "gpt preset small", "workers": 2, "ddp_bytes_per_worker": 2e8, "fsdp_bytes_per_worker": 1e8,
              "fsdp_vs_ddp_ratio": 0.5}
    before = {"machine": cpu, "date": "2026-12-01", "quick": False, "rows": {"memory": memory, "gpu": {"skipped": "x"}},
              "row_seconds": {"memory": 5.0}}
    now = {"machine": cpu, "date": "2026-12-04", "quick": False, "rows": {"gpu": {"skipped": "y"}}, "row_seconds": {}}
    result = merged(before, now)
    assert result["rows"]["memory"] == memory and result["rows"]["gpu"] == {"skipped": "y"}
    assert result["row_runs"] == {"memory": {"date": "2026-12-01", "machine": cpu},
                                  "gpu": {"date": "2026-12-04", "machine": cpu}}
    assert "Rows memory: the run of 2026-12-01 on AMD EPYC." in markdown(result).splitlines()[0]
    assert merged(before, {**now, "quick": True}) == {**now, "quick": True}  # a harness check replaces nothing
