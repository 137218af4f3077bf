"""Autoscaling rehearsal: cluster.yaml's node types on Ray's fake multi-node provider. The pure
translation is checked without Ray; the end-to-end rehearsal starts a real local head (on the
default GCS port, as the fake provider requires) and is marked ray + slow."""

import pytest
from conftest import REPO

from cluster.config import load_and_prepare
from cluster.rehearse import FAKE_HEAD_TYPE, GCS_PORT, _port_free, fake_cluster_config, rehearse


def test_fake_config_keeps_names_and_resources_of_the_worker_types():
    _, prepared = load_and_prepare(REPO / "cluster.yaml")
    fake = fake_cluster_config(prepared, gpu_workers=2, idle_timeout_s=12)
    types = fake["available_node_types"]
    assert fake["provider"]["type"] == "fake_multinode" and fake["head_node_type"] == FAKE_HEAD_TYPE
    assert types[FAKE_HEAD_TYPE]["resources"] == {"CPU": 4, "GPU": 0}
    assert types["gpu_spot"]["resources"] == {"CPU": 4, "GPU": 1}
    assert types["gpu_ondemand"]["resources"] == {"CPU": 8, "GPU": 1}
    assert types["gpu_spot"]["max_workers"] == 2 and types["gpu_spot"]["min_workers"] == 0
    assert fake["idle_timeout_minutes"] == pytest.approx(0.2)


@pytest.mark.ray
@pytest.mark.slow
def test_rehearsal_scales_gpu_workers_up_and_back_down():
    if not _port_free(GCS_PORT):
        pytest.skip(f"port {GCS_PORT} is in use: the fake multi-node cluster needs Ray's default GCS port")
    lines = []
    result = rehearse(REPO / "cluster.yaml", gpu_workers=2, idle_timeout_s=8, timeout_s=180, echo=lines.append)
    events = [event["event"] for event in result.events]
    assert result.peak_gpu_nodes == 2, lines          # two fake GPU nodes launched for the job
    assert "finished" in events and result.scaled_down, lines  # and released once idle
    assert events.index("finished") < events.index("scaled_down")
    assert any("gpu_spot" in line for line in result.active_at_peak), lines  # spot is the preferred type
    assert _port_free(GCS_PORT)  # everything the rehearsal started is gone
