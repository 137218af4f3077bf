"""Runs in the driver: the `text` source's tokenizer. A Hugging Face `tokenizers` file the user
gives, the pretrained model's own (training/data/model_tokenizer.py), or a byte-level BPE trained on
a deterministic sample of the training files; each is saved beside the tokenized data as
tokenizer.json and logged to the run in MLflow."""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from typing import Callable, Optional

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from training import storage, topics
from training.data.files import DataFile
from training.data.model_tokenizer import read_model_tokenizer
from training.data.text_read import documents, format_of
from training.data.tokenize import encode
from training.errors import DataError, UserError, first_line

EOS = "<|endoftext|>"  # the end-of-document token of a tokenizer trained here (id 0)
# A tokenizer trained here for a classification table also has these (ids 1 and 2): rows are padded
# with PAD, and begin with CLS, the position a BERT-style encoder classifies from.
PAD, CLS = "<|pad|>", "<|cls|>"
# A tokenizer file's padding token, when pad_token is not given: the first it has of these, else its EOS.
PAD_CANDIDATES = ("[PAD]", "<pad>", PAD, "<|finetune_right_pad_id|>")
# A tokenizer file's end-of-document token, when eos_token is not given: the first of these it has.
EOS_CANDIDATES = (EOS, "</s>", "<eos>", "<|end_of_text|>", "[SEP]")
TOKENIZER_FILE = "tokenizer.json"


def hash_rank(files: list[DataFile]) -> list[DataFile]:
    """Files in a deterministic order that does not depend on how they were listed."""
    return sorted(files, key=lambda f: hashlib.sha256(f.uri.encode()).hexdigest())


# Text of the first training file the tokenizer is tried on when planning.
CHECK_BYTES = 64 << 10


@dataclass(frozen=True)
class ChosenTokenizer:
    """The tokenizer a plan tokenizes with, as far as it is known before preparing."""

    json: Optional[str]  # the file's content (None: trained during preparation)
    eos_id: int
    bos_id: Optional[int] = None  # put before each document (a model's own, see model_tokenizer)
    pad_id: Optional[int] = None  # rows of a classification table are padded with it
    model_vocab_size: Optional[int] = None  # the model's embedding rows (from_model): the data's vocab_size
    origin: str = "trained"  # what the manifest records


def load_tokenizer(options, first: Optional[DataFile] = None, model_folder: Optional[str] = None) -> ChosenTokenizer:
    """The plan's tokenizer. UserError naming the option if it fails, or if the tokenizer cannot
    encode the start of `first` (a training file). `model_folder`: model.options.pretrained, for
    tokenizer.from_model."""
    if options.tokenizer.from_model:
        model = read_model_tokenizer(model_folder, options.eos_token)
        tokenizer = Tokenizer.from_str(model.tokenizer_json)
        if first is not None:
            check_encodes(tokenizer, first, options, f"the tokenizer of model.options.pretrained {model_folder}")
        pad = options.pad_token or model.pad_token
        pad_id = model.eos_id if pad is None else _token_id(tokenizer, pad, "data.options.pad_token", model_folder)
        return ChosenTokenizer(model.tokenizer_json, model.eos_id, model.bos_id, pad_id, model.model_vocab_size,
                               f"model {model_folder}")
    if options.tokenizer.file is None:
        # trained here: EOS is its first special token (byte-level: it encodes any text), PAD its second
        return ChosenTokenizer(None, 0, pad_id=1 if options.label_column else None)

    where = options.tokenizer.file
    try:
        content = storage.read_text(where)
        tokenizer = Tokenizer.from_str(content)
    except Exception as exc:
        raise UserError(f"data.options.tokenizer.file: {where} does not load as a Hugging Face tokenizers "
                        f"file: {first_line(exc)}") from None
    names = [options.eos_token] if options.eos_token else EOS_CANDIDATES
    for name in names:
        token = tokenizer.token_to_id(name)
        if token is not None:
            if first is not None:
                check_encodes(tokenizer, first, options, f"data.options.tokenizer.file is {where}")
            pads = [options.pad_token] if options.pad_token else PAD_CANDIDATES
            pad_id = next((tokenizer.token_to_id(p) for p in pads if tokenizer.token_to_id(p) is not None), None)
            if pad_id is None and options.pad_token:
                _token_id(tokenizer, options.pad_token, "data.options.pad_token", where)
            return ChosenTokenizer(content, token, pad_id=token if pad_id is None else pad_id, origin=where)
    option = "data.options.eos_token" if options.eos_token else "data.options.tokenizer.file"
    raise UserError(f"{option}: {where} has no end-of-document token {' or '.join(map(repr, names))}"
                    + ("" if options.eos_token else "; set data.options.eos_token to the one it has"))


def _token_id(tokenizer, token: str, option: str, where: str) -> int:
    found = tokenizer.token_to_id(token)
    if found is None:
        raise UserError(f"{option}: {token!r} is not a token of the tokenizer of {where}")
    return found


def check_encodes(tokenizer, first: DataFile, options, named: str) -> None:
    """A tokenizer that loads may still fail on text (a model with no unknown token whose vocabulary
    lacks a character): tried on the start of the first training file, before anything is written."""
    batch = next(iter(documents(first.uri, format_of(first.uri, options.format), options.text_column,
                                limit_bytes=CHECK_BYTES)), None)
    if batch is None:
        return
    try:
        encode(tokenizer, batch, 0, first.uri)
    except DataError as exc:
        raise UserError(f"{exc}; {named}") from None


def sample_documents(files: list[DataFile], options, sample_bytes: int):
    """A deterministic sample: files by a hash of their path, an equal share of the budget from each
    (at least 4 KiB), until the budget is spent."""
    share, total = max(sample_bytes // max(len(files), 1), 4096), 0
    for file in hash_rank(files):
        taken = 0
        for batch in documents(file.uri, format_of(file.uri, options.format), options.text_column, limit_bytes=share):
            for doc in batch.texts:  # (a long document's pieces: cut between pre-tokenizer words)
                doc = doc[: share - taken]
                taken += len(doc)
                yield doc
                if taken >= share:
                    break
            if taken >= share:
                break
        total += taken
        if total >= sample_bytes:
            return


def train_tokenizer(files: list[DataFile], options):
    """A byte-level BPE (every byte has a token: any text encodes, and decodes back exactly)."""

    training = options.tokenizer.train
    classify = options.label_column is not None
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=training.vocab_size, special_tokens=[EOS, PAD, CLS] if classify else [EOS],
                                  show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(sample_documents(files, options, training.sample_bytes), trainer=trainer)
    assert tokenizer.token_to_id(EOS) == 0
    if classify:
        assert (tokenizer.token_to_id(PAD), tokenizer.token_to_id(CLS)) == (1, 2)
        tokenizer.post_processor = processors.TemplateProcessing(single=f"{CLS} $A", special_tokens=[(CLS, 2)])
    return tokenizer


def write_atomically(uri: str, text: str) -> None:
    fs, path = storage.filesystem(uri)
    parent, name = path.rsplit("/", 1)
    fs.create_dir(parent, recursive=True)
    storage.write_text(storage.join(uri.rsplit("/", 1)[0], f".{name}.tmp"), text)
    fs.move(f"{parent}/.{name}.tmp", path)


def tokenizer_of(text_plan, log: Callable[[str], None]):
    """The plan's tokenizer, saved as tokenizer.json in the dataset (trained once: a resumed
    preparation loads the one it trained)."""

    saved = storage.join(text_plan.root, TOKENIZER_FILE)
    if text_plan.tokenizer.json is not None:
        if not storage.exists(saved):
            write_atomically(saved, text_plan.tokenizer.json)
        return Tokenizer.from_str(text_plan.tokenizer.json)
    if storage.exists(saved):
        return Tokenizer.from_str(storage.read_text(saved))
    started = time.monotonic()
    try:
        tokenizer = train_tokenizer(text_plan.inputs["train"], text_plan.options)
    except DataError as exc:  # (a bad jsonl line in the sample)
        raise UserError(f"data.options.path: {exc}") from None
    write_atomically(saved, tokenizer.to_str())
    log(f"data: trained a byte-level BPE of {tokenizer.get_vocab_size()} tokens on a sample of up to "
        f"{text_plan.options.tokenizer.train.sample_bytes} bytes in {time.monotonic() - started:.1f} s")
    return tokenizer


def log_tokenizer(tracker, manifest, log: Callable[[str], None]) -> None:
    """The tokenizer as the MLflow artifact tokenizer/tokenizer.json (a failure is a warning)."""
    try:
        tracker.client.log_text(tracker.run_id, storage.read_text(storage.join(manifest.root, TOKENIZER_FILE)),
                                f"tokenizer/{TOKENIZER_FILE}")
    except Exception as exc:
        log(topics.line(topics.TRACKING, f"the tokenizer was not logged to MLflow: {first_line(exc, 200)}"))
