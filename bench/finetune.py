"""The fine-tuning rows (the driver, Ray started): a small pretrained Llama, written here with
save_pretrained beside a byte-level BPE trained on the chat set, fine-tuned through the service
(training/configs/sft_stdlib.yaml's job, `model.name: hf` from `model.options.pretrained`, DDP on 2
workers of 1 thread) on the standard library's chat set (training/data/stdlib_chat.py), two sides
interleaved round after round:

- lora_vs_full: LoRA (`model.adapter`) against full fine-tuning of the same model on the same packed
  rows: the bytes of the final checkpoint and of the optimizer state in it, and steady-state tokens/s.
- packing: packed rows (`chat.packing: true`) against one conversation a row, padded (`false`), both
  LoRA: useful tokens/s, the rows' real tokens (not padding) per second.

Steady state as bench/hf_throughput.py: the first third of the steps is warm-up, the rate read from
the service's `wall_time` reports after it; the evaluation, checkpoint and export come after the last
step, outside the window. The validation split is cut to a few conversations: it is evaluated once,
after the window, and would only cost wall time."""

from __future__ import annotations

import json
import sysconfig
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from bench.common import interleaved, median, paired_ratios, run_service, service_job, steady_samples_per_s
from training.data.manifest import Manifest
from training.data.stdlib_chat import conversations
from training.data.tinylm import stdlib_source_files

CONFIG = "sft_stdlib.yaml"
WORKERS = 2
EOS = "<|endoftext|>"
VOCAB = 2048
SEQ_LEN = 256  # the stdlib chat set's mean conversation is under a quarter of it (the row reports it)
GLOBAL_BATCH = 8
LORA = "{kind: lora, r: 16, alpha: 32, dropout: 0.05}"  # sft_stdlib.yaml's adapter
# ~3.7M parameters: big enough that the frozen base's share of the work and the state shows
LLAMA = dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=4, max_position_embeddings=SEQ_LEN, tie_word_embeddings=True)
QUICK_LLAMA = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, max_position_embeddings=SEQ_LEN, tie_word_embeddings=True)
VALIDATION_CONVERSATIONS = 64
QUICK_TRAIN_CONVERSATIONS = 300


# --- arithmetic (tests/test_bench_finetune.py) ---------------------------------------------------

def state_bytes(tree) -> int:
    """The bytes of every tensor in a nested state (dicts, lists, tuples), e.g. an optimizer's."""
    import torch  # (lazy: torch)

    if isinstance(tree, torch.Tensor):
        return tree.numel() * tree.element_size()
    if isinstance(tree, dict):
        return sum(state_bytes(value) for value in tree.values())
    if isinstance(tree, (list, tuple)):
        return sum(state_bytes(value) for value in tree)
    return 0


def parameter_count(model_state: dict) -> int:
    """The floating-point elements of a state dict, a tensor under two names (tied embeddings: the
    input embedding and lm_head, saved once) counted once."""
    found = {(t.data_ptr(), t.numel()): t.numel() for t in model_state.values() if t.is_floating_point()}
    return sum(found.values())


def real_tokens_per_row(counts: dict) -> float:
    """A split's real (not padding) tokens per row, from its chat counts in the manifest: a row
    the stream draws holds this many in expectation (the stream draws every row alike)."""
    return counts["tokens"] / counts["rows"]


def mean_sample_length(counts: dict) -> float:
    """The mean length in tokens of the conversations laid out in rows (after truncation)."""
    return counts["tokens"] / (counts["conversations"] - counts["dropped"])


# --- the model and the data -----------------------------------------------------------------------

@dataclass(frozen=True)
class Setup:
    model: str  # the pretrained folder: config.json, model.safetensors, tokenizer files
    data: str  # train/ and validation/ chat files (JSON Lines)
    train_conversations: int


def write_chat_set(folder: Path, train_limit: int | None) -> tuple[int, list[str]]:
    """The stdlib chat set (every function of the train split, or `train_limit` spread over it) and
    its first few validation conversations; returns the train count and the texts to train a BPE on."""
    splits = conversations(Path(sysconfig.get_paths()["stdlib"]), stdlib_source_files())
    train = splits["train"]
    if train_limit is not None and len(train) > train_limit:
        train = train[::len(train) // train_limit][:train_limit]  # (every module's share, not the first modules)
    rows = {"train": train, "validation": splits["validation"][:VALIDATION_CONVERSATIONS]}
    for split, chats in rows.items():
        (folder / split).mkdir(parents=True)
        (folder / split / "chats.jsonl").write_text("".join(json.dumps({"messages": c["messages"]}) + "\n"
                                                            for c in chats))
    return len(train), [m["content"] for c in train for m in c["messages"]]


def write_pretrained(folder: Path, sizes: dict, texts: list[str]) -> None:
    """A Llama of random weights and a byte-level BPE of VOCAB tokens trained on `texts`, both
    saved with save_pretrained (what `tokenizer.from_model: true` reads)."""
    import torch  # (lazy: torch)
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast  # (lazy: transformers)

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(texts, trainer=trainer)
    PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=EOS).save_pretrained(folder)
    torch.manual_seed(0)
    config = LlamaConfig(**sizes, vocab_size=bpe.get_vocab_size(), eos_token_id=bpe.token_to_id(EOS), bos_token_id=None)
    LlamaForCausalLM(config).save_pretrained(folder)


def set_up(root: Path, quick: bool) -> Setup:
    data, model = root / "chats", root / "llama"
    count, texts = write_chat_set(data, QUICK_TRAIN_CONVERSATIONS if quick else None)
    write_pretrained(model, QUICK_LLAMA if quick else LLAMA, texts)
    return Setup(str(model), str(data), count)


def overrides(setup: Setup, steps: int, adapter: str | None, packing: bool) -> list[str]:
    every = 2  # a report every 2 steps: the window has enough points at any length
    return [f"model.options.pretrained={setup.model}", f"model.adapter={adapter or 'null'}",
            f"data.options.path={setup.data}/train", f"data.options.validation_path={setup.data}/validation",
            f"data.options.seq_len={SEQ_LEN}", f"data.options.chat.packing={str(packing).lower()}",
            f"train.max_steps={steps}", f"train.global_batch_size={GLOBAL_BATCH}", f"train.eval_every_n_steps={steps}",
            f"train.log_every_n_steps={every}", "train.min_report_interval_s=0", f"checkpoint.every_n_steps={steps}",
            f"scaling.num_workers={WORKERS}", "scaling.cpus_per_worker=1", "train.torch_threads=1",
            "tracking.register_model=false", "tracking.export_onnx=false", "eval.generate=null"]


@dataclass(frozen=True)
class Measured:
    samples_per_s: float
    checkpoint_bytes: int
    optimizer_state_bytes: int
    trained_parameters: int  # the model tensors the checkpoint holds: the adapter's, or every one
    chat: dict  # the train split's counts (training/data/chat.py)


def measure(setup: Setup, steps: int, warmup: int, adapter: str | None, packing: bool, name: str) -> Measured:
    from training.checkpoint import format as ckpt  # (lazy: torch)

    job = service_job(CONFIG, overrides(setup, steps, adapter, packing), f"{name}-{time.monotonic_ns()}")
    summary, history = run_service(job)
    state = ckpt.load(summary.checkpoint_path)
    root = json.loads((Path(summary.run_dir) / "run.json").read_text())["dataset"]["root"]
    return Measured(steady_samples_per_s(history, warmup, GLOBAL_BATCH), ckpt.written_bytes(summary.checkpoint_path),
                    state_bytes(state["optimizer"]["state"]),
                    parameter_count(state["model"]),
                    Manifest.load(root).origin["chat"]["train"])


def _lengths(quick: bool, rounds: int | None, steps: int | None) -> tuple[int, int, int]:
    steps = steps or (8 if quick else 24)
    return rounds or (1 if quick else 3), steps, max(2, steps // 3)


# --- the rows -------------------------------------------------------------------------------------

def lora_vs_full(quick: bool, rounds: int | None = None, steps: int | None = None) -> dict:
    """LoRA over full fine-tuning of the same model and packed rows: checkpoint bytes, optimizer-state
    bytes, steady-state tokens/s (the rows' positions; the same rows on both sides)."""
    rounds, steps, warmup = _lengths(quick, rounds, steps)
    with tempfile.TemporaryDirectory() as tmp:
        setup = set_up(Path(tmp), quick)
        lora, full = interleaved(lambda: measure(setup, steps, warmup, LORA, True, "lora"),
                                 lambda: measure(setup, steps, warmup, None, True, "full"), rounds=rounds)
    speed = paired_ratios([m.samples_per_s for m in lora], [m.samples_per_s for m in full])
    a, b = lora[-1], full[-1]  # (the bytes are the same every round)
    return {"checkpoint_bytes": {"lora": a.checkpoint_bytes, "full": b.checkpoint_bytes},
            "checkpoint_bytes_ratio": a.checkpoint_bytes / b.checkpoint_bytes,
            "optimizer_state_bytes": {"lora": a.optimizer_state_bytes, "full": b.optimizer_state_bytes},
            "optimizer_state_bytes_ratio": a.optimizer_state_bytes / b.optimizer_state_bytes,
            "trained_parameters": {"lora": a.trained_parameters, "full": b.trained_parameters},
            "lora_tokens_per_s": median([m.samples_per_s for m in lora]) * SEQ_LEN,
            "full_tokens_per_s": median([m.samples_per_s for m in full]) * SEQ_LEN,
            "tokens_per_s_ratio": speed["ratio_median"], "pairs": speed,
            "tokens_per_s_per_round": {"lora": [m.samples_per_s * SEQ_LEN for m in lora],
                                       "full": [m.samples_per_s * SEQ_LEN for m in full]},
            **_shape(quick, setup, rounds, steps, warmup), "adapter": LORA}


def packing(quick: bool, rounds: int | None = None, steps: int | None = None) -> dict:
    """Packed over one-a-row (padded) chat rows, LoRA both: useful (real, not padding) tokens/s."""
    rounds, steps, warmup = _lengths(quick, rounds, steps)
    with tempfile.TemporaryDirectory() as tmp:
        setup = set_up(Path(tmp), quick)
        packed, padded = interleaved(lambda: measure(setup, steps, warmup, LORA, True, "packed"),
                                     lambda: measure(setup, steps, warmup, LORA, False, "padded"), rounds=rounds)
    useful = {side: [m.samples_per_s * real_tokens_per_row(m.chat) for m in runs]
              for side, runs in (("packed", packed), ("padded", padded))}
    pairs = paired_ratios(useful["packed"], useful["padded"])
    counts = {"packed": packed[-1].chat, "padded": padded[-1].chat}
    length = mean_sample_length(counts["packed"])
    return {"packed_useful_tokens_per_s": median(useful["packed"]),
            "padded_useful_tokens_per_s": median(useful["padded"]), "ratio": pairs["ratio_median"], "pairs": pairs,
            "useful_tokens_per_s_per_round": useful,
            "rows_per_s": {"packed": median([m.samples_per_s for m in packed]),
                           "padded": median([m.samples_per_s for m in padded])},
            "real_tokens_per_row": {side: real_tokens_per_row(c) for side, c in counts.items()},
            "rows": {side: c["rows"] for side, c in counts.items()},
            "mean_length": length, "mean_length_vs_seq_len": length / SEQ_LEN,
            "truncated": counts["packed"]["too_long"] - counts["packed"]["dropped"],
            **_shape(quick, setup, rounds, steps, warmup), "adapter": LORA}


def _shape(quick: bool, setup: Setup, rounds: int, steps: int, warmup: int) -> dict:
    sizes = QUICK_LLAMA if quick else LLAMA
    model = {k: sizes[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers")} | {"vocab": VOCAB}
    return {"model": model,
            "seq_len": SEQ_LEN, "global_batch": GLOBAL_BATCH, "workers": WORKERS, "threads_per_worker": 1,
            "steps": steps, "warmup_steps": warmup, "rounds": rounds, "conversations": setup.train_conversations}
