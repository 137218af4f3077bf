"""`python -m cluster cost`: prices from the dated table, --hours/--workers arithmetic, spill-over
from spot to the on-demand fallback, and energy from the GPUs' rated power."""

import json
import os
import re
import subprocess
import sys

import pytest
from conftest import REPO

from cluster.config import load_and_prepare
from cluster.cost import estimate_run, gpu_types_by_preference, node_costs
from cluster.prices import PRICE_TABLE_FILE, load_price_table

PRICES = json.loads(PRICE_TABLE_FILE.read_text())["instance_types"]
HEAD_OD = PRICES["m5.xlarge"]["on_demand_usd_per_hour"]
SPOT = PRICES["g5.xlarge"]["spot_usd_per_hour"]
SPOT_OD = PRICES["g5.xlarge"]["on_demand_usd_per_hour"]
FALLBACK_OD = PRICES["g5.2xlarge"]["on_demand_usd_per_hour"]
WATTS = PRICES["g5.xlarge"]["gpu_rated_watts"]


@pytest.fixture(scope="module")
def costs():
    _, config = load_and_prepare(REPO / "cluster.yaml")
    priced, unknown = node_costs(config, load_price_table())
    assert unknown == []
    return priced


def no_aws_env(tmp_path) -> dict:
    """No credentials: no keys, no ~/.aws, and no instance profile even on an EC2 test runner."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    return {**env, "HOME": str(tmp_path), "AWS_EC2_METADATA_DISABLED": "true"}


def cost_cli(tmp_path, *args):
    env = no_aws_env(tmp_path)
    done = subprocess.run([sys.executable, "-m", "cluster", "cost", str(REPO / "cluster.yaml"), *args],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def dollars(output, label):
    return float(re.search(rf"^\s+{label}\s+\$([0-9.]+)", output, re.M).group(1))


def test_price_table_is_dated_and_complete():
    table = json.loads(PRICE_TABLE_FILE.read_text())
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", table["as_of"])
    for row in table["instance_types"].values():
        assert row["spot_usd_per_hour"] < row["on_demand_usd_per_hour"]
        assert (row["gpus"] > 0) == (row["gpu_rated_watts"] > 0)


def test_node_types_are_priced_from_the_table(costs):
    rows = {cost.node_type: cost for cost in costs}
    assert rows["head_cpu"].usd_per_hour == HEAD_OD  # on-demand head
    assert rows["gpu_spot"].usd_per_hour == SPOT and rows["gpu_spot"].on_demand_usd_per_hour == SPOT_OD
    assert rows["gpu_ondemand"].usd_per_hour == FALLBACK_OD
    assert [c.node_type for c in gpu_types_by_preference(costs, "head_cpu")] == ["gpu_spot", "gpu_ondemand"]


def test_cli_output_carries_the_table_numbers(tmp_path):
    out = cost_cli(tmp_path, "--hours", "3", "--workers", "2")
    assert f"as of {json.loads(PRICE_TABLE_FILE.read_text())['as_of']}" in out
    assert re.search(rf"gpu_spot\s+g5.xlarge\s+spot\s+1xA10G\s+{SPOT_OD:.3f}\s+{SPOT:.3f}\s+{SPOT:.3f}\s+8", out)
    assert dollars(out, "head") == pytest.approx(HEAD_OD * 3, abs=0.005)
    assert dollars(out, "workers") == pytest.approx(2 * SPOT * 3, abs=0.005)
    assert dollars(out, "total") == pytest.approx(HEAD_OD * 3 + 2 * SPOT * 3, abs=0.005)
    kwh = float(re.search(r"energy\s+([0-9.]+) kWh", out).group(1))
    assert kwh == pytest.approx(2 * WATTS * 3 / 1000, abs=0.005)


def test_more_workers_than_spot_allows_spill_to_the_on_demand_fallback(tmp_path):
    out = cost_cli(tmp_path, "--hours", "2", "--workers", "10")
    assert "8 x gpu_spot, 2 x gpu_ondemand" in out
    assert dollars(out, "workers") == pytest.approx((8 * SPOT + 2 * FALLBACK_OD) * 2, abs=0.005)
    assert re.search(r"energy\s+3.00 kWh", out)  # 10 GPUs x 150 W x 2 h


def test_default_run_is_one_hour_at_the_spot_types_max(costs):
    run = estimate_run(costs, "head_cpu", hours=1.0)
    assert run.workers == {"gpu_spot": 8} and run.unplaced_workers == 0
    assert run.total_usd == pytest.approx(HEAD_OD + 8 * SPOT)
    assert run.on_demand_usd == pytest.approx(HEAD_OD + 8 * SPOT_OD)
    assert run.as_metrics() == {"cluster_cost_usd_estimate": round(HEAD_OD + 8 * SPOT, 4),
                                      "cluster_gpu_energy_kwh_estimate": round(8 * WATTS / 1000, 4)}


def test_workers_beyond_every_max_are_reported_not_priced(costs):
    run = estimate_run(costs, "head_cpu", hours=1.0, workers=20)
    assert run.workers == {"gpu_spot": 8, "gpu_ondemand": 4} and run.unplaced_workers == 8
    with pytest.raises(ValueError):
        estimate_run(costs, "head_cpu", hours=-1.0)


def test_negative_hours_are_bad_input(tmp_path):
    done = subprocess.run([sys.executable, "-m", "cluster", "cost", str(REPO / "cluster.yaml"), "--hours", "-1"],
                          cwd=REPO, env=no_aws_env(tmp_path), capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--hours" in done.stderr


def test_current_spot_prices_reads_every_page_for_linux_from_now_in_the_given_zones():
    """What moto cannot show (it ignores the filters and never pages): the query AWS gets, checked
    by botocore's own Stubber, and the answer read across pages."""
    import datetime

    import boto3
    from botocore.stub import ANY, Stubber

    from cluster.aws_facts import current_spot_prices

    ec2 = boto3.client("ec2", region_name="us-west-2", aws_access_key_id="x", aws_secret_access_key="x")
    at = lambda minute: datetime.datetime(2026, 12, 1, 12, minute, tzinfo=datetime.timezone.utc)  # noqa: E731
    point = lambda zone, price, minute, os_="Linux/UNIX": {  # noqa: E731
        "AvailabilityZone": zone, "SpotPrice": str(price), "Timestamp": at(minute), "ProductDescription": os_,
        "InstanceType": "g5.xlarge"}
    query = {"InstanceTypes": ["g5.xlarge"], "ProductDescriptions": ["Linux/UNIX", "Linux/UNIX (Amazon VPC)"],
             "StartTime": ANY, "Filters": [{"Name": "availability-zone", "Values": ["us-west-2a", "us-west-2b"]}]}
    with Stubber(ec2) as stub:
        stub.add_response("describe_spot_price_history", {"SpotPriceHistory": [
            point("us-west-2a", 0.40, 1), point("us-west-2a", 0.90, 5, "Windows")], "NextToken": "page-2"}, query)
        stub.add_response("describe_spot_price_history", {"SpotPriceHistory": [
            point("us-west-2a", 0.42, 7), point("us-west-2b", 0.50, 3), point("us-west-2c", 0.10, 3)]},
            {**query, "NextToken": "page-2"})
        prices = current_spot_prices(ec2, "g5.xlarge", {"us-west-2a", "us-west-2b"})
        stub.assert_no_pending_responses()
    # the newest Linux price of each listed zone: the second page's for 2a, never Windows, never 2c
    assert prices == {"us-west-2a": 0.42, "us-west-2b": 0.50}


# ---------------------------------------------------------------- a finished run's own estimate


def test_gpu_nodes_count_workers_only_when_they_hold_gpus():
    from training.run.cost import gpu_nodes

    assert gpu_nodes(4, use_gpu=True) == 4
    assert gpu_nodes(4, use_gpu=False) == 0
    with pytest.raises(ValueError):
        gpu_nodes(-1, use_gpu=True)


@pytest.mark.parametrize("use_gpu, spot_nodes", [(True, 2), (False, 0)], ids=["gpu_workers", "cpu_workers"])
def test_a_finished_run_is_priced_for_the_nodes_its_workers_held(tmp_path, use_gpu, spot_nodes):
    """finalize on a described cluster, with a fake tracker: 2 workers for 2 hours cost 2 spot GPU
    nodes beside the head when they held GPUs, and the head alone when they trained on CPUs."""
    from types import SimpleNamespace

    from training.run.driver import RunSummary
    from training.run.finalize import finalize

    logged = []
    tracker = SimpleNamespace(run_id=None, log_metrics=lambda metrics, step: logged.append(metrics))
    job = SimpleNamespace(tracking=SimpleNamespace(cluster_config=str(REPO / "cluster.yaml")),
                          scaling=SimpleNamespace(max_workers=2))
    summary = RunSummary(name="r", run_dir=str(tmp_path), steps=10, metrics={"world_size": 2}, wall_s=2 * 3600,
                         resumed=False, use_gpu=use_gpu)
    finalize(job, None, SimpleNamespace(checkpoint=None), None, tracker, summary, log=lambda line: None)
    expected = {"cluster_cost_usd_estimate": round(2 * (HEAD_OD + spot_nodes * SPOT), 4),
                "cluster_gpu_energy_kwh_estimate": round(2 * spot_nodes * WATTS / 1000, 4)}
    assert summary.extra["cost"] == expected and logged == [expected]
    assert json.loads((tmp_path / "summary.json").read_text())["cost"] == expected
