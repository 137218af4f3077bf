"""The HF folder of a sharded (fsdp) checkpoint of a `transformers` model written file by file
(training/run/hf_export_sharded.py): from a checkpoint that 2 gloo processes wrote as the workers do,
the folder equals, byte for byte, what save_pretrained writes of the whole model (shards, index, tied
head left out), loads with the trained model's logits, and the export's memory stays far below the
model's size. No Ray."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pyarrow.fs as pafs
import pytest
import torch
from test_hf_export import prepared_root, save_checkpoint, text_job, train_bpe

os.environ.setdefault("HF_HUB_OFFLINE", "1")

TESTS = Path(__file__).resolve().parent
TIED = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": True}
UNTIED = {**TIED, "model_type": "qwen2", "tie_word_embeddings": False}
# ~240 MB in fp32 (4 layers of 15M parameters): large enough that a whole-model load stands out.
LARGE = {"model_type": "llama", "hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 4,
         "num_attention_heads": 16, "num_key_value_heads": 4, "tie_word_embeddings": False}


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _job_and_manifest(root: Path, config: dict):
    root.mkdir(parents=True, exist_ok=True)
    tokenizer = train_bpe(vocab_size=320)
    return text_job({"name": "hf", "options": {"config": config}}), prepared_root(root, tokenizer)


def _fsdp_worker(rank: int, world_size: int, port: int, root: str) -> None:
    """Each worker: the model sharded with FSDP2 as a run shards it, one AdamW step on the same
    batch, the checkpoint written as a worker writes it (its own directory); rank 0 also keeps the
    full trained weights, gathered, as the reference."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from training.checkpoint import format as ckpt
    from training.config import ParallelConfig
    from training.models.registry import build_model, family_of
    from training.worker.parallel import wrap

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        for name, config in (("tied", TIED), ("untied", UNTIED)):
            job, manifest = _job_and_manifest(Path(root) / name / f"data{rank}", config)
            torch.manual_seed(0)
            model = build_model(job.model, {"task": manifest.task, **manifest.spec})
            wrap(model, ParallelConfig(strategy="fsdp"), torch.device("cpu"),
                 blocks=family_of("hf").blocks(model))
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
            scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
            tokens = torch.randint(0, manifest.spec["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(1))
            model(tokens).logits.float().pow(2).mean().backward()
            optimizer.step()
            directory = Path(root) / name / f"rank{rank}"
            directory.mkdir(parents=True)
            ckpt.write(directory, model=model, optimizer=optimizer, scheduler=scheduler, sharded=True,
                       loop=ckpt.LoopState(step=1), config={"seed": 0}, steps_per_epoch=10, world_size=world_size,
                       metrics={})
            full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
            if rank == 0:
                torch.save(full, Path(root) / name / "trained.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def fsdp_checkpoints(tmp_path_factory):
    """name -> (job, manifest, checkpoint directory, trained state dict): each checkpoint gathered
    from the 2 workers' directories as their uploads leave it (meta.json last)."""
    import torch.multiprocessing as mp

    root = tmp_path_factory.mktemp("fsdp")
    mp.start_processes(_fsdp_worker, args=(2, _free_port(), str(root)), nprocs=2, join=True, start_method="spawn")
    from training.checkpoint import format as ckpt

    found = {}
    for name, config in (("tied", TIED), ("untied", UNTIED)):
        directory = root / name / "checkpoint-00000001"
        directory.mkdir()
        for rank_dir in (root / name / "rank0", root / name / "rank1"):
            for file_name in ckpt.upload_order(p.name for p in rank_dir.iterdir()):
                shutil.copyfile(rank_dir / file_name, directory / file_name)
        assert ckpt.is_complete(pafs.LocalFileSystem(), str(directory))
        job, manifest = _job_and_manifest(root / name, config)
        found[name] = job, manifest, directory, torch.load(root / name / "trained.pt", weights_only=True)
    return found


@pytest.mark.parametrize("name", ["tied", "untied"])
def test_an_fsdp_checkpoint_exports_file_by_file_as_save_pretrained_writes_the_whole_model(fsdp_checkpoints,
                                                                                          tmp_path, name):
    import ray.train
    from transformers import AutoModelForCausalLM

    from training.models.registry import build_model
    from training.run import hf_export_sharded
    from training.run.final_model import load_final_model
    from training.run.hf_export import write_hf_folder

    job, manifest, directory, trained_state = fsdp_checkpoints[name]
    checkpoint = ray.train.Checkpoint(str(directory))
    assert hf_export_sharded.streamable_model(job.model, manifest, checkpoint) is not None
    files = write_hf_folder(job, manifest, checkpoint, str(tmp_path / "streamed"), max_shard_size="100KB")
    shards = [f for f in files if f.startswith("model-")]
    assert len(shards) > 1 and "model.safetensors.index.json" in files and "model.safetensors" not in files
    index = json.loads((tmp_path / "streamed" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(shards)
    assert ("lm_head.weight" in index["weight_map"]) == (name == "untied")  # a tied head: the embedding's alone

    # what save_pretrained writes of the whole model, loaded as before: the same files, byte for byte
    whole = write_hf_folder(job, manifest, checkpoint, str(tmp_path / "whole"),
                            model=load_final_model(job.model, manifest, checkpoint), max_shard_size="100KB")
    assert whole == files
    for file_name in files:
        assert (tmp_path / "streamed" / file_name).read_bytes() == (tmp_path / "whole" / file_name).read_bytes(), \
            file_name

    trained = build_model(job.model, {"task": manifest.task, **manifest.spec})
    trained.load_state_dict(trained_state)
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "streamed"), dtype=torch.float32).eval()
    tokens = torch.randint(0, manifest.spec["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(loaded(tokens).logits, trained.eval()(tokens).logits)
    assert (loaded.lm_head.weight is loaded.model.embed_tokens.weight) == (name == "tied")

    # below its default size (STREAMED_MAX_SHARD_SIZE): one model.safetensors, no index, as save_pretrained
    one = write_hf_folder(job, manifest, checkpoint, str(tmp_path / "one"))
    assert "model.safetensors" in one and not [f for f in one if f.startswith("model-") or f.endswith("index.json")]


def test_a_pretrained_models_checkpoint_keeps_its_folders_generation_config(tmp_path):
    """A model fine-tuned from a folder: its generation settings are the folder's, as the whole
    model loaded with from_pretrained has them (not the defaults of its config)."""
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    from training.models.registry import build_model
    from training.run.final_model import load_final_model
    from training.run.hf_export import write_hf_folder

    options = {k: v for k, v in UNTIED.items() if k != "model_type"}
    base = AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen2", vocab_size=320, **options))
    base.generation_config = GenerationConfig(do_sample=True, temperature=0.6, top_p=0.9, eos_token_id=[0, 1])
    base.save_pretrained(tmp_path / "base")
    manifest = prepared_root(tmp_path, train_bpe(vocab_size=320))
    job = text_job({"name": "hf", "options": {"pretrained": str(tmp_path / "base")}})
    torch.manual_seed(0)
    model = build_model(job.model, {"task": manifest.task, **manifest.spec})
    checkpoint = save_checkpoint(tmp_path / "checkpoint-00000001", model, sharded=True)
    files = write_hf_folder(job, manifest, checkpoint, str(tmp_path / "streamed"))
    whole = write_hf_folder(job, manifest, checkpoint, str(tmp_path / "whole"),
                            model=load_final_model(job.model, manifest, checkpoint))
    assert files == whole
    for file_name in files:
        assert (tmp_path / "streamed" / file_name).read_bytes() == (tmp_path / "whole" / file_name).read_bytes(), \
            file_name
    saved = GenerationConfig.from_pretrained(tmp_path / "streamed")
    assert saved.do_sample and saved.temperature == 0.6 and saved.top_p == 0.9


def test_the_private_transformers_functions_the_export_uses_still_behave():
    """training/adaptors/transformers_private.py: a tied head is left out, an untied one kept, a dense
    model's names are its files' names and a mixture of experts' are not (its export is not streamed)."""
    from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

    from training.adaptors import transformers_private

    def on_meta(model_type: str, **options):
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, vocab_size=320, **options))

    assert hasattr(PreTrainedModel, "_keys_to_ignore_on_save")
    for config, kept in ((TIED, False), (UNTIED, True)):
        model = on_meta(**config)
        state = transformers_private.saved_state(model)
        assert ("lm_head.weight" in state) == kept and "model.embed_tokens.weight" in state
        assert transformers_private.file_names_of(state, model) == list(state)
    moe = on_meta(**{**UNTIED, "model_type": "mixtral", "num_local_experts": 4})
    state = transformers_private.saved_state(moe)
    assert "model.layers.0.mlp.experts.down_proj" in state
    assert "model.layers.0.block_sparse_moe.experts.0.w2.weight" in transformers_private.file_names_of(state, moe)


def _measure_export(root: str, out: str, max_shard_size: str) -> None:
    """In a fresh process: the growth of this process's peak RSS while the checkpoint in `root` is
    exported, after everything the export imports is imported; printed as JSON."""
    import ray.train

    from training.run import hf_export_sharded
    from training.run.hf_export import write_hf_folder

    job, manifest = _job_and_manifest(Path(f"{out}-data"), LARGE)
    checkpoint = ray.train.Checkpoint(str(Path(root) / "checkpoint-00000001"))
    hf_export_sharded.streamable_model(job.model, manifest, checkpoint)  # (imports what the export imports)
    import huggingface_hub  # noqa: F401
    import safetensors.torch  # noqa: F401
    import torch.distributed.checkpoint  # noqa: F401

    def rss(field: str) -> int:
        line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith(field))
        return int(line.split()[1]) * 1024

    Path("/proc/self/clear_refs").write_text("5")  # (resets VmHWM, the peak, to the current RSS)
    before = rss("VmRSS:")
    write_hf_folder(job, manifest, checkpoint, out, max_shard_size=max_shard_size)
    print(json.dumps({"peak_growth": rss("VmHWM:") - before}))


@pytest.mark.slow
def test_the_export_of_a_large_checkpoint_never_holds_the_whole_model(tmp_path):
    from training.models.registry import build_model

    job, manifest = _job_and_manifest(tmp_path / "data", LARGE)
    with torch.device("meta"):  # (its values do not matter here: memory, not drawn)
        model = build_model(job.model, {"task": manifest.task, **manifest.spec}).to_empty(device="cpu")
    model_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    save_checkpoint(tmp_path / "checkpoint-00000001", model, sharded=True)  # (DCP, one shard)
    del model
    script = (f"import sys; sys.path[:0] = [{str(TESTS)!r}]; import test_hf_export_sharded as t; "
              f"t._measure_export({str(tmp_path)!r}, {str(tmp_path / 'hf')!r}, '32MB')")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          cwd=TESTS.parent)
    assert done.returncode == 0, done.stderr[-3000:]
    growth = json.loads(done.stdout.strip().splitlines()[-1])["peak_growth"]
    print(f"export peak RSS growth {growth / 2**20:.0f} MiB for a {model_bytes / 2**20:.0f} MiB model")
    assert growth < 0.6 * model_bytes  # (measured: 0.35x; loading the whole model: 2.7x)
    assert len([p for p in (tmp_path / "hf").iterdir() if p.name.startswith("model-")]) > 1
