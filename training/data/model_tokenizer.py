"""Runs in the driver: the tokenizer of a Hugging Face model folder, for the `text` source's
`tokenizer: {from_model: true}` (with `model.name: hf` and `model.options.pretrained`). Read from
the folder's own small files, never its weights: tokenizer.json (a fast tokenizer's file), the
special tokens of tokenizer_config.json (or special_tokens_map.json), and the embedding size
(`vocab_size`) and `eos_token_id` of config.json. A local folder or any URI pyarrow opens (s3://)
is read in place.

The ids must fit the model: a tokenizer with more tokens than the model has embeddings would index
past them (a crash on a GPU, garbage on some CPUs), and a document separator other than the
model's end token would teach it another one; both exit 2 here, before anything is written.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Optional

from tokenizers import Tokenizer

from training import storage
from training.errors import UserError, first_line

OPTION = "data.options.tokenizer.from_model"
TOKENIZER_FILE = "tokenizer.json"
SPECIAL_FILES = ("tokenizer_config.json", "special_tokens_map.json")  # (the first that names a token wins)


@dataclass(frozen=True)
class ModelTokenizer:
    folder: str
    tokenizer_json: str
    eos_token: str
    eos_id: int
    # Put before each document when the model's own tokenizer starts its encodings with it (Llama's
    # <s>); None otherwise (GPT-2, Qwen: no BOS).
    bos_id: Optional[int]
    pad_token: Optional[str]
    model_vocab_size: int  # config.json's vocab_size: the embedding rows, every id below it


def _read_json(folder: str, name: str, required: bool) -> Optional[dict]:
    uri = storage.join(folder, name)
    try:
        if not storage.exists(uri):
            if required:
                raise UserError(f"{OPTION}: model.options.pretrained {folder} has no {name}"
                                + (" (a fast tokenizer's file, which save_pretrained writes); give "
                                   "data.options.tokenizer.file instead" if name == TOKENIZER_FILE else ""))
            return None
        text = storage.read_text(uri)
    except OSError as exc:
        raise UserError(f"{OPTION}: model.options.pretrained {folder}: {name} cannot be read: {first_line(exc)}") \
            from None
    if name == TOKENIZER_FILE:
        return {"text": text}
    try:
        body = json.loads(text)
    except ValueError as exc:
        raise UserError(f"{OPTION}: model.options.pretrained {folder}: {name} is not JSON ({exc})") from None
    if not isinstance(body, dict):
        raise UserError(f"{OPTION}: model.options.pretrained {folder}: {name} is not a JSON object")
    return body


def _token(value) -> Optional[str]:
    """A special token as the files write it: a string, or {"content": ...} (an AddedToken)."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def special_tokens(folder: str) -> dict[str, str]:
    """eos/bos/pad tokens the folder's tokenizer files name."""
    found: dict[str, str] = {}
    for name in SPECIAL_FILES:
        body = _read_json(folder, name, required=False) or {}
        for kind in ("eos", "bos", "pad"):
            token = _token(body.get(f"{kind}_token"))
            if token is not None:
                found.setdefault(kind, token)
    return found


def embedding_size(config: dict) -> Optional[int]:
    """config.json's vocab_size (a multimodal model's text model's, under text_config)."""
    for body in (config, config.get("text_config") or {}):
        if isinstance(body, dict) and isinstance(body.get("vocab_size"), int):
            return body["vocab_size"]
    return None


def read_model_tokenizer(folder: str, eos_token: Optional[str] = None) -> ModelTokenizer:
    """The folder's tokenizer, checked against its model (UserError naming the options and numbers).
    `eos_token` (data.options.eos_token) overrides the folder's end token."""
    content = _read_json(folder, TOKENIZER_FILE, required=True)["text"]
    try:
        tokenizer = Tokenizer.from_str(content)
    except Exception as exc:  # (tokenizers raises a bare Exception)
        raise UserError(f"{OPTION}: {storage.join(folder, TOKENIZER_FILE)} does not load as a Hugging Face "
                        f"tokenizers file: {first_line(exc)}") from None
    config = _read_json(folder, "config.json", required=True)
    model_vocab = embedding_size(config)
    if model_vocab is None:
        raise UserError(f"model.options.pretrained: {folder}/config.json has no vocab_size (the embedding rows the "
                        "tokenizer's ids index)")
    tokens = tokenizer.get_vocab_size(with_added_tokens=True)
    top = max(tokenizer.get_vocab(with_added_tokens=True).values(), default=-1)
    if max(tokens, top + 1) > model_vocab:
        raise UserError(f"data.options.tokenizer: the tokenizer of model.options.pretrained {folder} has "
                        f"{max(tokens, top + 1)} tokens, but the model's embeddings (config.json vocab_size) hold "
                        f"{model_vocab}: ids {model_vocab} and up would index past them; the folder's tokenizer and "
                        "model do not belong together")
    specials = special_tokens(folder)
    eos = eos_token or specials.get("eos")
    if eos is None:
        raise UserError(f"{OPTION}: model.options.pretrained {folder} names no eos_token (tokenizer_config.json): "
                        "set data.options.eos_token to the token that ends a document")
    eos_id = tokenizer.token_to_id(eos)
    if eos_id is None:
        option = "data.options.eos_token" if eos_token else OPTION
        raise UserError(f"{option}: {eos!r} is not a token of the tokenizer of model.options.pretrained {folder}")
    model_eos = config.get("eos_token_id")
    model_eos = [model_eos] if isinstance(model_eos, int) else model_eos
    if not eos_token and isinstance(model_eos, list) and model_eos and eos_id not in model_eos:
        raise UserError(f"{OPTION}: the tokenizer of model.options.pretrained {folder} ends documents with {eos!r} "
                        f"(id {eos_id}), but the model's config.json eos_token_id is {config.get('eos_token_id')}: "
                        "set data.options.eos_token to the token the model ends a document with")
    bos_id = tokenizer.token_to_id(specials["bos"]) if "bos" in specials else None
    if bos_id is not None and (bos_id == eos_id or tokenizer.encode("a").ids[:1] != [bos_id]):
        bos_id = None  # (the model's own encoding does not start with it)
    return ModelTokenizer(folder, content, eos, eos_id, bos_id, specials.get("pad"), model_vocab)
