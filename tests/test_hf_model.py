"""The `hf` model family without Ray: typed options, a tiny Llama and BERT built from inline configs
and from folders the tests write with save_pretrained, their state dicts, layers and FLOPs, and
every bad input refused (UserError, exit 2) by the driver's meta-device check before anything starts."""

import json
import shutil

import pytest
import torch
from conftest import CONFIGS

from training.errors import ConfigError, UserError
from training.models.registry import build_model, family_of, model_section
from training.run.preflight import check_model_builds
from training.tasks import TASKS

LLAMA = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "intermediate_size": 128}
BERT = {"model_type": "bert", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "intermediate_size": 128, "max_position_embeddings": 64}
TEXT = {"vocab_size": 300, "seq_len": 16}
LABELS = {"vocab_size": 300, "seq_len": 16, "num_classes": 3}


def hf(**options):
    return model_section({"name": "hf", "options": options})


def built(section, task="language_model", spec=TEXT):
    torch.manual_seed(0)
    return build_model(section, {"task": task, **spec})


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory):
    """A tiny Llama (vocab 512, tied embeddings) saved with save_pretrained, and its logits on one input."""
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = tmp_path_factory.mktemp("llama")
    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**{**LLAMA, "vocab_size": 512,
                                                                     "tie_word_embeddings": True}))
    model.save_pretrained(folder)
    tokens = torch.randint(0, 300, (2, 16))
    with torch.no_grad():
        logits = model(tokens, use_cache=False).logits
    return folder, tokens, logits


def copy_of(folder, tmp_path, name="copy"):
    return shutil.copytree(folder, tmp_path / name)


# --- options --------------------------------------------------------------------------------------

def test_options_are_typed_and_exactly_one_source_is_set():
    section = hf(config=LLAMA)
    assert section.options.task == "causal_lm" and section.options.dtype == "float32"
    assert section.options.attn_implementation == "sdpa" and section.options.trust_remote_code is False
    for options, message in [({}, "model.options: set exactly one of pretrained (a folder of weights) and config "
                                   "(an inline architecture); neither is set"),
                             ({"pretrained": "/x", "config": LLAMA}, "both are set"),
                             ({"config": {"hidden_size": 8}}, "model.options.config: needs a model_type"),
                             ({"config": LLAMA, "task": "image"}, "model.options.task"),
                             ({"config": LLAMA, "dtype": "float16"}, "model.options.dtype"),
                             ({"config": LLAMA, "attn_implementation": "flex"}, "model.options.attn_implementation"),
                             ({"config": LLAMA, "revision": "main"}, "model.options.revision: unknown key")]:
        with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
            hf(**options)


def test_a_relative_pretrained_folder_is_made_absolute_on_the_driver(tmp_path, monkeypatch):
    """Ray's workers run in another working directory: the folder they load must not depend on it."""
    monkeypatch.chdir(tmp_path)
    assert hf(pretrained="runs/first/hf").options.pretrained == str(tmp_path / "runs" / "first" / "hf")
    assert hf(pretrained="s3://models/llama/").options.pretrained == "s3://models/llama/"
    assert hf(pretrained="file:///models/llama").options.pretrained == "/models/llama"


def test_the_family_learns_both_tasks_and_is_torch_free_at_import():
    import subprocess
    import sys

    assert {"language_model", "sequence_classification", "packed_language_model"} <= set(family_of("hf").tasks)
    code = ("import sys; from training.models.registry import model_section; "
            "model_section({'name': 'hf', 'options': {'config': {'model_type': 'llama'}}}); "
            "print('torch' in sys.modules, 'transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


# --- build ----------------------------------------------------------------------------------------

def test_a_llama_from_an_inline_config_takes_the_datas_vocabulary_and_trains_as_the_task_calls_it():
    model = built(hf(config=LLAMA))
    assert model.config.vocab_size == 300 and type(model).__name__ == "LlamaForCausalLM"
    check_model_builds(hf(config=LLAMA), "language_model", TEXT)  # the driver's meta-device check
    batch = {"tokens": torch.randint(0, 300, (2, 17))}
    loss_sum, units, _ = TASKS["language_model"].forward_loss(model, batch)
    assert units == 32 and 4 < loss_sum.item() / units < 7  # about ln(300) = 5.7 at the start
    loss_sum.backward()
    # The state dict keeps the transformers names (no wrapper) and loads into a fresh build exactly.
    state = model.state_dict()
    assert "model.layers.0.self_attn.q_proj.weight" in state
    again = built(hf(config={**LLAMA, "vocab_size": 300}))
    again.load_state_dict(state)
    assert torch.equal(again(batch["tokens"][:, :-1]).logits, model(batch["tokens"][:, :-1]).logits)
    # The same seed, the same weights (every worker builds the same model).
    assert all(torch.equal(a, b) for a, b in zip(built(hf(config=LLAMA)).state_dict().values(),
                                                  built(hf(config=LLAMA)).state_dict().values()))


def test_layers_and_flops_per_token():
    family = family_of("hf")
    model = built(hf(config=LLAMA))
    layers = family.blocks(model)
    assert [type(m).__name__ for m in layers] == ["LlamaDecoderLayer"] * 2 and layers[0] is model.model.layers[0]
    # 6 per weight of every matrix multiply (the untied input embedding is a lookup) + the attention term.
    weights = sum(p.numel() for p in model.parameters()) - 300 * 64
    assert family.flops_per_token(model) == 6 * weights + 12 * 2 * 64 * 16
    tied = built(hf(config={**LLAMA, "tie_word_embeddings": True}))
    assert family.flops_per_token(tied) == 6 * sum(p.numel() for p in tied.parameters()) + 12 * 2 * 64 * 16
    bert = built(hf(config=BERT, task="sequence_classification"), "sequence_classification", LABELS)
    assert [type(m).__name__ for m in family.blocks(bert)] == ["BertLayer"] * 2  # not BertEmbeddings
    family.check_shardable(model)


def test_a_model_with_no_layers_to_find_is_refused_under_fsdp_naming_the_attribute():
    model = built(hf(config=LLAMA))
    model._no_split_modules = ["NoSuchLayer"]
    model.config.num_hidden_layers = 3
    with pytest.raises(UserError, match=r"parallel.strategy fsdp: .* _no_split_modules names \(\[.NoSuchLayer.\]\)"):
        family_of("hf").check_shardable(model)


def test_a_bert_classifier_from_a_config_takes_the_datas_classes_and_its_attention_mask():
    section = hf(config=BERT, task="sequence_classification")
    check_model_builds(section, "sequence_classification", LABELS)
    model = built(section, "sequence_classification", LABELS).eval()
    assert model.config.num_labels == 3
    tokens = torch.randint(1, 300, (2, 16))
    attention = torch.ones(2, 16, dtype=torch.int8)
    attention[1, 10:] = 0
    batch = {"tokens": tokens, "attention": attention, "label": torch.tensor([0, 2])}
    loss_sum, units, correct = TASKS["sequence_classification"].forward_loss(model, batch, count_correct=True)
    assert units == 2 and 0 <= correct.item() <= 2
    # Padding is masked: what follows a row's last real token does not change its logits.
    other = tokens.clone()
    other[1, 10:] = 7
    with torch.no_grad():
        assert torch.allclose(model(tokens, attention).logits, model(other, attention).logits, atol=1e-6)
    assert TASKS["sequence_classification"].metrics_of(3.0, 2, 1) == {"val_loss": 1.5, "val_accuracy": 0.5}


def test_a_pretrained_folder_loads_exactly_and_is_checked_without_reading_its_weights(llama_folder):
    folder, tokens, logits = llama_folder
    section = hf(pretrained=str(folder))
    check_model_builds(section, "language_model", TEXT)  # vocab 300 of the model's 512: fits
    model = built(section)
    with torch.no_grad():
        assert torch.equal(model(tokens).logits, logits)
    assert family_of("hf").hf_folder(section) == str(folder) and family_of("hf").hf_model(model) is model
    # Tied embeddings: one tensor, saved and restored through a state dict as a checkpoint does.
    assert model.lm_head.weight is model.model.embed_tokens.weight
    fresh = built(hf(config={**LLAMA, "vocab_size": 512, "tie_word_embeddings": True}))
    fresh.load_state_dict(model.state_dict())
    assert fresh.lm_head.weight is fresh.model.embed_tokens.weight
    with torch.no_grad():
        assert torch.equal(fresh(tokens).logits, logits)


def test_bfloat16_and_a_causal_folder_fine_tuned_as_a_classifier(llama_folder):
    folder, _, _ = llama_folder
    model = built(hf(pretrained=str(folder), dtype="bfloat16"))
    assert model.dtype == torch.bfloat16
    # A decoder's classifier finds each row's last token by the pad id: the data's.
    section = hf(pretrained=str(folder), task="sequence_classification")
    spec = {**LABELS, "pad_id": 0}
    check_model_builds(section, "sequence_classification", spec)
    classifier = built(section, "sequence_classification", spec)
    assert classifier.config.num_labels == 3 and classifier.config.pad_token_id == 0
    assert classifier(torch.randint(1, 300, (2, 16)), torch.ones(2, 16, dtype=torch.int8)).logits.shape == (2, 3)


# --- bad input ------------------------------------------------------------------------------------

def _without_config(folder):
    (folder / "config.json").unlink()


def _without_weights(folder):
    (folder / "model.safetensors").unlink()
    (folder / "pytorch_model.bin").write_bytes(b"pickle")


def _more_layers(folder):
    _edit_config(folder, num_hidden_layers=3)


def _wider(folder):
    _edit_config(folder, intermediate_size=256)


def _unknown_type(folder):
    _edit_config(folder, model_type="acme_lm", auto_map={"AutoModelForCausalLM": "modeling_acme.AcmeLM"})


def _no_head(folder):
    _edit_config(folder, model_type="codegen")


def _edit_config(folder, **changes):
    path = folder / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def _truncated_header(folder):
    (folder / "model.safetensors").write_bytes(b"\xff" * 8 + b"{}")


FOLDER_CASES = {
    "missing": (lambda folder: shutil.rmtree(folder), "model.options.pretrained: {folder} does not exist"),
    "no config.json": (_without_config, "model.options.pretrained: {folder} has no config.json"),
    "no weights": (_without_weights, "model.options.pretrained: {folder} has no weights (no *.safetensors file, no "
                                     "model.safetensors.index.json); pytorch_model.bin is a pickle"),
    "fewer layers in the files": (_more_layers, "model.options.pretrained: {folder}: the weights do not match its "
                                                "config.json: 9 of the model's 30 tensors are not in the files "
                                                "(first: model.layers.2.self_attn.q_proj.weight)"),
    "other shapes": (_wider, "model.options.pretrained: {folder}: the weights do not match its config.json: "
                             "model.layers.0.mlp.gate_proj.weight has shape [128, 64] in the files, [256, 64] in the "
                             "model"),
    "not safetensors": (_truncated_header, "model.options.pretrained: {folder}/model.safetensors is not a "
                                           "safetensors file"),
    "unknown model_type": (_unknown_type, "model.options.pretrained: {folder} is a 'acme_lm' model, which is not in "
                                          "transformers 5.25.0: its code is in the folder, and running it needs "
                                          "model.options.trust_remote_code: true"),
    "no head for the task": (_no_head, "model.options.pretrained ({folder}): a codegen model has no head for "
                                       "model.options.task sequence_classification in transformers; it has one for "
                                       "causal_lm"),
}


@pytest.mark.parametrize("case", FOLDER_CASES)
def test_a_bad_pretrained_folder_is_refused_by_the_drivers_check_naming_the_option(llama_folder, tmp_path, case):
    change, message = FOLDER_CASES[case]
    folder = copy_of(llama_folder[0], tmp_path)
    change(folder)
    task = "sequence_classification" if case == "no head for the task" else "causal_lm"
    data_task, spec = ("sequence_classification", LABELS) if task != "causal_lm" else ("language_model", TEXT)
    with pytest.raises(UserError) as error:
        check_model_builds(hf(pretrained=str(folder), task=task), data_task, spec)
    assert message.format(folder=folder) in str(error.value)


def test_bad_architectures_and_sizes_are_refused_naming_the_option(llama_folder):
    cases = [
        (hf(config={**LLAMA, "model_type": "acme_lm"}), "language_model", TEXT,
         "model.options.config.model_type: 'acme_lm' is not an architecture of transformers 5.25.0"),
        (hf(config={**LLAMA, "model_type": "codegen"}, task="sequence_classification"), "sequence_classification",
         LABELS, "model.options.config.model_type: a codegen model has no head for model.options.task "
                 "sequence_classification in transformers; it has one for causal_lm"),
        (hf(config={**LLAMA, "vocab_size": 100}), "language_model", TEXT,
         "model.options.config: the model's embeddings hold vocab_size 100 tokens, but the data's vocab_size is 300"),
        (hf(pretrained=str(llama_folder[0])), "language_model", {**TEXT, "vocab_size": 600},
         f"model.options.pretrained ({llama_folder[0]}): the model's embeddings hold vocab_size 512 tokens, but the "
         "data's vocab_size is 600"),
        (hf(config={**BERT, "num_labels": 2}, task="sequence_classification"), "sequence_classification", LABELS,
         "model.options.config: num_labels 2, but the data has num_classes 3"),
        (hf(config=LLAMA, task="sequence_classification"), "language_model", TEXT,
         "model.options.task: sequence_classification learns sequence_classification data, but the data is "
         "language_model"),
        (hf(config=LLAMA, attn_implementation="flash_attention_2"), "language_model", TEXT,
         "model.options.attn_implementation: flash_attention_2 needs the flash-attn package, which is not installed "
         "here; use sdpa"),
        (hf(config={**LLAMA, "hidden_act": "no_such_activation"}), "language_model", TEXT,
         "model.options.config: the llama model cannot be built: KeyError: 'no_such_activation'"),
    ]
    for section, task, spec, message in cases:
        with pytest.raises(UserError) as error:
            check_model_builds(section, task, spec)
        assert message in str(error.value), (message, str(error.value))


def test_trust_remote_code_warns_that_the_folders_code_will_run(llama_folder, tmp_path):
    """A folder with its own architecture's code (a Llama under another model_type, as remote code is)."""
    folder = copy_of(llama_folder[0], tmp_path)
    (folder / "modeling_acme.py").write_text(
        "from transformers import LlamaConfig, LlamaForCausalLM\n"
        "class AcmeConfig(LlamaConfig):\n    model_type = 'acme_lm'\n"
        "class AcmeLM(LlamaForCausalLM):\n    config_class = AcmeConfig\n")
    _edit_config(folder, model_type="acme_lm", auto_map={"AutoConfig": "modeling_acme.AcmeConfig",
                                                         "AutoModelForCausalLM": "modeling_acme.AcmeLM"})
    with pytest.warns(UserWarning, match="model.options.trust_remote_code: the Python code in .* will run"):
        model = built(hf(pretrained=str(folder), trust_remote_code=True))
    assert type(model).__name__ == "AcmeLM"
    with torch.no_grad():
        assert torch.equal(model(llama_folder[1]).logits, llama_folder[2])


def test_the_command_refuses_a_bad_hf_model_with_exit_2_before_ray_with_nothing_written(llama_folder, tmp_path):
    from cli_probe import run_cases

    folder = copy_of(llama_folder[0], tmp_path, "weightless")
    (folder / "model.safetensors").unlink()
    config = str(CONFIGS / "llama_stdlib.yaml")
    base = ["data.source=tinylm", "data.options={seq_len: 16, max_bytes: 20000}"]
    cases = {f"model.options={{pretrained: {tmp_path / 'nowhere'}}}":
                 f"model.options.pretrained: {tmp_path / 'nowhere'} does not exist",
             f"model.options={{pretrained: {folder}}}": f"model.options.pretrained: {folder} has no weights",
             "model.options.config.model_type=acme_lm": "model.options.config.model_type: 'acme_lm' is not",
             f"model.options.pretrained={llama_folder[0]}": "model.options: set exactly one of pretrained"}
    dirs = {case: tmp_path / f"cwd{i}" for i, case in enumerate(cases)}
    for directory in dirs.values():
        directory.mkdir()
    sets = [arg for override in base for arg in ("--set", override)]
    results = run_cases("training.run.cli", [{"args": [config, *sets, "--set", case], "cwd": str(dirs[case])}
                                             for case in cases])
    for (case, message), result in zip(cases.items(), results):
        assert result["returncode"] == 2 and message in result["stderr"], (case, result["stderr"][-2000:])
        assert "Traceback" not in result["stderr"] and not result["ray_imported"], case
        assert list(dirs[case].iterdir()) == [], (case, list(dirs[case].iterdir()))


def test_a_forward_on_no_rows_returns_no_logits():
    """Under FSDP a worker whose part of the validation split is empty still runs every layer."""
    model = built(hf(config=LLAMA))
    assert model(torch.zeros((0, 16), dtype=torch.int64)).logits.shape == (0, 16, 300)
    bert = built(hf(config=BERT, task="sequence_classification"), "sequence_classification", LABELS)
    assert bert(torch.zeros((0, 16), dtype=torch.int64), torch.zeros((0, 16), dtype=torch.int8)).logits.shape == (0, 3)


# --- Hub ids ----------------------------------------------------------------------------------------

def test_a_hub_id_is_read_through_the_hugging_face_cache_and_refused_offline_when_not_there(
        llama_folder, tmp_path, monkeypatch):
    """ORG/NAME (no such folder) is the Hub model hf://ORG/NAME, resolved by huggingface_hub's own
    cache: here a cache laid out as huggingface_hub writes it (nothing can be downloaded here), read
    with HF_HUB_OFFLINE; a model not in the cache offline exits 2 naming the option and the cache."""
    from huggingface_hub import constants

    from training.models import hf_nn

    monkeypatch.chdir(tmp_path)
    (tmp_path / "local" / "llama").mkdir(parents=True)
    assert hf(pretrained="local/llama").options.pretrained == str(tmp_path / "local" / "llama")  # (a folder)
    assert hf(pretrained="acme/tiny-llama").options.pretrained == "hf://acme/tiny-llama"
    assert hf(pretrained="hf://acme/tiny-llama@v2").options.pretrained == "hf://acme/tiny-llama@v2"

    cache = tmp_path / "hub"
    commit = "0123456789abcdef0123456789abcdef01234567"
    shutil.copytree(llama_folder[0], cache / "models--acme--tiny-llama" / "snapshots" / commit)
    (cache / "models--acme--tiny-llama" / "refs").mkdir()
    (cache / "models--acme--tiny-llama" / "refs" / "main").write_text(commit)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    section = hf(pretrained="acme/tiny-llama")
    assert hf_nn.local_folder(section.options) == str(cache / "models--acme--tiny-llama" / "snapshots" / commit)
    check_model_builds(section, "language_model", TEXT)
    with torch.no_grad():
        assert torch.equal(built(section)(llama_folder[1]).logits, llama_folder[2])

    with pytest.raises(UserError, match=r"model.options.pretrained: hf://acme/absent is not in the Hugging Face "
                                        rf"cache \({cache}\) and HF_HUB_OFFLINE is set"):
        check_model_builds(hf(pretrained="acme/absent"), "language_model", TEXT)
