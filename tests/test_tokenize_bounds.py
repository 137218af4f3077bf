"""The `text` source on any input: memory bounded by a batch whatever a document's size (a long
document encoded in pieces to its own ids), compressed JSON Lines read as JSON Lines, and bad input
(a file that does not decompress, a tokenizer that cannot encode, a cache folder that cannot be
written) refused naming the option and the file before anything is written. In-process or in a
fresh process, no Ray."""

import gzip
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import REPO
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from training.data import parquet, text
from training.data.file_work import FileTask
from training.data.registry import data_section
from training.data.text_read import BATCH_BYTES, PIECE_CHARS, documents, format_of, split
from training.data.tokenize import tokenize_file
from training.errors import UserError

WORDS = np.array("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho".split())
# Text a pre-tokenizer could split differently at a careless cut: runs of spaces, newlines, tabs,
# contractions, digits, punctuation, characters of several UTF-8 bytes.
TRICKY = ["alpha", "don't", "12345", "3.14", "?!", "ünïcödé", "日本語", "😀x", "  ", "\n", "\n\n", "\r\n", "\t", " . "]


def tricky_text(chars: int, seed: int = 0) -> str:
    rng = np.random.default_rng(seed)
    parts, size = [], 0
    while size < chars:
        part = str(rng.choice(TRICKY)) + (" " if rng.random() < 0.6 else "")
        parts.append(part)
        size += len(part)
    return "".join(parts)


def one_line_document(path: Path, size_bytes: int) -> None:
    """Space-separated words on one line: one document."""
    rng = np.random.default_rng(0)
    with path.open("w") as out:
        written = 0
        while written < size_bytes:
            chunk = " ".join(rng.choice(WORDS, 100_000)) + " "
            out.write(chunk)
            written += len(chunk)


def byte_level_bpe(sample: str, vocab_size: int = 320) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator([sample], trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<|endoftext|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return tokenizer


def metaspace_bpe(sample: str) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.train_from_iterator([sample], trainers.BpeTrainer(vocab_size=320, special_tokens=["</s>", "<unk>"],
                                                                show_progress=False))
    return tokenizer


def data_config(path, **extra):
    options = {"path": str(path), "validation_fraction": 0.3, "seq_len": 16,
               "tokenizer": {"train": {"vocab_size": 300, "sample_bytes": 10_000}}, "partitions": 2, **extra}
    return data_section(dict(source="text", options=options))


def files_under(folder: Path) -> list[Path]:
    return [p for p in folder.rglob("*") if p.is_file()] if folder.exists() else []


# --- memory -----------------------------------------------------------------------------------------------

# Tokenizes the file argv[2] (format argv[3]) with the tokenizer file argv[1] into argv[4], in this
# fresh process, as the driver does; prints the process's peak RSS in kB (VmHWM: since exec).
_TOKENIZE = """
import sys
from training.data.file_work import FileTask
from training.data.text import tokenize_in_driver
tokenizer, source, fmt, out = sys.argv[1:]
(counts,) = tokenize_in_driver([FileTask(source, fmt, out)], open(tokenizer).read(), 0, 129, 512, "text")
assert "error" not in counts and counts["rows"] > 0, counts
print(next(line.split()[1] for line in open("/proc/self/status") if line.startswith("VmHWM:")))
"""


def peak_rss_kb(tokenizer: Path, source: Path, fmt: str, out: Path) -> int:
    result = subprocess.run([sys.executable, "-c", _TOKENIZE, str(tokenizer), str(source), fmt, str(out)], cwd=REPO,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return int(result.stdout.split()[-1])


def book_table(path: Path, size_bytes: int) -> None:
    """Parquet documents of about 1 MB each (books), 16 to a row group."""
    rng = np.random.default_rng(0)
    books = [" ".join(rng.choice(WORDS, 170_000)) for _ in range(max(1, size_bytes // (1 << 20)))]
    pq.write_table(pa.table({"text": books}), path, row_group_size=16)


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads VmHWM from /proc")
@pytest.mark.parametrize("fmt", ["text", "parquet"])
def test_peak_memory_of_tokenizing_does_not_follow_the_size_of_a_document_or_of_a_batch_of_them(tmp_path, fmt):
    """One .txt document of 32 MB vs one of 4 MB; Parquet books of 1 MB, 32 of them vs 4 (today's
    reading took 1024 documents at a time whatever their size: every book of the file at once)."""
    write = one_line_document if fmt == "text" else book_table
    write(tmp_path / "small", 4 << 20)
    write(tmp_path / "large", 32 << 20)
    tokenizer = tmp_path / "tokenizer.json"
    byte_level_bpe(" ".join(WORDS)).save(str(tokenizer))
    small = peak_rss_kb(tokenizer, tmp_path / "small", fmt, tmp_path / "out-small")
    large = peak_rss_kb(tokenizer, tmp_path / "large", fmt, tmp_path / "out-large")
    # (before: 0.9 GB and 2.9 GB for a 4 and a 16 MB .txt document; now about 0.27 GB for either)
    assert large < 1.5 * small, (small, large)


# --- pieces of a long document ----------------------------------------------------------------------------

@pytest.mark.parametrize("make", [byte_level_bpe, metaspace_bpe], ids=["byte-level BPE", "Metaspace BPE"])
def test_a_long_document_in_pieces_encodes_to_its_own_ids(make):
    document = tricky_text(60_000)
    tokenizer = make(document)
    pieces = list(split(document, 1000))
    assert "".join(pieces) == document and len(pieces) > 60 and max(map(len, pieces)) <= 1000
    whole = tokenizer.encode(document, add_special_tokens=False).ids
    in_pieces = [i for p in tokenizer.encode_batch(pieces, add_special_tokens=False) for i in p.ids]
    assert in_pieces == whole


def test_a_stretch_with_no_space_is_still_cut_within_the_piece_size():
    document = "x" * 5000 + "\n" + "y" * 5000
    pieces = list(split(document, 1000))
    assert "".join(pieces) == document and max(map(len, pieces)) <= 1000


def test_a_large_text_file_is_read_in_batches_that_rejoin_to_its_text(tmp_path):
    """Reads of 1 MiB cut characters of several bytes: the pieces still decode to the file's text."""
    document = tricky_text(1_500_000, seed=1)
    (tmp_path / "book.txt").write_text(document)
    batches = list(documents(str(tmp_path / "book.txt"), "text", "text"))
    texts = [t for b in batches for t in b.texts]
    assert "".join(texts) == document and "\ufffd" not in document
    assert [e for b in batches for e in b.ends] == [False] * (len(texts) - 1) + [True]
    assert len(batches) > 1 and all(sum(map(len, b.texts)) < BATCH_BYTES + PIECE_CHARS for b in batches)


def test_a_packed_long_document_is_its_whole_encoding(tmp_path):
    """tokenize_file on a document of several pieces and batches writes the rows the document's
    whole encoding packs into."""
    document = tricky_text(1_300_000, seed=2)
    (tmp_path / "book.txt").write_text(document)
    tokenizer = byte_level_bpe(document[:100_000])
    counts = tokenize_file(FileTask(str(tmp_path / "book.txt"), "text", str(tmp_path / "out")), tokenizer, 0, 33, 64,
                           "text")
    stream = np.r_[tokenizer.encode(document, add_special_tokens=False).ids, 0]
    (written,) = (tmp_path / "out").glob("*.parquet")
    rows = np.array(pq.read_table(written).column("tokens").to_pylist())
    assert counts["documents"] == 1 and counts["tokens"] == len(stream) and counts["bytes"] == len(document)
    assert rows.shape == (len(stream) // 33, 33) and (rows.ravel() == stream[:rows.size]).all()


def test_parquet_books_are_read_in_batches_of_bytes_each_book_in_pieces(tmp_path):
    rng = np.random.default_rng(3)
    books = [" ".join(rng.choice(WORDS, int(n))) for n in (100, 400_000, 5, 300_000)]
    tags = [["a", "b"]] * 6  # (a nested column first: the text column's leaf is not its field's index)
    pq.write_table(pa.table({"tags": tags, "meta": [{"n": 1}] * 6, "text": books + [None, ""]}),
                   tmp_path / "books.parquet", row_group_size=1024)
    batches = list(documents(str(tmp_path / "books.parquet"), "parquet", "text"))
    assert all(sum(map(len, b.texts)) < BATCH_BYTES + PIECE_CHARS for b in batches) and len(batches) > 2
    texts, ends = [t for b in batches for t in b.texts], [e for b in batches for e in b.ends]
    rejoined, current = [], ""
    for piece, end in zip(texts, ends):
        current += piece
        if end:
            rejoined, current = rejoined + [current], ""
    assert rejoined == books


# --- formats ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["a.jsonl.gz", "a.ndjson.gz", "c4-train.00000-of-01024.json.gz", "a.JSONL.GZ",
                                  "a.jsonl.zst"])
def test_compressed_json_lines_are_read_as_json_lines(name):
    assert format_of(f"s3://bucket/{name}", "auto") == "jsonl"
    assert format_of("a.json", "auto") == format_of("a.txt.gz", "auto") == "text"


def test_a_c4_style_json_gz_file_is_tokenized_as_documents_not_as_json_text(tmp_path):
    docs = [" ".join(np.random.default_rng(i).choice(WORDS, 60)) for i in range(5)]
    path = tmp_path / "in" / "c4-train.00000-of-01024.json.gz"
    path.parent.mkdir()
    path.write_bytes(gzip.compress("".join(json.dumps({"text": d, "url": "u"}) + "\n" for d in docs).encode()))
    (tmp_path / "held-out.txt").write_text(docs[0])
    tokenizer = byte_level_bpe(" ".join(docs))
    plan = text.SOURCE.plan(data_config(path, validation_path=str(tmp_path / "held-out.txt"), validation_fraction=None),
                            str(tmp_path / "c"))
    counts = tokenize_file(FileTask(str(path), plan.fmt(str(path)), str(tmp_path / "out")), tokenizer, 0, 17, 4,
                           "text")
    assert counts["documents"] == 5 and counts["bytes"] == sum(map(len, docs))


def test_a_json_lines_file_named_gz_that_is_not_gzip_is_refused_naming_it_before_anything_is_written(tmp_path):
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "good.txt").write_text("alpha beta gamma " * 50)
    (tmp_path / "in" / "part-0.jsonl.gz").write_text('{"text": "alpha beta"}\n')
    with pytest.raises(UserError) as raised:
        text.SOURCE.plan(data_config(tmp_path / "in", validation_fraction=0.5), str(tmp_path / "cache"))
    assert "data.options.path" in str(raised.value) and "part-0.jsonl.gz is not gzip-compressed" in str(raised.value)
    assert not files_under(tmp_path / "cache")


def test_a_gzip_file_cut_short_is_refused_naming_it_not_as_a_traceback(tmp_path):
    (tmp_path / "in").mkdir()
    lines = "".join(json.dumps({"text": " ".join(np.random.default_rng(i).choice(WORDS, 50))}) + "\n"
                    for i in range(3000))
    (tmp_path / "in" / "cut.jsonl.gz").write_bytes(gzip.compress(lines.encode())[:30_000])
    (tmp_path / "in" / "held-out.txt").write_text("alpha beta gamma " * 50)
    data = data_config(tmp_path / "in" / "cut.jsonl.gz", validation_path=str(tmp_path / "in" / "held-out.txt"),
                       validation_fraction=None)
    with pytest.raises(UserError) as raised:
        text.SOURCE.plan(data, str(tmp_path / "cache")).prepare(None, lambda _: None)
    assert "data.options.path" in str(raised.value) and "cut.jsonl.gz does not decompress" in str(raised.value)
    assert not [p for p in files_under(tmp_path / "cache") if p.suffix == ".parquet" or p.name == "manifest.json"]


# --- a tokenizer that loads but cannot encode -------------------------------------------------------------

def word_level(path: Path, words) -> Path:
    """A tokenizer with no unknown token: a word outside its vocabulary cannot be encoded."""
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(["</s>", *words])}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(path))
    return path


def test_a_tokenizer_that_cannot_encode_the_text_is_refused_when_planning(tmp_path):
    (tmp_path / "in").mkdir()
    for index in range(3):
        (tmp_path / "in" / f"doc{index}.txt").write_text("alpha beta unknown " * 40)
    tokenizer = word_level(tmp_path / "tokenizer.json", ["alpha", "beta"])
    data = data_config(tmp_path / "in", tokenizer={"file": str(tokenizer)})
    with pytest.raises(UserError) as raised:
        text.SOURCE.plan(data, str(tmp_path / "cache"))
    message = str(raised.value)
    # (the first training file: which of the three is the validation split's is a hash's choice)
    assert "data.options.tokenizer" in message and re.search(r"/doc[0-2]\.txt", message) and "[UNK]" in message
    assert not files_under(tmp_path / "cache")  # (before: tokenizer.json written, then a traceback)


def test_a_tokenizer_that_fails_on_a_later_file_is_named_not_a_traceback(tmp_path):
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.txt").write_text("alpha beta " * 40)
    (tmp_path / "in" / "b.txt").write_text("alpha beta " * 40 + "unknown")
    (tmp_path / "held-out.txt").write_text("alpha beta " * 40)
    tokenizer = word_level(tmp_path / "tokenizer.json", ["alpha", "beta"])
    data = data_config(tmp_path / "in", tokenizer={"file": str(tokenizer)}, validation_fraction=None,
                       validation_path=str(tmp_path / "held-out.txt"))
    with pytest.raises(UserError) as raised:
        text.SOURCE.plan(data, str(tmp_path / "cache")).prepare(None, lambda _: None)
    assert str(raised.value).startswith("data.options.tokenizer cannot encode") and "b.txt" in str(raised.value)


# --- the cache folder -----------------------------------------------------------------------------------

def unwritable_caches(tmp_path) -> list[str]:
    (tmp_path / "a-file").write_text("not a folder")
    places = [str(tmp_path / "a-file" / "datasets")]
    if Path("/proc/self").is_dir():
        places.append("/proc/training-datasets")  # (no one, root included, makes a folder there)
    return places


def test_a_cache_dir_that_cannot_be_written_is_refused_naming_data_cache_dir_when_planning_text(tmp_path):
    (tmp_path / "in").mkdir()
    for index in range(3):
        (tmp_path / "in" / f"doc{index}.txt").write_text("alpha beta gamma " * 40)
    for cache in unwritable_caches(tmp_path):
        with pytest.raises(UserError) as raised:
            text.SOURCE.plan(data_config(tmp_path / "in"), cache)
        assert str(raised.value).startswith(f"data.cache_dir: {cache} cannot be written"), str(raised.value)


def test_a_cache_dir_that_cannot_be_written_is_refused_naming_data_cache_dir_when_planning_a_transform(tmp_path):
    table = Path(__file__).resolve().parent / "data" / "spark_digits"
    data = data_section(dict(source="parquet", options={
        "path": str(table), "features": "x", "label": "label", "validation_fraction": 0.25,
        "transform": {"function": "plugins.transforms:scale_pixels"}}))
    for cache in unwritable_caches(tmp_path):
        with pytest.raises(UserError) as raised:
            parquet.SOURCE.plan(data, cache)
        assert str(raised.value).startswith(f"data.cache_dir: {cache} cannot be written"), str(raised.value)


def test_a_cache_dir_still_to_make_under_a_writable_folder_is_accepted_and_left_unmade(tmp_path):
    (tmp_path / "in").mkdir()
    for index in range(3):
        (tmp_path / "in" / f"doc{index}.txt").write_text("alpha beta gamma " * 40)
    text.SOURCE.plan(data_config(tmp_path / "in"), str(tmp_path / "new" / "datasets"))
    assert not (tmp_path / "new").exists() and list(tmp_path.iterdir()) == [tmp_path / "in"]
