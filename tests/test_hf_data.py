"""The `text` source for Hugging Face models: the pretrained folder's own tokenizer
(`tokenizer: {from_model: true}`; its EOS/BOS, its size against the model's embeddings), and
classification tables (`label_column`: one document per row, truncated and padded, labels mapped),
with the shipped bert_classify.yaml's table made from the standard library. Folders are written by
the tests with `save_pretrained`; no Ray."""

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from conftest import CONFIGS
from tokenizers import Tokenizer

from training.config import validate
from training.data import text
from training.data.manifest import Manifest
from training.data.order import BatchPlan
from training.data.tokenizer import CLS, PAD
from training.errors import ConfigError, UserError

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho".split()


def docs(count, seed=0, low=5, high=40):
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=int(rng.integers(low, high)))) for _ in range(count)]


def llama_folder(root, model_vocab=None, config_eos=2):
    """A tiny Llama saved with save_pretrained, and its tokenizer: a byte-level BPE trained here, whose
    encodings start with <s> (as Llama's do), saved as a PreTrainedTokenizerFast."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(docs(200), trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    folder = root / "llama"
    fast.save_pretrained(folder)
    config = LlamaConfig(vocab_size=model_vocab or 320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, bos_token_id=1, eos_token_id=config_eos)
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder, fast


def jsonl(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def job(data_options, model=None, **data):
    model = model or {"name": "gpt", "options": {"n_layer": 1, "n_head": 2, "d_model": 32}}
    return validate({"model": model, "data": {"source": "text", "options": data_options, **data},
                     "train": {"max_steps": 2, "global_batch_size": 4}, "scaling": {"num_workers": 1}})


def hf_pretrained(folder, task="causal_lm"):
    return {"name": "hf", "options": {"pretrained": str(folder), "task": task}}


def prepare(config, cache, log=print):
    return text.SOURCE.plan(config.data, str(cache)).prepare(None, log)


# --- the model's own tokenizer ----------------------------------------------------------------


def test_from_model_packs_documents_with_the_folders_tokenizer_its_bos_and_eos(tmp_path):
    folder, fast = llama_folder(tmp_path)
    texts = docs(12, seed=1)
    jsonl(tmp_path / "in" / "a.jsonl", [{"text": t} for t in texts[:8]])
    jsonl(tmp_path / "in" / "b.jsonl", [{"text": t} for t in texts[8:]])
    config = job({"path": str(tmp_path / "in" / "a.jsonl"), "validation_path": str(tmp_path / "in" / "b.jsonl"),
                  "seq_len": 8, "tokenizer": {"from_model": True}}, hf_pretrained(folder))
    manifest = prepare(config, tmp_path / "cache")
    rows = text.SOURCE.rows(manifest, "train").take(np.arange(manifest.rows("train")))["tokens"]
    stream = np.concatenate([[1, *fast(t, add_special_tokens=False)["input_ids"], 2] for t in texts[:8]])
    assert rows.reshape(-1).tolist() == stream[: rows.size].tolist()  # <s> doc </s>, the model's own ids
    assert fast("alpha")["input_ids"][0] == 1  # (the folder's tokenizer starts encodings with <s>)
    assert manifest.spec["vocab_size"] == 320  # the model's embeddings, not the tokenizer's 300
    assert manifest.origin["tokenizer"] == f"model {folder}" and manifest.origin["bos_id"] == 1


def test_a_tokenizer_larger_than_the_models_embeddings_exits_2_naming_both(tmp_path):
    folder, _ = llama_folder(tmp_path, model_vocab=256)
    for name in ("a", "b"):
        jsonl(tmp_path / "in" / f"{name}.jsonl", [{"text": t} for t in docs(4)])
    config = job({"path": str(tmp_path / "in"), "validation_fraction": 0.5, "seq_len": 8,
                  "tokenizer": {"from_model": True}}, hf_pretrained(folder))
    with pytest.raises(UserError) as error:
        text.SOURCE.plan(config.data, str(tmp_path / "cache"))
    message = str(error.value)
    assert message.startswith("data.options.tokenizer:") and "model.options.pretrained" in message
    assert "300 tokens" in message and "hold 256" in message
    assert not (tmp_path / "cache").exists()


def test_from_model_needs_an_hf_model_from_a_pretrained_folder(tmp_path):
    options = {"path": str(tmp_path), "validation_fraction": 0.5, "tokenizer": {"from_model": True}}
    with pytest.raises(ConfigError, match=r"data.options.tokenizer.from_model: .* model.name is gpt"):
        job(options)
    inline = {"name": "hf", "options": {"config": {"model_type": "llama", "hidden_size": 64}}}
    with pytest.raises(ConfigError, match=r"from_model: model.options.pretrained is not set"):
        job(options, inline)
    section = text.TextData.model_validate({"options": options})  # (the data section alone: not bound)
    with pytest.raises(UserError, match="was not given the job's model section"):
        text.SOURCE.plan(section, str(tmp_path / "cache"))


def test_an_end_token_other_than_the_models_is_refused_unless_named(tmp_path):
    folder, _ = llama_folder(tmp_path, config_eos=0)
    for name in ("a", "b"):
        jsonl(tmp_path / "in" / f"{name}.jsonl", [{"text": t} for t in docs(4)])
    options = {"path": str(tmp_path / "in"), "validation_fraction": 0.5, "seq_len": 8,
               "tokenizer": {"from_model": True}}
    with pytest.raises(UserError, match=r"ends documents with '</s>' \(id 2\), but the model's config.json "
                                        r"eos_token_id is 0: set data.options.eos_token"):
        text.SOURCE.plan(job(options, hf_pretrained(folder)).data, str(tmp_path / "cache"))
    plan = text.SOURCE.plan(job({**options, "eos_token": "<unk>"}, hf_pretrained(folder)).data, str(tmp_path / "c"))
    assert plan.tokenizer.eos_id == 0


def test_a_tokenizer_file_that_truncates_does_not_cut_documents_when_packing(tmp_path):
    """A model's tokenizer.json may carry truncation (BERT's to 512): packing turns it off."""
    _, fast = llama_folder(tmp_path)
    saved = json.loads(fast.backend_tokenizer.to_str())
    saved["truncation"] = {"direction": "Right", "max_length": 4, "strategy": "LongestFirst", "stride": 0}
    (tmp_path / "tokenizer.json").write_text(json.dumps(saved))
    long_doc = " ".join(WORDS * 3)
    jsonl(tmp_path / "in" / "a.jsonl", [{"text": long_doc}] * 2)
    jsonl(tmp_path / "val" / "b.jsonl", [{"text": long_doc}] * 2)
    config = job({"path": str(tmp_path / "in"), "validation_path": str(tmp_path / "val"), "seq_len": 8,
                  "tokenizer": {"file": str(tmp_path / "tokenizer.json")}, "eos_token": "</s>"})
    manifest = prepare(config, tmp_path / "cache")
    whole = len(fast(long_doc, add_special_tokens=False)["input_ids"]) + 1
    assert manifest.rows("train") == (2 * whole) // 9 > 2  # not 2 * 5 tokens cut to one row


# --- classification tables ----------------------------------------------------------------------


def table_files(root, train, validation, fmt="jsonl"):
    for split, rows in (("train", train), ("validation", validation)):
        if fmt == "jsonl":
            jsonl(root / split / "part.jsonl", rows)
        else:
            (root / split).mkdir(parents=True)
            pq.write_table(pa.table({k: [r[k] for r in rows] for k in rows[0]}), root / split / "part.parquet",
                           row_group_size=5)
    return {"path": str(root / "train"), "validation_path": str(root / "validation"), "label_column": "label",
            "seq_len": 12, "tokenizer": {"train": {"vocab_size": 300, "sample_bytes": 10_000}}}


def test_a_classification_table_is_tokenized_truncated_padded_and_labelled(tmp_path):
    texts = docs(40, low=1, high=20)
    labels = ["spam", "ham", "eggs", "ham"] * 10
    options = table_files(tmp_path / "in", [{"text": t, "label": y} for t, y in zip(texts[:30], labels[:30])],
                          [{"text": t, "label": y} for t, y in zip(texts[30:], labels[30:])])
    lines = []
    manifest = prepare(job(options), tmp_path / "cache", log=lines.append)
    assert manifest.task == "sequence_classification"
    assert manifest.spec == {"vocab_size": 300, "num_classes": 3, "seq_len": 12, "pad_id": 1}
    assert manifest.origin["labels"] == ["eggs", "ham", "spam"]  # names in sorted order
    rows = text.SOURCE.rows(manifest, "train").take(np.arange(30))
    assert rows["tokens"].dtype == np.int64 and rows["tokens"].shape == (30, 12)
    assert rows["label"].tolist() == [{"eggs": 0, "ham": 1, "spam": 2}[y] for y in labels[:30]]
    tokenizer = Tokenizer.from_str(open(f"{manifest.root}/tokenizer.json").read())
    lengths = [1 + len(tokenizer.encode(t, add_special_tokens=False).ids) for t in texts[:30]]  # <|cls|> first
    assert rows["attention"].sum(axis=1).tolist() == [min(n, 12) for n in lengths]
    assert (rows["tokens"][:, 0] == tokenizer.token_to_id(CLS)).all()
    assert (rows["tokens"][rows["attention"] == 0] == tokenizer.token_to_id(PAD)).all()
    for row, mask, doc in zip(rows["tokens"], rows["attention"], texts[:30]):
        assert row[mask == 1].tolist() == ([2] + tokenizer.encode(doc, add_special_tokens=False).ids)[:12]
    truncated = sum(n > 12 for n in lengths)
    assert 0 < truncated < 30 and manifest.origin["truncated"]["train"] == truncated
    assert any(f"were longer than seq_len 12 tokens and were truncated ({truncated} train" in line for line in lines)
    shard = text.SOURCE.open(manifest, BatchPlan(4, 1, 0), seed=0).batch(0)
    assert set(shard) == {"tokens", "attention", "label"} and shard["tokens"].shape == (4, 12)


def test_integer_labels_in_parquet_are_class_ids_and_a_tokenizer_files_pad_token_pads(tmp_path):
    from tokenizers import models, pre_tokenizers

    vocab = {"[PAD]": 0, "[UNK]": 1, "[SEP]": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    texts = docs(20, low=1, high=6)
    options = table_files(tmp_path / "in", [{"text": t, "label": i % 4} for i, t in enumerate(texts[:15])],
                          [{"text": t, "label": i % 3} for i, t in enumerate(texts[15:])], fmt="parquet")
    options["tokenizer"] = {"file": str(tmp_path / "tokenizer.json")}
    manifest = prepare(job(options), tmp_path / "cache")
    assert manifest.spec["num_classes"] == 4 and manifest.origin["labels"] is None
    rows = text.SOURCE.rows(manifest, "validation").take(np.arange(5))
    assert rows["label"].tolist() == [0, 1, 2, 0, 1]
    assert (rows["tokens"][rows["attention"] == 0] == 0).all() and manifest.origin["pad_id"] == 0


@pytest.mark.parametrize("train, validation, message", [
    ([{"text": "a", "label": "x"}, {"text": "b", "label": "y"}], [{"text": "c", "label": "z"}],
     r"data.options.label_column: .*validation/part.jsonl line 1: label 'z' in 'label' is not in the train split "
     r"\(2 names: 'x', 'y'\)"),
    ([{"text": "a", "label": 0}, {"text": "b", "label": 1}], [{"text": "c", "label": 2}],
     r"validation/part.jsonl line 1: label 2 in 'label' is not in the train split \(ids 0..1\)"),
    ([{"text": "a", "label": 0.5}, {"text": "b", "label": 1}], [{"text": "c", "label": 1}],
     r"train/part.jsonl line 1: label 0.5 in 'label' is float: labels are integers .* or strings"),
    ([{"text": "a", "label": "x"}, {"text": "b", "label": 1}], [{"text": "c", "label": 1}],
     r"are both integers \(.*line 2\) and strings \(.*line 1\)"),
    ([{"text": "a", "label": -1}, {"text": "b", "label": 1}], [{"text": "c", "label": 1}],
     r"label -1 in 'label' is negative"),
    ([{"text": "a", "label": "x"}, {"text": "b", "label": "x"}], [{"text": "c", "label": "x"}],
     r"the train split holds one class \('x'\)"),
    ([{"text": "a", "label": "x"}, {"text": "b"}], [{"text": "c", "label": "x"}],
     r"data.options.path: .*train/part.jsonl line 2: no 'label' field"),
])
def test_bad_labels_exit_2_naming_the_option_the_file_and_the_row(tmp_path, train, validation, message):
    options = table_files(tmp_path / "in", train * 3, validation)
    options["tokenizer"] = {"train": {"vocab_size": 270, "sample_bytes": 10_000}}
    with pytest.raises(UserError, match=message):
        prepare(job(options), tmp_path / "cache")
    assert not list((tmp_path / "cache").glob("*/manifest.json"))


def test_a_label_column_on_text_files_or_a_missing_column_is_refused_when_planning(tmp_path):
    (tmp_path / "txt").mkdir()
    for name in ("a.txt", "b.txt"):
        (tmp_path / "txt" / name).write_text("some words")
    options = {"path": str(tmp_path / "txt"), "validation_fraction": 0.5, "label_column": "label",
               "tokenizer": {"train": {"vocab_size": 270}}}
    with pytest.raises(UserError, match=r"data.options.label_column: .*\.txt is a text file"):
        text.SOURCE.plan(job(options).data, str(tmp_path / "cache"))
    options = table_files(tmp_path / "pq", [{"text": "a", "kind": 1}] * 5, [{"text": "b", "kind": 1}] * 5, "parquet")
    with pytest.raises(UserError, match=r"has no column 'label' .*set data.options.label_column"):
        text.SOURCE.plan(job(options).data, str(tmp_path / "cache"))


# --- the shipped example -----------------------------------------------------------------------


def test_bert_classify_yaml_validates_and_its_stdlib_table_beats_the_majority_class(tmp_path):
    """The table comes from the running Python (nothing downloaded), the same bytes each time, every
    class in train and validation; a bag-of-tokens linear model on the prepared rows beats always
    answering the most frequent class by far (the signal the encoder learns)."""
    from sklearn.linear_model import LogisticRegression

    raw = yaml.safe_load((CONFIGS / "bert_classify.yaml").read_text())
    config = validate(raw)
    assert config.model.name == "hf" and config.model.options.task == "sequence_classification"
    manifest = prepare(config, tmp_path / "a")
    again = prepare(config, tmp_path / "b", log=lambda _: None)
    assert manifest.digest == again.digest and manifest.spec == again.spec
    assert manifest.spec["num_classes"] == 6 and manifest.rows("train") > 1000 and manifest.rows("validation") > 300
    counts = np.array(manifest.origin["train_label_counts"])
    assert counts.min() > 0.3 * counts.max()

    def bag(split):
        rows = text.SOURCE.rows(Manifest.load(manifest.root), split)
        rows = rows.take(np.arange(rows.num_rows))
        x = np.zeros((len(rows["label"]), manifest.spec["vocab_size"]))
        for i, (ids, mask) in enumerate(zip(rows["tokens"], rows["attention"])):
            np.add.at(x[i], ids[mask == 1], 1)
        return x, rows["label"]

    (x, y), (xv, yv) = bag("train"), bag("validation")
    majority = (yv == np.bincount(y).argmax()).mean()
    accuracy = (LogisticRegression(max_iter=2000).fit(x, y).predict(xv) == yv).mean()
    assert majority < 0.3 and accuracy > majority + 0.2, (majority, accuracy)
