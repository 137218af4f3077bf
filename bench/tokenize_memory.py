"""The tokenize-memory row: the peak RSS of a process that prepares (`text` source, tokenized in
that process) one single-document .txt file 16x larger than another, each in a fresh process; and
of a process that only imports what preparing uses, so that the growth above it is shown too. A
document is encoded in pieces (training/data/text_read.py): the peak must not follow the file."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from bench.common import REPO

# Prints this process's own high-water mark in kB (VmHWM: since exec, unlike ru_maxrss, which
# keeps the forked parent's) after preparing the data section in argv[1] under argv[2] (or, with
# no arguments, after the imports alone).
_PREPARE = """
import sys
import json
from training.data.registry import data_section, prepare
import training.data.text
if len(sys.argv) > 1:
    prepare(data_section(json.loads(sys.argv[1])), sys.argv[2], log=lambda *a, **k: None)
print(next(line.split()[1] for line in open("/proc/self/status") if line.startswith("VmHWM:")))
"""


def _peak_rss(*arguments: str) -> int:
    result = subprocess.run([sys.executable, "-c", _PREPARE, *arguments], cwd=REPO, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"prepare exited {result.returncode}: {result.stderr[-2000:]}")
    return int(result.stdout.split()[-1]) * 1024  # kB


def write_document(path: Path, size_bytes: int, seed: int = 0) -> None:
    """One document of space-separated words on a single line (no newline: one line, one document)."""
    words = np.array("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma "
                     "tau upsilon phi chi psi omega".split())
    rng = np.random.default_rng(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as out:
        written = 0
        while written < size_bytes:
            text = " ".join(rng.choice(words, 200_000)) + " "
            out.write(text[: size_bytes - written])
            written += len(text)


def tokenize_memory(quick: bool) -> dict:
    """Peak RSS preparing one .txt document of `large_mb` vs one of `small_mb` (target: within 1.2x)."""
    small_mb, large_mb = (2, 16) if quick else (4, 64)
    peaks, sizes = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        write_document(root / "validation" / "held-out.txt", 200_000, seed=1)
        for mb in (small_mb, large_mb):
            path = root / f"train-{mb}" / "book.txt"
            write_document(path, mb << 20)
            sizes[mb] = path.stat().st_size
            options = {"path": str(path), "validation_path": str(root / "validation"), "seq_len": 128,
                       "tokenize_on": "driver", "tokenizer": {"train": {"vocab_size": 512, "sample_bytes": 1_000_000}}}
            peaks[mb] = _peak_rss(json.dumps({"source": "text", "options": options}), str(root / f"cache-{mb}"))
            path.unlink()  # (the disk holds one of them at a time)
        imports = _peak_rss()
    return {"small_mb": round(sizes[small_mb] / 2**20, 1), "large_mb": round(sizes[large_mb] / 2**20, 1),
            "imports_peak_rss_mb": round(imports / 2**20, 1),
            "small_peak_rss_mb": round(peaks[small_mb] / 2**20, 1),
            "large_peak_rss_mb": round(peaks[large_mb] / 2**20, 1),
            "large_vs_small_peak_rss": peaks[large_mb] / peaks[small_mb],
            # the growth above a process that only imported what preparing uses
            "large_vs_small_growth": (peaks[large_mb] - imports) / max(peaks[small_mb] - imports, 1)}
