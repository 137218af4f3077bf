#!/usr/bin/env bash
# GPU check: on a machine with NVIDIA GPUs, installs what it needs into .venv-gpu, then trains tinylm
# (preset small, ~19M parameters, 256-token context) with FSDP2 and bf16 on every GPU of the machine
# and prints tokens/s, MFU (against the GPU's dense bf16 peak) and peak memory per GPU.
# Under 5 minutes on one modern GPU (most of it the install). Never needed for the tests.
set -euo pipefail
cd "$(dirname "$0")/.."
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
GPUS=$(nvidia-smi --list-gpus | wc -l)
python3 -m venv .venv-gpu
.venv-gpu/bin/pip install -q --upgrade pip
.venv-gpu/bin/pip install -q "torch==${TORCH_VERSION:-2.13.0}"   # the CUDA build from PyPI
.venv-gpu/bin/pip install -q -e .
.venv-gpu/bin/python -c "import torch; assert torch.cuda.is_available(), 'no CUDA'; print('torch', torch.__version__, torch.cuda.get_device_name(0))"

OUT_DIR="${OUT:-bench/out}"
mkdir -p "$OUT_DIR"
export TRAINING_BASE_DIR="$(mktemp -d)"   # runs/ and the prepared data: nothing left in the checkout
export RAY_ADDRESS=local                  # a fresh local Ray cluster, whatever else runs here
RUN="gpu-fsdp-${GPUS}gpu"
STEPS=150
# Evaluation and the checkpoint only at the end; reports every 10 steps (tokens/s over that window).
.venv-gpu/bin/python -m training training/configs/tinylm.yaml --name "$RUN" \
    --set "model.options={preset: small}" --set "data.options={seq_len: 256, max_bytes: 4000000}" \
    --set parallel.strategy=fsdp --set parallel.mixed_precision=bf16 --set train.precision=bf16 \
    --set scaling.use_gpu=true --set "scaling.num_workers=$GPUS" --set scaling.cpus_per_worker=1 \
    --set train.torch_threads=4 --set "train.global_batch_size=$((32 * GPUS))" \
    --set "train.max_steps=$STEPS" --set "train.eval_every_n_steps=$STEPS" --set "checkpoint.every_n_steps=$STEPS" \
    --set train.log_every_n_steps=10 --set train.min_report_interval_s=0 --set tracking.enabled=false

cp "$TRAINING_BASE_DIR/runs/$RUN/summary.json" "$OUT_DIR/gpu_check.json"
.venv-gpu/bin/python - "$OUT_DIR/gpu_check.json" <<'PY'
import json, sys

metrics = json.load(open(sys.argv[1]))["metrics"]
mfu, peak = metrics.get("mfu"), metrics.get("peak_memory_bytes")
print(f"tinylm small, FSDP + bf16, {metrics['world_size']} GPU(s), {metrics['step']} steps (last window of 10):")
print(f"  tokens/s      {metrics['tokens_per_s']:,.0f}")
print(f"  MFU           {mfu:.1%}" if mfu is not None else "  MFU           n/a (GPU not in training/worker/parallel.py's peak table)")
print(f"  peak memory   {peak / 2**30:.2f} GiB per GPU (torch.cuda.max_memory_allocated)" if peak else "  peak memory   n/a")
PY
