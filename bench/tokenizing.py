"""The tokenizing row: the `text` source's Ray Data pipeline on the bench's cluster against Hugging
Face `tokenizers` in one process (the `text` source's driver path: the same tokenizer, packing and
Parquet writing), on the same generated text, interleaved. Rows/s of packed rows written."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from bench.streaming import _write_text
from training.data.file_work import FileTask
from training.data.text import tokenize_in_driver, tokenize_on_cluster

SEQ_LEN = 128


def _write_corpus(folder: Path, files: int, lines_per_file: int) -> list[Path]:
    _write_text(folder, files, 7, lines_per_file)
    return sorted(folder.iterdir())


def _tokenizer(paths: list[Path]):
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1024, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train([str(p) for p in paths[:2]], trainer)
    return tokenizer


def tokenizing(quick: bool) -> dict:
    files, lines = (8, 2000) if quick else (32, 20000)
    repeats = 1 if quick else 2
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        paths = _write_corpus(root / "corpus", files, lines)
        tokenizer = _tokenizer(paths)
        eos_id = tokenizer.token_to_id("<|endoftext|>")
        sizes = {str(p): p.stat().st_size for p in paths}
        arguments = (tokenizer.to_str(), eos_id, SEQ_LEN + 1, 1024, "text")
        rates: dict[str, list[float]] = {"one_process": [], "ray_data": []}
        rows = {}
        for attempt in range(repeats):  # A B A B: the same text, a fresh output folder each time
            for mode in ("one_process", "ray_data"):
                tasks = [FileTask(str(p), "text", str(root / f"out-{mode}-{attempt}")) for p in paths]
                start = time.perf_counter()
                if mode == "one_process":
                    results = tokenize_in_driver(tasks, *arguments)
                else:
                    results = tokenize_on_cluster(tasks, sizes, *arguments)
                elapsed = time.perf_counter() - start
                rows[mode] = sum(r["rows"] for r in results)
                rates[mode].append(rows[mode] / elapsed)
    assert rows["one_process"] == rows["ray_data"], rows  # the same packed rows either way
    ratios = [b / a for a, b in zip(rates["one_process"], rates["ray_data"])]
    import ray  # (lazy: ray)

    return {"text_mb": round(sum(sizes.values()) / 2**20, 1), "files": files, "rows": rows["ray_data"],
            "one_process_rows_per_s": float(np.median(rates["one_process"])),
            "ray_data_rows_per_s": float(np.median(rates["ray_data"])),
            "ray_data_vs_one_process": float(np.median(ratios)),
            "ratio_spread": [round(min(ratios), 3), round(max(ratios), 3)],
            "cluster_cpus": int(ray.cluster_resources().get("CPU", 0))}
