"""On the driver (a run's end) or anywhere its storage is readable (`python -m training export`): a
trained model as a Hugging Face model folder, which `transformers` (`AutoModelForCausalLM.from_pretrained`),
vLLM and TGI load as it is:

    config.json                    the architecture (the `hf` family's own; the built-in gpt as GPT-2,
                                   to which it maps exactly: training/models/gpt_nn.py to_gpt2)
    model.safetensors              the weights; above MAX_SHARD_SIZE (a sharded checkpoint written file
                                   by file: STREAMED_MAX_SHARD_SIZE), model-0000i-of-0000n.safetensors
                                   and model.safetensors.index.json
    generation_config.json         the end-of-sequence (and pad) token generation stops at
    tokenizer.json, tokenizer_config.json
                                   the pretrained folder's tokenizer, else the data's (the `text`
                                   source's tokenizer.json) with its end-of-document token as EOS,
                                   BOS and pad
    preprocessor_config.json       images: the image processor the data was prepared with (its
                                   settings in the data's spec: training/data/image.py), which
                                   AutoImageProcessor loads

A family offers this with `hf_model(model)`: the `transformers.PreTrainedModel` of its trained network
(the hf family's own model, the gpt family's converted). A sharded (fsdp) checkpoint of a
`transformers` model (the hf family, without an adapter), when no loaded model is given, is written
file by file, never whole (hf_export_sharded.py); any other is loaded in this one process
(checkpoint/format.py load_model_state): the whole model in host memory once.
"""

from __future__ import annotations

import importlib.metadata as metadata
import json
import tempfile
from pathlib import Path
from typing import Optional

import pyarrow.fs as pafs
import yaml
from tokenizers import Tokenizer

from training import config as config_lib
from training import storage
from training.data.chat import TEMPLATE_FILE
from training.data.image import processor_of
from training.data.manifest import Manifest
from training.data.tokenizer import EOS_CANDIDATES, PAD_CANDIDATES, TOKENIZER_FILE
from training.errors import UserError, first_line
from training.models import hf_adapter
from training.models.family import ModelSection
from training.models.registry import family_of
from training.redaction import redact
from training.run.record import Record
from training.tasks import IMAGE_CLASSIFICATION, LANGUAGE_MODEL, PACKED_LANGUAGE_MODEL, SEQUENCE_CLASSIFICATION

HF_DIR = "hf"  # a finished run's folder, in its storage (<run_dir>/hf) and among its MLflow artifacts
ADAPTER_DIR = "adapter"  # an adapter run's PEFT folder: inside its HF folder, and among its MLflow artifacts
# transformers' own default (save_pretrained's max_shard_size): one file up to that size, then shards.
MAX_SHARD_SIZE = "50GB"
# The `transformers` pipeline task of a data task, for MLflow's transformers flavor.
PIPELINE_TASKS = {LANGUAGE_MODEL.name: "text-generation", PACKED_LANGUAGE_MODEL.name: "text-generation",
                  SEQUENCE_CLASSIFICATION.name: "text-classification",
                  IMAGE_CLASSIFICATION.name: "image-classification"}


def exports_hf(section: ModelSection) -> bool:
    """Whether the section's family maps its model to a `transformers` architecture."""
    return callable(getattr(family_of(section.name), "hf_model", None))


def check_exports_hf(section: ModelSection) -> None:
    if not exports_hf(section):
        raise UserError(f"model.name: {section.name} has no Hugging Face form; the families that export one: "
                        "gpt (as GPT-2) and hf")


def hf_model(section: ModelSection, model):
    """The `transformers.PreTrainedModel` of the trained `model`, in eval mode, with its class's own
    forward: a task's forward set on the instance for the training loop (the hf family's) would
    take generate()'s keyword arguments for its own."""
    check_exports_hf(section)
    hf = family_of(section.name).hf_model(model).eval()
    vars(hf).pop("forward", None)
    return hf


def is_transformers_model(model, hf) -> bool:
    """Whether the trained network is itself a `transformers` model (the hf family), not converted
    into one (gpt): the former is logged to MLflow with the transformers flavor."""
    own = {id(p) for p in model.parameters()}
    return all(id(p) in own for p in hf.parameters())


def hf_tokenizer(section: ModelSection, data_options, manifest):
    """The tokenizer that goes with the model: the pretrained folder's (`family.hf_folder`, when it
    holds one), else the data's tokenizer.json as a PreTrainedTokenizerFast with the data's end,
    start and padding tokens; None when the data has no tokenizer (tokens read as they are)."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast  # (lazy: transformers)

    folder_of = getattr(family_of(section.name), "hf_folder", None)
    folder = folder_of(section) if callable(folder_of) else None
    if folder and any((Path(folder) / name).is_file() for name in (TOKENIZER_FILE, "tokenizer_config.json")):
        return with_data_template(AutoTokenizer.from_pretrained(folder), manifest)
    uri = storage.join(manifest.root, TOKENIZER_FILE)
    if not storage.exists(uri):
        return None
    tokenizer = Tokenizer.from_str(storage.read_text(uri))
    origin = manifest.origin or {}
    eos = _first_token(tokenizer, [getattr(data_options, "eos_token", None)], EOS_CANDIDATES, origin.get("eos_id"))
    # (without a BOS of its own, GPT-2's convention: the token that ends a document starts the next,
    # as the text source packs its rows)
    bos = tokenizer.id_to_token(origin["bos_id"]) if origin.get("bos_id") is not None else eos
    pad = _first_token(tokenizer, [getattr(data_options, "pad_token", None)], PAD_CANDIDATES) or eos
    return with_data_template(PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=eos, bos_token=bos,
                                                      pad_token=pad), manifest)


def with_data_template(tokenizer, manifest):
    """The chat template chat data was rendered with (stored beside its tokenizer) as the tokenizer's
    own: the exported model is then served with the template it was fine-tuned on."""
    uri = storage.join(manifest.root, TEMPLATE_FILE) if manifest is not None else None
    if uri and storage.exists(uri):
        tokenizer.chat_template = storage.read_text(uri)
    return tokenizer


def hf_image_processor(manifest):
    """The image processor the data's images were prepared with (PIL backend), from the settings the
    data's spec records; None for data that is not images."""
    settings = (getattr(manifest, "spec", None) or {}).get("image_processor")
    if not settings:
        return None
    return processor_of(json.dumps(settings, sort_keys=True))


def _first_token(tokenizer, given: list, candidates, recorded_id: Optional[int] = None) -> Optional[str]:
    """The token the data used: the id its manifest records, else the option given, else the first
    candidate the tokenizer has (training/data/tokenizer.py's order)."""
    if recorded_id is not None:
        return tokenizer.id_to_token(recorded_id)
    names = [name for name in given if name] or candidates
    return next((name for name in names if tokenizer.token_to_id(name) is not None), None)


def with_special_tokens(hf, tokenizer) -> None:
    """The tokenizer's EOS, BOS and pad ids into the model's config and generation config: the
    tokens its data was tokenized with (an inline config's defaults, Llama's eos 2, mean nothing to
    it). A model's list of ids that holds the tokenizer's (Llama 3's two EOS) stays."""
    if tokenizer is None:
        return
    for field in ("eos_token_id", "bos_token_id", "pad_token_id"):
        value = getattr(tokenizer, field, None)
        for config in (hf.config, getattr(hf, "generation_config", None)):
            if config is None:  # an encoder has no generation config
                continue
            current = getattr(config, field, None)
            if value is not None and not (isinstance(current, list) and value in current):
                setattr(config, field, value)


def save_local(hf, tokenizer, directory: str | Path, max_shard_size: str | int = MAX_SHARD_SIZE) -> list[str]:
    """Write the folder into the local `directory`; returns its file names. Written with
    transformers' save_pretrained: tied weights once (the file holds the embedding, the head is
    re-tied on load), the generation config beside the config."""
    from transformers.utils import logging as hf_logging  # (lazy: transformers)

    directory = Path(directory)
    shown = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # (a bar per shard file on the run's console)
    try:
        hf.save_pretrained(directory, safe_serialization=True, max_shard_size=max_shard_size)
    finally:
        if shown:
            hf_logging.enable_progress_bar()
    if tokenizer is not None:
        tokenizer.save_pretrained(directory)
    return sorted(p.name for p in directory.iterdir())


def copy_folder(local: str | Path, out_uri: str) -> None:
    """The local folder's files into `out_uri` (local or any pyarrow URI), which is emptied first:
    a shard left from an earlier, larger export would otherwise sit beside the new index."""
    fs, path = storage.filesystem(out_uri)
    if fs.get_file_info(path).type == pafs.FileType.Directory:
        fs.delete_dir_contents(path)
    fs.create_dir(path, recursive=True)
    # (a new file of pyarrow's gets the umask's mode: safetensors writes its files 0600)
    pafs.copy_files(str(local), path, source_filesystem=pafs.LocalFileSystem(), destination_filesystem=fs)


def write_hf_folder(job, manifest, checkpoint, out_uri: str, model=None,
                    max_shard_size: str | int | None = None) -> list[str]:
    """The job's model in `checkpoint` (a ray.train.Checkpoint; or the loaded `model`) as an HF folder
    at `out_uri` (local or s3://), replacing what is there; returns the files written. UserError if
    the model's family has no HF form. Without `model`, a sharded checkpoint of a `transformers`
    model is written file by file, never loaded whole (hf_export_sharded.py; its files up to
    STREAMED_MAX_SHARD_SIZE unless `max_shard_size` is given)."""
    check_exports_hf(job.model)
    streamed = None
    if model is None:
        from training.run import hf_export_sharded  # (lazy: torch)
        from training.run.final_model import load_final_model  # (lazy: torch)

        streamed = hf_export_sharded.streamable_model(job.model, manifest, checkpoint)
        model = streamed if streamed is not None else load_final_model(job.model, manifest, checkpoint)
    adapter = adapter_files(job.model, model)  # (before hf_model merges the adapter into the model)
    hf = hf_model(job.model, model)
    tokenizer = hf_tokenizer(job.model, job.data.options, manifest)
    with_special_tokens(hf, tokenizer)
    if tokenizer is None:  # (images: the processor is saved where a tokenizer would be)
        tokenizer = hf_image_processor(manifest)
    names = (getattr(manifest, "origin", None) or {}).get("labels") if manifest is not None else None
    if names and len(names) == getattr(hf.config, "num_labels", None):  # a classifier's labels by name
        hf.config.id2label = dict(enumerate(names))
        hf.config.label2id = {name: index for index, name in enumerate(names)}
    with tempfile.TemporaryDirectory(prefix="hf-export-") as tmp:
        if streamed is not None:
            files = hf_export_sharded.save_local(hf, tokenizer, checkpoint, tmp, max_shard_size)
        else:
            files = save_local(hf, tokenizer, tmp, max_shard_size or MAX_SHARD_SIZE) if writes_merged(job.model) else []
        files += save_adapter(adapter, Path(tmp) / ADAPTER_DIR)
        copy_folder(tmp, out_uri)
    return files


def adapter_files(section: ModelSection, model) -> dict[str, bytes]:
    """An adapter run's PEFT adapter folder (adapter_config.json, adapter_model.safetensors: a
    few MB), by file name, from the model before its adapter is merged; {} for a run without one."""
    if getattr(section, "adapter", None) is None:
        return {}
    with tempfile.TemporaryDirectory(prefix="hf-adapter-") as tmp:
        hf_adapter.save_folder(model, Path(tmp))
        return {path.name: path.read_bytes() for path in Path(tmp).iterdir()}


def save_adapter(files: dict[str, bytes], directory: Path) -> list[str]:
    """The adapter folder's files into `directory` (none: nothing); their names in the HF folder."""
    if not files:
        return []
    directory.mkdir()
    for name, content in files.items():
        (directory / name).write_bytes(content)
    return [f"{directory.name}/{name}" for name in sorted(files)]


def writes_merged(section: ModelSection) -> bool:
    """Whether the HF folder holds the whole model: an adapter run's merged into its base unless
    model.adapter.merge is false (then its folder holds the adapter folder alone)."""
    adapter = getattr(section, "adapter", None)
    return adapter is None or adapter.merge


def log_transformers_model(hf, tokenizer, task: str, name: str, signature=None):
    """Log `hf` and its tokenizer (or image processor) with MLflow's transformers flavor (inside an
    active run); returns the ModelInfo. The requirements are given: MLflow would infer them by
    importing what the model's modules import (torchvision among them, not installed) and fails."""
    import mlflow.transformers  # (lazy: mlflow)

    images = task == PIPELINE_TASKS[IMAGE_CLASSIFICATION.name]
    requirements = [f"{package}=={metadata.version(package).split('+')[0]}"
                    for package in ("torch", "transformers", "tokenizers", "safetensors", *(("pillow",) * images))]
    component = "image_processor" if images else "tokenizer"
    return mlflow.transformers.log_model(transformers_model={"model": hf, component: tokenizer}, name=name,
                                         task=task, pip_requirements=requirements, signature=signature)


def pipeline_task(manifest_task: str) -> Optional[str]:
    return PIPELINE_TASKS.get(manifest_task)


# --- `python -m training export RUN`: a run in storage ------------------------------------------------

def run_checkpoint(run_dir: str, step: Optional[int]) -> tuple[int, str]:
    """(step, path) of the run's checkpoint at `step`, else its newest complete one; UserError if none."""
    from training.checkpoint import format as ckpt  # (lazy: torch)

    fs, base = storage.filesystem(run_dir)
    if step is None:
        newest = ckpt.newest_complete(fs, base)
        if newest is None:
            raise UserError(f"run {redact(run_dir)} has no complete checkpoint")
        return newest
    path = f"{base}/{ckpt.checkpoint_dir_name(step)}"
    if not ckpt.is_complete(fs, path):
        found = [str(ckpt.step_of(e.base_name)) for e in fs.get_file_info(pafs.FileSelector(base))
                 if e.type == pafs.FileType.Directory and ckpt.step_of(e.base_name) is not None
                 and ckpt.is_complete(fs, e.path)]
        raise UserError(f"--checkpoint {step}: run {redact(run_dir)} has no complete checkpoint at step {step} "
                        f"(complete: {', '.join(sorted(found, key=int)) or 'none'})")
    return step, path


def run_job(run_dir: str):
    """(job config, data manifest) of the run in `run_dir`, from its config.yaml and run.json;
    UserError if there is no run there or its model has no HF form."""
    config_uri = storage.join(run_dir, "config.yaml")
    record = Record.read(storage.join(run_dir, "run.json"), run_dir.rsplit("/", 1)[-1], f"storage {redact(run_dir)}")
    if record is None or not storage.exists(config_uri):
        raise UserError(f"no run in {redact(run_dir)} (it has no run.json or config.yaml)")
    job = config_lib.validate(yaml.safe_load(storage.read_text(config_uri)), redact(config_uri))
    check_exports_hf(job.model)  # (before the data is looked for)
    root = (record.dataset or {}).get("root")
    try:
        manifest = Manifest.load(root)
    except (OSError, ValueError, TypeError) as exc:
        raise UserError(f"the data run {redact(run_dir)} trained on ({redact(str(root))}) is not readable: "
                        f"{first_line(exc)}; the model's sizes and tokenizer are read from it") from None
    return job, manifest


def export_run(run_dir: str, step: Optional[int], out_uri: str) -> tuple[int, list[str]]:
    """Write the HF folder of the run in `run_dir` (its checkpoint at `step`, else its newest) to
    `out_uri`; returns (step, files). UserError, before anything is written, for a missing run or
    step, a family with no HF form, or an `out_uri` that holds files."""
    import ray.train  # (lazy: ray)

    job, manifest = run_job(run_dir)
    step, path = run_checkpoint(run_dir, step)
    fs, out = storage.filesystem(out_uri)
    if fs.get_file_info(out).type == pafs.FileType.File or (
            fs.get_file_info(out).type == pafs.FileType.Directory and fs.get_file_info(pafs.FileSelector(out))):
        raise UserError(f"--out {redact(out_uri)} is not an empty folder; give a new one")
    run_fs, _ = storage.filesystem(run_dir)
    return step, write_hf_folder(job, manifest, ray.train.Checkpoint(path, filesystem=run_fs), out_uri)
