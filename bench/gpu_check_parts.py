"""The Python steps of bench/gpu_check.sh (one process each, on the GPU machine; the CPU-safe ones are
tested in tests/test_bench.py):

    python bench/gpu_check_parts.py summary SUMMARY_JSON LABEL   a run's tokens/s, MFU and peak memory
    python bench/gpu_check_parts.py vllm HF_DIR [--max-tokens N]  vLLM loads an exported folder and generates
    python bench/gpu_check_parts.py merged HF_DIR                 an adapter run's export: its adapter folder,
                                                                  and its merged model loaded by transformers
                                                                  on the CPU in full precision

`merged` exits 2 for a folder that is not an HF model folder, 1 for one whose merged model is still
quantized (a 4-bit base merged into), has no adapter folder, or gives logits that are not finite.
`vllm` exits 0 with a line starting "skipped:" where vLLM is not installed or no CUDA device is
present (the check is then not run, and says why); 2 for a folder that is not an HF model folder;
1 if vLLM loaded the folder but generated nothing.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

# Prompts a model trained on the standard library's source continues.
PROMPTS = ["def ", "import os\n", "class Config:\n    def __init__(self"]


def summary_lines(summary: dict, label: str) -> list[str]:
    """A finished run's last reported window (summary.json's metrics), as gpu_check.sh prints it."""
    metrics = summary["metrics"]
    mfu, peak = metrics.get("mfu"), metrics.get("peak_memory_bytes")
    return [f"{label}, {metrics['world_size']} worker(s), {metrics['step']} steps (the last report's window):",
            f"  tokens/s      {metrics['tokens_per_s']:,.0f}",
            f"  MFU           {mfu:.1%}" if mfu is not None else
            "  MFU           n/a (GPU not in training/worker/parallel.py's peak table)",
            f"  peak memory   {peak / 2**30:.2f} GiB per GPU (torch.cuda.max_memory_allocated)" if peak else
            "  peak memory   n/a"] + (
        [f"  loss          train {metrics['train_loss']:.4f}"
         + (f", validation {metrics['val_loss']:.4f}" if "val_loss" in metrics else "")]
        if "train_loss" in metrics else [])


def folder_problem(folder: Path) -> str | None:
    """What keeps `folder` from being an HF model folder (its config and weights); None: nothing."""
    if not (folder / "config.json").is_file():
        return (f"{folder} has no config.json: not an exported Hugging Face folder "
                "(python -m training export RUN --format hf --out DIR)")
    if not any(folder.glob("*.safetensors")):
        return f"{folder} has no *.safetensors weights"
    return None


def merged_problem(folder: Path) -> str | None:
    """What is wrong with an adapter run's export in `folder` (None: nothing): the merged model must
    be a plain full-precision one (an adapter trained on a 4-bit base is merged into the base read
    again in full precision), beside its PEFT adapter folder, and give finite logits."""
    if not (folder / "adapter" / "adapter_config.json").is_file():
        return f"{folder} has no adapter/adapter_config.json: not an adapter run's export"
    if "quantization_config" in json.loads((folder / "config.json").read_text()):
        return f"{folder}/config.json has a quantization_config: the adapter was merged into a quantized base"
    import torch  # (lazy: torch)
    from transformers import AutoModelForCausalLM  # (lazy: transformers)
    from transformers.utils import logging as hf_logging  # (lazy: transformers)

    hf_logging.disable_progress_bar()  # (a bar of its weights' load on the check's output)
    model = AutoModelForCausalLM.from_pretrained(folder, device_map={"": "cpu"}).eval()
    dtypes = sorted({str(p.dtype) for p in model.parameters()})
    if not all(p.dtype.is_floating_point for p in model.parameters()):
        return f"{folder}: the merged model has weights of {', '.join(dtypes)}, not floating point"
    tokens = torch.arange(8).remainder(model.config.vocab_size).unsqueeze(0)
    with torch.no_grad():
        logits = model(tokens).logits
    if not torch.isfinite(logits).all():
        return f"{folder}: the merged model's logits are not finite"
    print(f"merged model of {folder} loaded on the CPU ({', '.join(dtypes)}, "
          f"{sum(p.numel() for p in model.parameters()):,} parameters), finite logits; adapter folder: "
          f"{', '.join(sorted(p.name for p in (folder / 'adapter').iterdir()))}")
    return None


def why_skipped() -> str | None:
    """Why vLLM cannot run here (None: it can)."""
    try:
        import vllm  # noqa: F401  (only whether it is there)
    except ImportError:
        return "vllm is not installed (pip install vllm on the GPU machine to run this check)"
    import torch  # (lazy: torch)

    if not torch.cuda.is_available():
        return "no CUDA device: vLLM's check runs on a GPU machine"
    return None


def vllm_generate(folder: Path, max_tokens: int) -> dict:
    """Load `folder` with vLLM and generate greedily from PROMPTS: the texts and token counts."""
    from vllm import LLM, SamplingParams  # (lazy: vllm, only on a GPU machine)

    config = json.loads((folder / "config.json").read_text())
    # bf16 (vLLM's kernels do not take the fp32 the folder holds); eager: no CUDA graphs captured for
    # a model this small (seconds of start-up); a small share of the GPU's memory for its KV cache.
    llm = LLM(model=str(folder), dtype="bfloat16", enforce_eager=True, gpu_memory_utilization=0.3,
              max_model_len=min(int(config.get("max_position_embeddings", 256)), 1024))
    outputs = llm.generate(PROMPTS, SamplingParams(max_tokens=max_tokens, temperature=0.0))
    return {"prompts": PROMPTS, "texts": [o.outputs[0].text for o in outputs],
            "tokens": [len(o.outputs[0].token_ids) for o in outputs]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="bench/gpu_check_parts.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    steps = p.add_subparsers(dest="step", required=True)
    summary = steps.add_parser("summary", help="print a run's tokens/s, MFU and peak memory")
    summary.add_argument("summary_json", type=Path)
    summary.add_argument("label")
    generate = steps.add_parser("vllm", help="load an exported HF folder with vLLM and generate")
    generate.add_argument("folder", type=Path)
    generate.add_argument("--max-tokens", type=int, default=24)
    merged = steps.add_parser("merged", help="check an adapter run's exported folder: adapter and merged model")
    merged.add_argument("folder", type=Path)
    args = p.parse_args(argv)
    if args.step == "summary":
        print("\n".join(summary_lines(json.loads(args.summary_json.read_text()), args.label)))
        return 0
    problem = folder_problem(args.folder)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    if args.step == "merged":
        problem = merged_problem(args.folder)
        if problem:
            print(f"error: {problem}", file=sys.stderr)
        return 1 if problem else 0
    reason = why_skipped()
    if reason:
        print(f"skipped: vLLM load-and-generate of {args.folder}: {reason}")
        return 0
    found = vllm_generate(args.folder, args.max_tokens)
    for prompt, text, tokens in zip(found["prompts"], found["texts"], found["tokens"]):
        print(f"  vLLM {prompt!r} -> {text!r} ({tokens} tokens)")
    if not any(found["tokens"]):
        print(f"error: vLLM loaded {args.folder} but generated no tokens", file=sys.stderr)
        return 1
    print(f"vLLM loaded {args.folder} and generated {sum(found['tokens'])} tokens from {len(PROMPTS)} prompts")
    return 0


if __name__ == "__main__":
    sys.exit(main())
