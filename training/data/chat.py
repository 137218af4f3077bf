"""Runs in the driver: chat and instruction data for the `text` source (`format: chat`). Each
conversation (training/data/chat_read.py) is rendered with a chat template, the tokenizer's own or
one the config gives (`chat.template`), by transformers' `apply_chat_template`, whose assistant mask
marks the tokens between the template's {% generation %} and {% endgeneration %}: by default the loss
learns those alone (`train_on: assistant`), or every token (`all`). A conversation longer than
seq_len is truncated or dropped (`too_long`), counted and logged. The samples are laid out in rows of
seq_len, packed several to a row or one a row (training/data/packing.py), and written as Parquet
shards of the `packed_language_model` task (tokens, labels, positions), read like the built-in
tables (training/data/shards.py). Every conversation is held as token ids until written: meant for
up to a few million of them.

The tokenizers this project trains, and a tokenizer.json alone, have no chat template: DEFAULT_TEMPLATE
(`chat.template: default`) is one to use or copy.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Callable, Literal, Optional

import jinja2  # (transformers' own dependency: its chat templates)
import numpy as np
import pyarrow as pa
from pydantic import Field

from training import storage
from training.data.chat_read import conversations
from training.data.manifest import SPLITS, Manifest, cached
from training.data.packing import Rows, lay_out
from training.data.shards import shards_digest, write_shards
from training.data.source import DataCheck
from training.data.tokenize import packing
from training.data.tokenizer import tokenizer_of, write_atomically
from training.errors import DataError, UserError, first_line
from training.schema import Section
from training.tasks import PACKED_LANGUAGE_MODEL

DEFAULT = "default"
# Plain-text turn markers (any tokenizer encodes them); the assistant's text and the end token
# after it inside {% generation %}, so that the model learns to answer and to stop.
DEFAULT_TEMPLATE = (
    "{{- bos_token if bos_token else '' }}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' %}"
    "{{- '<|assistant|>\\n' }}{% generation %}{{ message['content'] + eos_token }}{% endgeneration %}{{ '\\n' }}"
    "{%- else %}"
    "{{- '<|' + message['role'] + '|>\\n' + message['content'] + '\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)
TEMPLATE_FILE = "chat_template.jinja"  # (beside tokenizer.json: in the prepared data, and save_pretrained's name)
_GENERATION = re.compile(r"{%-?\s*generation\s*-?%}")


class ChatOptions(Section):
    # A Jinja chat template (with {% generation %} markers around what the assistant says, for
    # train_on: assistant), or `default` (DEFAULT_TEMPLATE). None: the tokenizer's own (tokenizer.from_model:
    # the folder's chat_template.jinja or tokenizer_config.json chat_template).
    template: Optional[str] = None
    # What the loss learns: the assistant's turns (the template's {% generation %} spans), or every token.
    train_on: Literal["assistant", "all"] = "assistant"
    # A conversation longer than seq_len tokens: its first seq_len kept, or left out.
    too_long: Literal["truncate", "drop"] = "truncate"
    # Several conversations per row (each attends only to itself), or one per row, padded.
    packing: bool = True
    # The field (JSON Lines) or column (Parquet: a list of structs) of each row's messages; a row
    # without it may have `prompt` and `completion` instead.
    messages_column: str = Field("messages", min_length=1)


def check_options(options) -> None:
    """ValueError for text options that `format: chat` does not take."""
    if options.label_column is not None:
        raise ValueError("format: chat is language data; a classification table (label_column) is another format")
    if options.tokenize_on == "cluster":
        raise ValueError("tokenize_on: cluster is for plain text; chat data is rendered in this process")
    if options.tokenizer.train is not None:
        raise ValueError("format: chat fine-tunes a model with the tokenizer it was trained with: give "
                         "tokenizer.from_model: true or tokenizer.file, not train")


def folder_template(folder: str) -> Optional[str]:
    """A pretrained folder's chat template: chat_template.jinja, else tokenizer_config.json's
    chat_template (a string, or a list of {name, template}: the one named default)."""
    uri = storage.join(folder, TEMPLATE_FILE)
    if storage.exists(uri):
        return storage.read_text(uri)
    config_uri = storage.join(folder, "tokenizer_config.json")
    if not storage.exists(config_uri):
        return None
    try:
        found = json.loads(storage.read_text(config_uri)).get("chat_template")
    except (ValueError, AttributeError):
        return None
    if isinstance(found, list):
        found = next((t.get("template") for t in found if isinstance(t, dict) and t.get("name") == DEFAULT), None)
    return found if isinstance(found, str) and found else None


def template_of(options, model_folder: Optional[str]) -> tuple[str, str]:
    """(template, where it comes from); UserError if there is none, or if train_on: assistant and it
    marks no assistant span."""
    chat = options.chat or ChatOptions()
    if chat.template == DEFAULT:
        template, where = DEFAULT_TEMPLATE, "data.options.chat.template (default)"
    elif chat.template is not None:
        template, where = chat.template, "data.options.chat.template"
    else:
        template = folder_template(model_folder) if options.tokenizer.from_model else None
        where = f"the chat template of model.options.pretrained {model_folder}"
        if template is None:
            tokenizer = (f"model.options.pretrained {model_folder}" if options.tokenizer.from_model
                         else f"data.options.tokenizer.file {options.tokenizer.file}")
            raise UserError(f"data.options.chat.template: the tokenizer of {tokenizer} has no chat template; give "
                            "one (a Jinja template with {% generation %} around the assistant's text), or `default` "
                            "(training/data/chat.py DEFAULT_TEMPLATE)")
    if chat.train_on == "assistant" and not _GENERATION.search(template):
        raise UserError(f"data.options.chat.train_on: assistant, but {where} marks no assistant span (it has no "
                        "{% generation %} ... {% endgeneration %}); give data.options.chat.template with them "
                        "(e.g. default), or set train_on: all")
    return template, where


class Renderer:
    """Conversations to (ids, learn mask) with a template, through transformers' tokenizer."""

    def __init__(self, tokenizer_json: str, chosen, template: str, where: str, chat: ChatOptions):
        from transformers import PreTrainedTokenizerFast  # (lazy: transformers, seconds to import)

        base = packing(tokenizer_json)
        name = base.id_to_token
        specials = {"eos_token": name(chosen.eos_id)}
        if chosen.bos_id is not None:
            specials["bos_token"] = name(chosen.bos_id)
        if chosen.pad_id is not None:
            specials["pad_token"] = name(chosen.pad_id)
        self.tokenizer = PreTrainedTokenizerFast(tokenizer_object=base, **specials)
        self.template, self.where, self.chat = template, where, chat

    def render(self, messages: list[dict], at: str) -> tuple[np.ndarray, np.ndarray]:
        try:
            out = self.tokenizer.apply_chat_template(messages, chat_template=self.template, tokenize=True,
                                                     return_dict=True,
                                                     return_assistant_tokens_mask=self.chat.train_on == "assistant")
        except (jinja2.TemplateError, TypeError, ValueError, KeyError) as exc:
            raise DataError(f"{self.where} does not render the conversation of {at}: {type(exc).__name__}: "
                            f"{first_line(exc, 200)}") from None
        ids = np.asarray(out["input_ids"], dtype=np.int32)
        if self.chat.train_on == "all":
            return ids, np.ones(len(ids), dtype=np.int8)
        learn = np.asarray(out["assistant_masks"], dtype=np.int8)
        if not learn.any():
            raise DataError(f"data.options.chat.train_on: assistant, but {self.where} marks no assistant token in "
                            f"the conversation of {at} (nothing inside its {{% generation %}} markers)")
        return ids, learn


def check_first(inputs: dict, options, renderer: Renderer) -> None:
    """Each file's first conversation read and rendered (UserError naming the option, file and row)."""
    chat = options.chat or ChatOptions()
    for split, files in inputs.items():
        option = "validation_path" if split == "validation" and options.validation_path is not None else "path"
        for file in files:
            try:
                for messages, where in conversations(file.uri, chat.messages_column, chat.train_on == "assistant",
                                                     limit=1):
                    renderer.render(messages, where)
            except DataError as exc:
                raise UserError(_named(str(exc), option)) from None


def _named(message: str, option: str) -> str:
    return message if message.startswith("data.options.") or message.startswith("the chat template") \
        else f"data.options.{option}: {message}"


def read_samples(files, chat: ChatOptions, seq_len: int, renderer: Renderer, counts: dict) -> list:
    samples = []
    for file in files:
        for messages, where in conversations(file.uri, chat.messages_column, chat.train_on == "assistant"):
            ids, learn = renderer.render(messages, where)
            counts["conversations"] += 1
            if len(ids) > seq_len:
                counts["too_long"] += 1
                if chat.too_long == "drop" or not learn[1:seq_len].any():  # (truncated: nothing left to learn)
                    counts["dropped"] += 1
                    continue
                ids, learn = ids[:seq_len], learn[:seq_len]
            counts["tokens"] += len(ids)
            counts["learnt_tokens"] += int(learn[1:].sum())
            samples.append((ids, learn))
    return samples


def table(rows: Rows) -> pa.Table:
    width = rows.tokens.shape[1]
    return pa.table({name: pa.FixedSizeListArray.from_arrays(pa.array(getattr(rows, name).reshape(-1)), width)
                     for name in ("tokens", "labels", "positions")})


def prepare_chat(plan, check: Optional[DataCheck], log: Callable[[str], None]) -> Manifest:
    """The manifest of chat data (cached by the plan's key)."""
    options, chat = plan.options, plan.options.chat or ChatOptions()
    seq_len = options.seq_len
    manifest = cached(plan.root, check, log, f"chat data in rows of {seq_len} tokens ready")
    if manifest is not None:
        return manifest
    tokenizer = tokenizer_of(plan, log)
    template, where = plan.chat_template
    renderer = Renderer(tokenizer.to_str(), plan.tokenizer, template, where, chat)
    pad_id = plan.tokenizer.eos_id if plan.tokenizer.pad_id is None else plan.tokenizer.pad_id
    rows, counts = {}, {}
    for name in SPLITS:
        counts[name] = dict.fromkeys(("conversations", "too_long", "dropped", "tokens", "learnt_tokens"), 0)
        try:
            samples = read_samples(plan.inputs[name], chat, seq_len, renderer, counts[name])
        except DataError as exc:
            raise UserError(_named(str(exc), plan.files_option(name))) from None
        if not samples:
            raise UserError(f"data.options.{plan.files_option(name)}: the {name} split holds no conversation"
                            + (" shorter than seq_len (data.options.chat.too_long: drop)" if counts[name]["dropped"]
                               else ""))
        rows[name] = lay_out(samples, seq_len, pad_id, chat.packing)
        counts[name]["rows"] = rows[name].count
    vocab = plan.tokenizer.model_vocab_size or tokenizer.get_vocab_size()
    spec = {"vocab_size": vocab, "seq_len": seq_len}
    if check is not None:
        check(PACKED_LANGUAGE_MODEL.name, spec, {name: rows[name].count for name in SPLITS})
    tables = {name: table(rows[name]) for name in SPLITS}
    written = write_shards(tables, plan.root, plan.num_shards)
    write_atomically(storage.join(plan.root, TEMPLATE_FILE), template)
    manifest = Manifest(root=plan.root, source="text", options=options.model_dump(mode="json"),
                        task=PACKED_LANGUAGE_MODEL.name, spec=spec, splits=written,
                        schema=tables["train"].schema.to_string(), digest=shards_digest(written), origin={
                            "path": options.path, "validation_path": options.validation_path,
                            "tokenizer": plan.tokenizer.origin, "eos_id": plan.tokenizer.eos_id,
                            "bos_id": plan.tokenizer.bos_id, "pad_id": pad_id, "chat": counts,
                            "chat_template": hashlib.sha256(template.encode()).hexdigest()})
    manifest.write()
    log_counts(counts, seq_len, chat, log)
    log(f"data: chat data prepared at {plan.root} ({rows['train'].count} train, {rows['validation'].count} "
        f"validation rows of {seq_len} tokens; vocabulary {vocab})")
    return manifest


def log_counts(counts: dict, seq_len: int, chat: ChatOptions, log: Callable[[str], None]) -> None:
    for name, c in counts.items():
        fill = c["tokens"] / max(c["rows"] * seq_len, 1)
        log(f"data: {name}: {c['conversations']} conversations, {c['tokens']} tokens ({c['learnt_tokens']} learnt, "
            f"train_on {chat.train_on}) in {c['rows']} rows ({'packed' if chat.packing else 'one a row'}, "
            f"{fill:.0%} of the rows' tokens); {c['too_long']} longer than seq_len {seq_len}: "
            f"{c['too_long'] - c['dropped']} truncated, {c['dropped']} dropped")
