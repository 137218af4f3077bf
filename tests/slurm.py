"""A one-node Slurm for tests: munged, slurmctld and slurmd of Debian's packages (munge, slurmctld,
slurmd, slurm-client) run in the foreground from a temporary folder with a generated munge key and
slurm.conf; the clients (sbatch, squeue, scancel) reach it through SLURM_CONF. Every daemon is
stopped by its pid at the end."""

import os
import shutil
import socket
import subprocess
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

from aws import free_port

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "squeue", "scancel", "sinfo", "scontrol", "srun")
PACKAGES = "munge slurmctld slurmd slurm-client"


def missing() -> str | None:
    """Why a Slurm cannot run here (what to install), or None."""
    absent = [name for name in DAEMONS + CLIENTS if shutil.which(name, path=f"{os.environ.get('PATH', '')}"
                                                                              ":/usr/sbin:/sbin") is None]
    if absent:
        return (f"needs Slurm and munge ({', '.join(absent)} not found): as root, `apt-get install "
                f"--no-install-recommends {PACKAGES}` (make setup does it where apt is available as root)")
    if os.geteuid() != 0:
        return "needs root: slurmd starts job steps as the submitting user, which only root can do"
    return None


def _binary(name: str) -> str:
    return shutil.which(name, path=f"{os.environ.get('PATH', '')}:/usr/sbin:/sbin")


CONF = """\
ClusterName=raytests
SlurmctldHost={node}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={root}/munge.socket
CredType=cred/munge
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.log
# No cgroups in a container: job steps are tracked by their process tree.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
ReturnToService=2
# scancel: SIGTERM, then SIGKILL this many seconds later (Slurm's default is 30)
KillWait=5
MinJobAge=600
NodeName={node} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN
PartitionName=test Nodes={node} Default=YES MaxTime=INFINITE State=UP
"""


def _wait(condition, timeout_s: float, what: str, processes=()) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        dead = [p.args[0] for p in processes if p.poll() is not None]
        if dead or time.monotonic() > deadline:
            raise RuntimeError(f"{what}: not within {timeout_s} s" + (f" ({', '.join(dead)} exited)" if dead else ""))
        time.sleep(0.2)


@contextmanager
def one_node_slurm():
    """A Slurm cluster of this machine alone (all its CPUs); yields the environment its clients need."""
    root = Path(tempfile.mkdtemp(prefix="slurm-"))
    for folder in ("state", "spool"):
        (root / folder).mkdir()
    key = root / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    node = socket.gethostname().split(".")[0]
    (root / "slurm.conf").write_text(CONF.format(node=node, root=root, cpus=os.cpu_count(), ctld_port=free_port(),
                                                 slurmd_port=free_port()))
    env = {**os.environ, "SLURM_CONF": str(root / "slurm.conf")}
    processes: list[subprocess.Popen] = []
    log = open(root / "daemons.out", "wb")
    try:
        def start(*command):
            processes.append(subprocess.Popen([_binary(command[0]), *command[1:]], env=env, stdout=log, stderr=log))

        start("munged", "--foreground", "--force", f"--socket={root}/munge.socket", f"--key-file={key}",
              f"--pid-file={root}/munged.pid", f"--seed-file={root}/munged.seed", f"--log-file={root}/munged.log")
        _wait(lambda: (root / "munge.socket").exists(), 30, "munged", processes)
        start("slurmctld", "-D", "-i", "-f", str(root / "slurm.conf"))
        start("slurmd", "-D", "-N", node, "-f", str(root / "slurm.conf"))
        _wait(lambda: subprocess.run([_binary("sinfo"), "-h", "-o", "%t"], env=env, capture_output=True,
                                     text=True).stdout.strip() == "idle", 60, "the node idle in sinfo", processes)
        yield {"SLURM_CONF": str(root / "slurm.conf")}
    finally:
        for process in reversed(processes):
            process.terminate()
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        log.close()
        shutil.rmtree(root, ignore_errors=True)
