"""Runs in the driver: `path: digits_png/train` and `validation_path: digits_png/validation` of the
`parquet` source, an image-classification table made from scikit-learn's bundled digits (1797 8x8
grayscale images, nothing downloaded): each image a PNG file's bytes (`image`) with its class
(`label`, 0-9), in Parquet files of ROWS_PER_GROUP-row row groups. Validation holds
VALIDATION_SHARE of the images, chosen by a seeded permutation. Deterministic: written once into
the data cache, in a folder named for the settings; also `python -m training.data.image_digits DIR`.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from training import storage

NAME = "digits_png"
VALIDATION_SHARE = 0.2
SPLIT_SEED = 0
ROWS_PER_GROUP = 128
FORMAT = 1
DONE = "_SUCCESS"  # written last (the listing skips it): the folder is complete


def png(pixels: np.ndarray) -> bytes:
    """An 8-bit grayscale PNG of a [height, width] array of 0-255 values."""
    from PIL import Image  # (lazy: Pillow)

    out = io.BytesIO()
    Image.fromarray(pixels.astype(np.uint8), mode="L").save(out, format="PNG")
    return out.getvalue()


def tables() -> dict[str, pa.Table]:
    """split -> its table: `image` (PNG bytes) and `label` (int64)."""
    from sklearn.datasets import load_digits  # (scikit-learn: only when the table is written)

    bunch = load_digits()
    images = np.rint(bunch.images * (255 / 16)).astype(np.uint8)  # (the set's 0-16 levels)
    order = np.random.default_rng(SPLIT_SEED).permutation(len(images))
    held = int(round(len(images) * VALIDATION_SHARE))
    parts = {"train": np.sort(order[held:]), "validation": np.sort(order[:held])}
    return {name: pa.table({"image": pa.array([png(images[i]) for i in rows], pa.binary()),
                            "label": pa.array(bunch.target[rows].astype(np.int64))})
            for name, rows in parts.items()}


def write(folder: str) -> str:
    """The table's files into `folder` (train/ and validation/, one Parquet file each), DONE last."""
    for name, table in tables().items():
        fs, path = storage.filesystem(storage.join(folder, name, "digits.parquet"))
        fs.create_dir(path.rsplit("/", 1)[0], recursive=True)
        partial = f"{path.rsplit('/', 1)[0]}/_digits.{os.getpid()}.tmp"  # (a listing skips it; moved whole)
        pq.write_table(table, partial, filesystem=fs, row_group_size=ROWS_PER_GROUP)
        fs.move(partial, path)
    storage.write_text(storage.join(folder, DONE), "")
    return folder


def ensure(cache_root: str) -> str:
    """The folder of the table, written first if it is not there yet."""
    settings = [FORMAT, VALIDATION_SHARE, SPLIT_SEED, ROWS_PER_GROUP]
    key = hashlib.sha256(json.dumps(settings).encode()).hexdigest()[:16]
    folder = storage.join(cache_root, f"digits-png-{key}")
    return folder if storage.exists(storage.join(folder, DONE)) else write(folder)


def _in_place(paths, cache_root: str):
    if paths is None:
        return None
    listed = [paths] if isinstance(paths, str) else list(paths)
    found = [storage.join(ensure(cache_root), *p.split("/")[1:]) if p.split("/", 1)[0] == NAME else p
             for p in listed]
    return found[0] if isinstance(paths, str) else found


def in_place(section, cache_root: str):
    """The parquet source's section with `digits_png/...` paths made the table's folders (written
    into the cache first); any other section as it is."""
    options = section.options
    named = [p for p in ([options.path] if isinstance(options.path, str) else options.path)
             + ([options.validation_path] if isinstance(options.validation_path, str) else
                options.validation_path or [])]
    if not any(p.split("/", 1)[0] == NAME for p in named):
        return section
    resolved = {"path": _in_place(options.path, cache_root),
                "validation_path": _in_place(options.validation_path, cache_root)}
    return section.model_copy(update={"options": options.model_copy(update=resolved)})


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m training.data.image_digits DIR  (writes DIR/train and DIR/validation)")
    print(write(sys.argv[1]))
