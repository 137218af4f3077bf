"""This worker as one torchft replica group (`failure.mode: continue`): run on every worker.

Ray Train's torchft backend (TorchftConfig) starts a lighthouse on the head, makes every worker a
replica group of one and exports the lighthouse's address. Here each worker builds a torchft
Manager on it: every step starts a quorum of the replica groups alive, the gradients are averaged
over the groups in it (torchft's DDP), and the optimizer steps only if the quorum commits. A group
that joins late (Ray Train's replacement of a dead worker) takes the live model, optimizer,
scheduler, loop and ledger state from a peer over torchft's process-group transport, not from storage.
"""

from __future__ import annotations

import logging
import os
import time
from datetime import timedelta
from typing import Callable

import torch
from torch import nn
from torch.distributed import ReduceOp
from torch.nn.parallel import DistributedDataParallel

from training.failure.replicas import waits_for_all

# torchft's own timeouts. A collective with a dead peer fails at once (its socket closes); these
# bound a peer that hangs. Kept well under Ray Train's worker health check.
COLLECTIVE_TIMEOUT = timedelta(seconds=30)
QUORUM_TIMEOUT = timedelta(seconds=60)
# Between two quorums while a starting group waits for the others to come up.
START_WAIT_S = 0.05


def _average_over_quorum(manager, bucket):  # (no return annotation: DDP checks it, and it is a string here)
    buffer = bucket.buffer()
    manager.allreduce(buffer).wait()  # averaged in place; False on a failure (the Manager holds it)
    done: torch.futures.Future = torch.futures.Future()
    done.set_result(buffer)
    return done


def quiet_torchft_logs() -> None:
    """torchft logs every quorum and commit (its Rust side through RUST_LOG, read when its server
    starts; its Python side logs an empty line per commit): warnings only."""

    os.environ.setdefault("RUST_LOG", "warn")
    for name in ("torchft", "torchft_commits", "torchft_quorums"):
        logging.getLogger(name).setLevel(logging.WARNING)


class ReplicaGroup:
    def __init__(self, rank: int, world_size: int, global_batch_size: int, device: torch.device):
        quiet_torchft_logs()
        from torchft import Manager, ProcessGroupGloo  # (lazy: torchft)
        from torchft.checkpointing.pg_transport import PGTransport  # (lazy: torchft)

        if device.type == "cuda":
            from torchft import ProcessGroupNCCL  # (lazy: torchft)

            pg = ProcessGroupNCCL(timeout=COLLECTIVE_TIMEOUT)
        else:
            pg = ProcessGroupGloo(timeout=COLLECTIVE_TIMEOUT)
        self.world_size, self.global_batch_size, self.device = world_size, global_batch_size, device
        self.started = False  # a step was taken with every group (see replicas.waits_for_all)
        self._state_fns: dict[str, tuple[Callable[[], object], Callable[[object], None]]] = {}
        # min_replica_size 1: a step commits with any one group alive (the others' data parts of
        # that step are skipped and counted). init_sync: weights are seeded identically, but a
        # group resumed from an older checkpoint must still take the newest group's state.
        self.manager = Manager(
            pg=pg, min_replica_size=1, load_state_dict=self._load, state_dict=self._state,
            world_size=1, rank=0, replica_id=f"replica_{rank}", timeout=COLLECTIVE_TIMEOUT,
            quorum_timeout=QUORUM_TIMEOUT,
            checkpoint_transport=PGTransport(pg, timeout=COLLECTIVE_TIMEOUT, device=device))

    def share(self, name: str, get: Callable[[], object], put: Callable[[object], None]) -> None:
        """Part of the state a healing peer takes from this one."""
        self._state_fns[name] = (get, put)

    def _state(self) -> dict:
        return {name: get() for name, (get, _) in self._state_fns.items()}

    def _load(self, state: dict) -> None:
        for name, (_, put) in self._state_fns.items():
            put(state[name])

    def wrap(self, model: nn.Module) -> nn.Module:
        """The model whose backward averages gradients over the replica groups in the quorum.

        torchft's own DistributedDataParallel (0.2.0) cannot survive a peer's death: when the
        all-reduce fails ("Connection reset by peer" from a SIGKILLed peer), its comm hook asserts
        on a future that was never set (torchft/ddp.py `assert fut._fut`) and the survivor's
        training function dies with it. This hook does the same all-reduce and lets a failure be
        what torchft means it to be: an error held by the Manager, so that the step does not commit."""
        from torchft.process_group import ProcessGroupDummy  # (lazy: torchft)

        ddp = DistributedDataParallel(model, process_group=ProcessGroupDummy(0, 1))
        ddp.register_comm_hook(self.manager, _average_over_quorum)
        return ddp

    def start_step(self, step: int) -> None:
        """Before the forward: ask for this step's quorum (in the background, torchft's async quorum)."""
        if self.manager.current_step() != step:  # a resumed run: torchft counts from the checkpoint's step
            self.manager.load_state_dict({"step": step, "batches_committed": self.manager.batches_committed()})
        self.manager.start_quorum()

    def finish_step(self, part_size: int) -> tuple[bool, int, int]:
        """After the backward: (committed, replicas, samples used). `replicas` is the number of
        groups whose gradients went into the step; `samples_used` the sum of their data parts (one
        small all-reduce, only at a step that not every group took)."""
        replicas = self.manager.num_participants()
        if waits_for_all(self.started, replicas, self.world_size, self.manager.is_participating()):
            time.sleep(START_WAIT_S)
            return False, replicas, 0  # (no should_commit: the step is asked again in a new quorum)
        self.started = self.started or replicas >= self.world_size
        used = self.global_batch_size
        if replicas < self.world_size:
            count = torch.tensor([float(part_size)], device=self.device)
            self.manager.allreduce(count, reduce_op=ReduceOp.SUM).wait()  # a healing group adds 0
            used = int(round(count.item()))
        return self.manager.should_commit(), replicas, used

    @property
    def step(self) -> int:
        return self.manager.current_step()

    def shutdown(self) -> None:
        # Without it a group that finished can leave a healing peer stuck in its backward.
        self.manager.shutdown(wait=False)

