"""Chat and instruction data (`format: chat` of the `text` source) and packing: the label mask covers
exactly the assistant's spans of a rendered chat; a packed row's loss and logits equal its samples'
run alone (a tiny transformers Llama, fp32); the prepared rows' global batches and data digest do
not depend on the world size; bad input is refused naming the option, the file and the row; the
standard library's chat set. No Ray, except the last test: a few steps of a packed chat run whose
validation metrics are over the assistant's tokens alone."""

import json
import math
import types

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from training.config import validate
from training.data import chat, stdlib_chat, text
from training.data.chat_read import conversations
from training.data.order import DIGEST_MODULUS, BatchPlan, batch_digest
from training.data.packing import IGNORE, lay_out
from training.data.shards import SplitReader, TrainShard
from training.data.tokenizer import ChosenTokenizer
from training.errors import ConfigError, UserError
from training.models.hf import FAMILY
from training.models.hf_forward import packed_causal_lm_forward
from training.tasks import PACKED_LANGUAGE_MODEL

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho".split()
LLAMA = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256}


def sentence(rng, low=2, high=7):
    return " ".join(rng.choice(WORDS, size=int(rng.integers(low, high))))


def chats(count, seed=0):
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(count):
        messages = [{"role": "system", "content": "answer briefly"}] if i % 3 == 0 else []
        for _ in range(1 + i % 2):
            messages += [{"role": "user", "content": sentence(rng)}, {"role": "assistant", "content": sentence(rng)}]
        rows.append({"messages": messages} if i % 4 else {"prompt": sentence(rng), "completion": sentence(rng)})
    return rows


def tokenizer_file(tmp_path):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([" ".join(WORDS)] * 20, trainer=trainer)
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    return path


def jsonl(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def options(tmp_path, **chat_options):
    return {"path": str(tmp_path / "train"), "validation_path": str(tmp_path / "validation"), "format": "chat",
            "seq_len": 128, "tokenizer": {"file": str(tokenizer_file(tmp_path))},
            "chat": {"template": "default", **chat_options}}


def job(data_options, model=None):
    model = model or {"name": "hf", "options": {"config": LLAMA}}
    return validate({"model": model, "data": {"source": "text", "options": data_options},
                     "train": {"max_steps": 2, "global_batch_size": 4}, "scaling": {"num_workers": 1}})


def prepare(config, cache):
    return text.SOURCE.plan(config.data, str(cache)).prepare(None, lambda line: None)


def write_chats(tmp_path, train=40, validation=8):
    jsonl(tmp_path / "train" / "a.jsonl", chats(train))
    jsonl(tmp_path / "validation" / "v.jsonl", chats(validation, seed=1))


# --- the label mask ---------------------------------------------------------------------------


def test_the_label_mask_covers_exactly_the_assistant_spans_of_a_rendered_chat(tmp_path):
    tok = Tokenizer.from_file(str(tokenizer_file(tmp_path)))
    chosen = ChosenTokenizer(tok.to_str(), tok.token_to_id("<|endoftext|>"))
    renderer = chat.Renderer(tok.to_str(), chosen, chat.DEFAULT_TEMPLATE, "default", chat.ChatOptions())
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "alpha beta"},
                {"role": "assistant", "content": "gamma delta"}, {"role": "user", "content": "eta"},
                {"role": "assistant", "content": "theta iota kappa"}]
    ids, learn = renderer.render(messages, "here")
    # the learnt tokens, span by span, are each assistant turn and its end token, and nothing else
    spans, start = [], None
    for i, flag in enumerate([*learn.tolist(), 0]):
        if flag and start is None:
            start = i
        if not flag and start is not None:
            spans.append(tok.decode(ids[start:i].tolist(), skip_special_tokens=False))
            start = None
    assert spans == ["gamma delta<|endoftext|>", "theta iota kappa<|endoftext|>"]
    rest = tok.decode([t for t, flag in zip(ids.tolist(), learn.tolist()) if not flag], skip_special_tokens=False)
    assert rest == "<|system|>\nbe brief\n<|user|>\nalpha beta\n<|assistant|>\n\n<|user|>\neta\n<|assistant|>\n\n"
    # as labels: position i learns token i + 1 exactly where the mask marks that token
    rows = lay_out([(ids, learn)], 128, 0, pack=True)
    labels = rows.labels[0, :len(ids)]
    assert [int(t) for t in labels if t != IGNORE] == [int(t) for t, f in zip(ids[1:], learn[1:]) if f]
    everything = chat.Renderer(tok.to_str(), chosen, chat.DEFAULT_TEMPLATE, "default",
                               chat.ChatOptions(train_on="all")).render(messages, "here")
    assert np.array_equal(everything[0], ids) and everything[1].all()


def test_prepared_chat_rows_hold_the_assistant_turns_as_labels_packed_with_restarting_positions(tmp_path):
    write_chats(tmp_path)
    manifest = prepare(job(options(tmp_path)), tmp_path / "cache")
    assert manifest.task == PACKED_LANGUAGE_MODEL.name and manifest.spec["seq_len"] == 128
    counts = manifest.origin["chat"]["train"]
    assert counts["conversations"] == 40 and counts["too_long"] == 0
    assert manifest.rows("train") < 40  # several conversations to a row
    rows = SplitReader(manifest, "train").take(np.arange(manifest.rows("train")))
    tok = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    starts = rows["positions"] == 0
    # every sample starts at position 0 and counts up by one; a label never crosses into the next sample
    assert np.all(np.where(starts[:, 1:], True, rows["positions"][:, 1:] == rows["positions"][:, :-1] + 1))
    assert np.all(rows["labels"][:, :-1][starts[:, 1:]] == IGNORE)
    learnt = rows["labels"][rows["labels"] != IGNORE]
    assert len(learnt) == counts["learnt_tokens"]
    # the learnt text is the assistant turns, each with its end token
    expected = []
    for row in chats(40):
        turns = row.get("messages") or [{"role": "assistant", "content": row["completion"]}]
        expected += [m["content"] + "<|endoftext|>" for m in turns if m["role"] == "assistant"]
    decoded = tok.decode(learnt.tolist(), skip_special_tokens=False)
    assert sorted(decoded.split("<|endoftext|>")[:-1]) == sorted(e[:-len("<|endoftext|>")] for e in expected)


# --- packing in the model ---------------------------------------------------------------------


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_a_packed_rows_loss_and_logits_equal_its_samples_run_alone(attention):
    torch.manual_seed(0)
    section = FAMILY.Config.model_validate({"name": "hf", "options": {"config": LLAMA,
                                                                       "attn_implementation": attention}})
    model = FAMILY.build(section, {"task": PACKED_LANGUAGE_MODEL.name, "vocab_size": 300, "seq_len": 32}).eval()
    rng = np.random.default_rng(0)
    samples = [(rng.integers(0, 300, n).astype(np.int32), (rng.random(n) > 0.3).astype(np.int8))
               for n in (7, 9, 5, 12, 20, 3)]
    packed, alone = lay_out(samples, 32, 0, pack=True), lay_out(samples, 32, 0, pack=False)
    assert packed.count == 2 and alone.count == 6

    def batch(rows):
        return {name: torch.from_numpy(getattr(rows, name).astype(np.int64)) for name in ("tokens", "labels",
                                                                                            "positions")}

    with torch.no_grad():
        loss_packed, units_packed, _ = PACKED_LANGUAGE_MODEL.forward_loss(model, batch(packed))
        loss_alone, units_alone, _ = PACKED_LANGUAGE_MODEL.forward_loss(model, batch(alone))
        packed_logits = model(batch(packed)["tokens"], batch(packed)["positions"]).logits
        alone_logits = model(batch(alone)["tokens"], batch(alone)["positions"]).logits
    assert units_packed == units_alone == sum(int(learn[1:].sum()) for _, learn in samples)
    assert abs(loss_packed.item() - loss_alone.item()) <= 1e-5 * abs(loss_alone.item())
    # each sample's logits where it lies in its packed row equal those of its own row
    tokens = packed.tokens
    for index, (ids, _) in enumerate(samples):
        row = next(r for r in range(packed.count) if any(np.array_equal(tokens[r, s:s + len(ids)], ids)
                                                          and packed.positions[r, s] == 0 for s in range(32)))
        start = next(s for s in range(32) if np.array_equal(tokens[row, s:s + len(ids)], ids)
                     and packed.positions[row, s] == 0)
        diff = (packed_logits[row, start:start + len(ids)] - alone_logits[index, :len(ids)]).abs().max().item()
        assert diff <= 1e-5, (index, diff)
    # and without the mask the samples would see each other: the test can tell
    plain = types.MethodType(packed_causal_lm_forward, model)
    with torch.no_grad():
        leaked = plain(batch(packed)["tokens"], torch.arange(32).expand(packed.count, 32)).logits
    assert (leaked - packed_logits).abs().max().item() > 1e-3


# --- world size -------------------------------------------------------------------------------


def test_chat_batches_and_the_data_digest_do_not_depend_on_the_world_size(tmp_path):
    write_chats(tmp_path, train=120)
    manifest = prepare(job(options(tmp_path)), tmp_path / "cache")
    reader = SplitReader(manifest, "train")

    def run(world_size):
        shards = [TrainShard(reader, BatchPlan(8, world_size, rank), seed=5) for rank in range(world_size)]
        batches, digest = [], 0
        for step in range(2 * shards[0].steps_per_epoch + 1):
            parts = [shard.batch(step) for shard in shards]
            batches.append({k: np.concatenate([p[k] for p in parts]) for k in parts[0]})
            for shard in shards:
                digest = (digest + batch_digest(step, shard.sample_ids(step))) % DIGEST_MODULUS
        return batches, digest

    (one, digest_one), (two, digest_two) = run(1), run(2)
    assert digest_one == digest_two and len(one) == len(two)
    for a, b in zip(one, two):
        assert all(np.array_equal(a[k], b[k]) for k in ("tokens", "labels", "positions"))


# --- bad input --------------------------------------------------------------------------------


def refused(tmp_path, train_rows, match, **chat_options):
    jsonl(tmp_path / "validation" / "v.jsonl", chats(4, seed=1))
    if isinstance(train_rows, pa.Table):
        (tmp_path / "train").mkdir(parents=True, exist_ok=True)
        pq.write_table(train_rows, tmp_path / "train" / "a.parquet", row_group_size=2)
    else:
        jsonl(tmp_path / "train" / "a.jsonl", train_rows)
    with pytest.raises(UserError, match=match):
        prepare(job(options(tmp_path, **chat_options)), tmp_path / "cache")


def test_a_row_without_messages_is_refused_naming_the_file_and_line(tmp_path):
    rows = chats(6)
    rows[4] = {"text": "no conversation here"}
    refused(tmp_path, rows, r"data\.options\.path: .*a\.jsonl line 5: no 'messages' \(nor 'prompt' and 'completion'\)")


def test_an_unknown_role_is_refused_naming_the_parquet_row_group(tmp_path):
    rows = [{"messages": r.get("messages") or [{"role": "user", "content": "a"}, {"role": "assistant",
                                                                                  "content": "b"}]} for r in chats(6)]
    rows[5]["messages"][0]["role"] = "bot"
    refused(tmp_path, pa.Table.from_pylist(rows), r"data\.options\.path: .*a\.parquet row group 2: message 1 has "
                                                  r"role 'bot'; the roles are system, user, assistant, tool")


def test_a_row_with_no_assistant_turn_is_refused_when_the_loss_learns_the_assistant(tmp_path):
    rows = chats(5)
    rows[3] = {"messages": [{"role": "user", "content": "alpha"}]}
    refused(tmp_path, rows, r"a\.jsonl line 4: no assistant turn, and data\.options\.chat\.train_on is assistant")


def test_a_template_that_does_not_render_is_refused_naming_the_option(tmp_path):
    template = "{% for m in messages %}{% generation %}{{ m.content.nothing() }}{% endgeneration %}{% endfor %}"
    refused(tmp_path, chats(4), r"data\.options\.chat\.template does not render the conversation of .*a\.jsonl line 1",
            template=template)


def test_a_template_without_assistant_markers_is_refused_for_train_on_assistant(tmp_path):
    template = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    refused(tmp_path, chats(4), r"data\.options\.chat\.train_on: assistant, but data\.options\.chat\.template marks "
                                r"no assistant span", template=template)
    (tmp_path / "cache").mkdir(exist_ok=True)
    manifest = prepare(job(options(tmp_path, template=template, train_on="all")), tmp_path / "cache2")
    assert manifest.origin["chat"]["train"]["learnt_tokens"] == manifest.origin["chat"]["train"]["tokens"] - 4


def test_no_template_anywhere_is_refused(tmp_path):
    write_chats(tmp_path, 4, 4)
    data = options(tmp_path)
    del data["chat"]
    with pytest.raises(UserError, match=r"data\.options\.chat\.template: the tokenizer of data\.options\.tokenizer"
                                        r"\.file .* has no chat template"):
        prepare(job(data), tmp_path / "cache")


def test_overlong_conversations_are_truncated_or_dropped_and_counted(tmp_path):
    rows = chats(8)
    long = " ".join(WORDS * 10)
    rows[2] = {"messages": [{"role": "user", "content": "alpha"}, {"role": "assistant", "content": long}]}
    write_chats(tmp_path, 4, 4)
    jsonl(tmp_path / "train" / "a.jsonl", rows)
    truncated = prepare(job(options(tmp_path)), tmp_path / "c1").origin["chat"]["train"]
    dropped = prepare(job(options(tmp_path, too_long="drop")), tmp_path / "c2").origin["chat"]["train"]
    assert (truncated["too_long"], truncated["dropped"]) == (1, 0)
    assert (dropped["too_long"], dropped["dropped"]) == (1, 1) and dropped["tokens"] < truncated["tokens"]


def test_chat_options_that_do_not_fit_are_refused_in_the_config(tmp_path):
    data = options(tmp_path)
    with pytest.raises(ConfigError, match="chat is for format: chat"):
        job({**data, "format": "jsonl"})
    with pytest.raises(ConfigError, match="not train"):
        job({**data, "tokenizer": {"train": {"vocab_size": 300}}})


def test_a_seq_len_past_the_models_positions_is_refused(tmp_path):
    from training.run.preflight import check_model_builds

    section = FAMILY.Config.model_validate({"name": "hf", "options": {"config": LLAMA}})
    with pytest.raises(UserError, match=r"data\.options\.seq_len: 512 is longer than the model's position limit, "
                                        r"max_position_embeddings 256"):
        check_model_builds(section, PACKED_LANGUAGE_MODEL.name, {"vocab_size": 300, "seq_len": 512})


# --- the standard library's chat set --------------------------------------------------------


def test_the_stdlib_chat_set_asks_for_signatures_and_answers_with_docstrings(tmp_path):
    counts = stdlib_chat.write(str(tmp_path / "parquet"), parquet=True)
    assert counts["train"] > 1000 and counts["validation"] > 50
    rows = list(conversations(str(tmp_path / "parquet" / "train" / "stdlib_chat.parquet"), "messages", True))
    assert len(rows) == counts["train"]
    by_name = {m[0]["content"].split("(")[0]: m[1]["content"] for m, _ in rows}
    assert by_name["json.dumps"].startswith("Serialize ``obj`` to a JSON formatted ``str``")
    assert all(not part.startswith("_") for name in by_name for part in name.split("."))


# --- a run on Ray -----------------------------------------------------------------------------


@pytest.mark.ray
def test_a_packed_chat_run_reports_validation_metrics_over_the_assistant_tokens(ray_cluster, workdir, tmp_path):
    from training.checkpoint import format as ckpt
    from training.run.driver import run_training

    write_chats(tmp_path, train=64, validation=12)
    data = options(tmp_path)
    config = validate({
        "name": "chat", "model": {"name": "hf", "options": {"config": LLAMA}},
        "data": {"source": "text", "options": data},
        "train": {"max_steps": 4, "global_batch_size": 4, "eval_every_n_steps": 4, "log_every_n_steps": 2,
                  "min_report_interval_s": 0},
        "checkpoint": {"every_n_steps": 4, "keep": 1}, "tracking": {"enabled": False},
        "scaling": {"num_workers": 2}, "failure": {"max_failures": 0}})
    summary = run_training(config, log=print)
    assert summary.steps == 4
    # the reported validation loss is the final model's mean over the assistant's tokens alone
    manifest = prepare(job(data), workdir / "data-cache-check")
    rows = SplitReader(manifest, "validation").take(np.arange(manifest.rows("validation")))
    model = FAMILY.build(FAMILY.Config.model_validate({"name": "hf", "options": {"config": LLAMA}}),
                         {"task": PACKED_LANGUAGE_MODEL.name, **manifest.spec})
    model.load_state_dict(ckpt.load(sorted((workdir / "runs" / "chat").glob("checkpoint-*"))[-1])["model"])
    with torch.no_grad():
        loss_sum, units, correct = PACKED_LANGUAGE_MODEL.forward_loss(
            model.eval(), {k: torch.from_numpy(v) for k, v in rows.items()}, count_correct=True)
    assert units == manifest.origin["chat"]["validation"]["learnt_tokens"]
    assert summary.metrics["val_loss"] == pytest.approx(loss_sum.item() / units, rel=1e-4)
    assert summary.metrics["val_perplexity"] == pytest.approx(math.exp(loss_sum.item() / units), rel=1e-4)
    assert summary.metrics["val_token_accuracy"] == pytest.approx(correct.item() / units, abs=1e-6)
