"""The cluster address that `ray start` recorded on this machine is joined only when Ray's GCS
answers there and the session it names is on disk: a program that is not Ray on the recorded port
makes the driver forget the record and start its own cluster; a leftover cluster whose session
files are gone stops the command with one line (exit 2) saying how to clear it. No Ray is started:
the GCS is a gRPC fake of the one call a joining driver makes first."""

import os
import socket
import subprocess
import sys
import time
from concurrent import futures

import pytest
from conftest import CONFIGS

from training.errors import UserError
from training.run.session import decide_recorded_cluster, live_local_cluster


def test_the_decision_on_a_recorded_cluster():
    def decide(answered, name, exists):
        return decide_recorded_cluster("127.0.0.1:6379", "/tmp/ray/ray_current_cluster", answered, name, exists)

    assert decide(False, None, False).forget and not decide(False, None, False).join
    assert decide(True, "session_1", True).join
    assert decide(True, None, False).join  # a GCS that refused the call (auth, TLS): Ray's connect explains
    broken = decide(True, "session_1", False)
    assert not broken.join and not broken.forget
    assert "/tmp/ray/session_1 is gone" in broken.problem and "ray stop" in broken.problem


@pytest.fixture
def ray_tmpdir(tmp_path, monkeypatch):
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    return tmp_path


def record(ray_tmpdir, address):
    (ray_tmpdir / "ray").mkdir(parents=True, exist_ok=True)
    (ray_tmpdir / "ray" / "ray_current_cluster").write_text(address)
    return ray_tmpdir / "ray" / "ray_current_cluster"


@pytest.fixture
def not_ray():
    """A loopback port that accepts connections and never says anything."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    yield f"127.0.0.1:{listener.getsockname()[1]}"
    listener.close()


@pytest.fixture
def fake_gcs():
    """A gRPC server answering the session-name lookup as Ray's GCS does."""
    import grpc
    from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc

    class KV(gcs_service_pb2_grpc.InternalKVGcsServiceServicer):
        def InternalKVGet(self, request, context):
            assert request.key == b"session_name"
            return gcs_service_pb2.InternalKVGetReply(value=b"session_2026-12-03_01-00-00_000000_1")

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    gcs_service_pb2_grpc.add_InternalKVGcsServiceServicer_to_server(KV(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}"
    server.stop(None)


def test_a_recorded_port_that_is_not_ray_is_forgotten(ray_tmpdir, not_ray):
    recorded = record(ray_tmpdir, not_ray)
    started = time.monotonic()
    assert live_local_cluster() is None  # a fresh local cluster is started instead
    assert time.monotonic() - started < 10 and not recorded.exists()


def test_a_live_gcs_is_joined_only_with_its_session_on_disk(ray_tmpdir, fake_gcs):
    recorded = record(ray_tmpdir, fake_gcs)
    with pytest.raises(UserError, match=r"is running but its session directory .*session_2026-12-03.* is gone"):
        live_local_cluster()
    assert recorded.exists()  # not the driver's to forget: its processes still run
    (ray_tmpdir / "ray" / "session_2026-12-03_01-00-00_000000_1").mkdir()
    assert live_local_cluster() == fake_gcs


def test_the_command_says_in_one_line_how_to_clear_a_leftover_cluster(tmp_path, fake_gcs):
    ray_tmp = tmp_path / "raytmp"
    record(ray_tmp, fake_gcs)
    env = {"PATH": f"{os.path.dirname(sys.executable)}:/usr/bin:/bin", "HOME": str(tmp_path),
           "RAY_TMPDIR": str(ray_tmp)}
    result = subprocess.run([sys.executable, "-m", "training", str(CONFIGS / "digits.yaml"),
                             "--set", "tracking.enabled=false", "--set", f"data.cache_dir={tmp_path / 'cache'}"],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith("error: the Ray cluster recorded in") and "ray stop" in lines[-1]
    assert "Traceback" not in result.stderr
