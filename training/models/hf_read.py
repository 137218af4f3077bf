"""Runs on the Train workers: DCP's safetensors reader with each rank's rows read by `pread` into
its own shard, not through a memory map. A mapped file's pages count in the process's RSS for as
long as the file is open (about a shard's worth again per rank); read this way, a rank's RSS grows
by its shard and by at most one tensor's slice (when the file's dtype differs from the model's)."""

from __future__ import annotations

import json
import math
import os

import torch
from torch.distributed.checkpoint import HuggingFaceStorageReader
from torch.futures import Future

_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}


def _header(path: str) -> tuple[int, dict]:
    """Where a safetensors file's data starts, and its header {name: {dtype, shape, data_offsets}}."""
    with open(path, "rb") as handle:
        length = int.from_bytes(handle.read(8), "little")
        return 8 + length, json.loads(handle.read(length))


def _pread_into(fd: int, view: memoryview, offset: int) -> None:
    while view:
        done = os.preadv(fd, [view], offset)
        if done <= 0:
            raise OSError(f"a safetensors file ended at byte {offset}")
        view, offset = view[done:], offset + done


class PreadHuggingFaceReader(HuggingFaceStorageReader):
    def read_data(self, plan, planner) -> Future:
        per_file: dict[str, list] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        for path, items in per_file.items():
            start, header = _header(path)
            fd = os.open(path, os.O_RDONLY)
            try:
                for item in items:
                    self._read_item(fd, start, header[item.storage_index.fqn], item, planner, path)
            finally:
                os.close(fd)
        done: Future = Future()
        done.set_result(None)
        return done

    def _read_item(self, fd: int, start: int, entry: dict, item, planner, path: str) -> None:
        dtype, shape = _DTYPES[entry["dtype"]], entry["shape"]
        target = planner.resolve_tensor(item).detach()
        offsets, lengths = list(item.storage_offsets), list(item.lengths)
        if list(lengths[1:]) != list(shape[1:]) or any(offsets[1:]):  # not whole rows: the memory-mapped way
            from safetensors import safe_open  # (lazy: safetensors)

            with safe_open(path, framework="pt") as handle:
                self._process_read_request(handle, item, planner)
            return
        row_bytes = dtype.itemsize * math.prod(shape[1:])
        first = start + entry["data_offsets"][0] + (offsets[0] * row_bytes if shape else 0)
        count = lengths[0] * row_bytes if shape else dtype.itemsize
        if tuple(target.shape) != tuple(lengths):
            raise AssertionError(f"{item.storage_index.fqn}: read {lengths}, the model's slice is {list(target.shape)}")
        if target.dtype == dtype and target.is_contiguous():  # straight into the shard
            _pread_into(fd, memoryview(target.reshape(-1).view(torch.uint8).numpy()), first)
        elif count:
            buffer = bytearray(count)
            _pread_into(fd, memoryview(buffer), first)
            target.copy_(torch.frombuffer(buffer, dtype=dtype).view(lengths))
        planner.commit_tensor(item, target)
