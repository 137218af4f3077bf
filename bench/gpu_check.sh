#!/usr/bin/env bash
# GPU check, on a machine with NVIDIA GPUs (never needed for the tests). Installs what it needs into
# .venv-gpu (unless --python names a ready one), then runs four parts, each printed as it ends and
# its run's summary copied to $OUT (default bench/out):
#   tinylm   tinylm preset small (~19M parameters, 256-token context), FSDP2 + bf16 on every GPU:
#            tokens/s, MFU (against the GPU's dense bf16 peak), peak memory per GPU
#   llama1b  an HF Llama of ~0.97B parameters (`model.name: hf`, the TinyLlama-1.1B shape: 22 layers
#            of width 2048, 32 heads, 4 key/value heads; the stdlib BPE's 2048-token vocabulary, tied),
#            FSDP2 + bf16 on every GPU, 1024-token context: tokens/s, MFU, peak memory
#   vllm     a small HF Llama (llama_stdlib.yaml, a few steps) exported with
#            `python -m training export RUN --format hf --out DIR`, loaded by vLLM and generated from
#            (bench/gpu_check_parts.py; skipped, saying so, where vllm is not installed)
#   qlora    QLoRA on 1 GPU: that small Llama's folder (the vllm part's, else trained and exported
#            here) fine-tuned a few steps with sft_stdlib.yaml and model.adapter.kind: qlora (the base
#            4-bit through bitsandbytes, installed into .venv-gpu if missing; with --python and none
#            there, skipped, saying so), its loss printed, then exported: the adapter merged into the
#            base read again in full precision, the merged folder loaded by transformers
#
# Usage: bench/gpu_check.sh [--only PART[,PART...]] [--python PY] [--deadline-s S] [--cpu]
#   --only PARTS    a subset of tinylm,llama1b,vllm,qlora (default: all four, in that order)
#   --python PY     a Python with CUDA torch and this project installed: nothing is installed
#   --deadline-s S  the whole script's limit in seconds (default 720: 12 minutes, which with a
#                   machine's start fits 15 minutes of GPU time); each part gets what is left, and
#                   a part cut short says so
#   --cpu           no GPU (and --only vllm by default): the vllm part's training and export on CPU with the project's .venv and
#                   vLLM skipped (a smoke test of the script's steps; tests/test_bench.py)
# Exit status: 0 all parts passed (or were skipped, saying why), 1 a part failed, 2 bad arguments.
set -euo pipefail
cd "$(dirname "$0")/.."

PARTS=""
PY=""
DEADLINE_S=720
CPU=0
usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; }
bad() { echo "error: $1 (bench/gpu_check.sh --help)" >&2; exit 2; }
while [ $# -gt 0 ]; do
    case "$1" in
        --only) [ -n "${2:-}" ] || bad "--only needs a list of parts"; PARTS="$2"; shift 2 ;;
        --python) [ $# -ge 2 ] || bad "--python needs a path"; PY="$2"; shift 2 ;;
        --deadline-s) [ $# -ge 2 ] || bad "--deadline-s needs a number of seconds"; DEADLINE_S="$2"; shift 2 ;;
        --cpu) CPU=1; shift ;;
        -h|--help) usage; exit 0 ;;
        *) bad "unknown argument '$1'" ;;
    esac
done
[ -n "$PARTS" ] || PARTS=$([ "$CPU" = 1 ] && echo vllm || echo tinylm,llama1b,vllm,qlora)
[[ "$DEADLINE_S" =~ ^[1-9][0-9]*$ ]] || bad "--deadline-s: '$DEADLINE_S' is not a whole number of seconds"
IFS=',' read -r -a WANTED <<< "$PARTS"
[ ${#WANTED[@]} -gt 0 ] || bad "--only: no parts given (parts: tinylm, llama1b, vllm, qlora)"
for part in "${WANTED[@]}"; do
    case "$part" in
        tinylm|llama1b|vllm|qlora) ;;
        *) bad "--only: unknown part '$part' (parts: tinylm, llama1b, vllm, qlora)" ;;
    esac
    if [ "$CPU" = 1 ] && [ "$part" != vllm ]; then
        bad "--cpu runs only the vllm part (its training and export); '$part' needs a GPU"
    fi
done

if [ "$CPU" = 1 ]; then
    PY="${PY:-.venv/bin/python}"
    GPUS=1
    GPU_SETTINGS=()
else
    nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
    GPUS=$(nvidia-smi --list-gpus | wc -l)
    GPU_SETTINGS=(--set scaling.use_gpu=true)
    if [ -z "$PY" ]; then
        python3 -m venv .venv-gpu
        .venv-gpu/bin/pip install -q --upgrade pip
        .venv-gpu/bin/pip install -q "torch==${TORCH_VERSION:-2.13.0}"   # the CUDA build from PyPI
        .venv-gpu/bin/pip install -q -e .
        PY=.venv-gpu/bin/python
    fi
    "$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA'; print('torch', torch.__version__, torch.cuda.get_device_name(0))"
fi
"$PY" -c "import training" 2> /dev/null || bad "--python: $PY cannot import this project (pip install -e . into it)"

OUT_DIR="${OUT:-bench/out}"
mkdir -p "$OUT_DIR"
export TRAINING_BASE_DIR="$(mktemp -d)"   # runs/ and the prepared data: nothing left in the checkout
trap 'rm -rf "$TRAINING_BASE_DIR"' EXIT   # (what the parts measured is copied to $OUT first)
export RAY_ADDRESS=local                  # a fresh local Ray cluster, whatever else runs here
export PYTHONUNBUFFERED=1

left_s() { local left=$((DEADLINE_S - SECONDS)); echo $((left > 1 ? left : 1)); }  # (timeout 0: no limit)
# A run of the service, cut at the deadline. Evaluation and the checkpoint only at the end; a report
# every 10 steps (tokens/s and MFU over the last such window).
train() {  # train RUN STEPS CONFIG [--set ...]
    local run="$1" steps="$2" config="$3"
    shift 3
    timeout "$(left_s)" "$PY" -m training "training/configs/$config" --name "$run" "$@" \
        --set "train.max_steps=$steps" --set "train.eval_every_n_steps=$steps" \
        --set "checkpoint.every_n_steps=$steps" --set train.log_every_n_steps=10 \
        --set train.min_report_interval_s=0 --set tracking.enabled=false --set scaling.cpus_per_worker=1
}
FSDP_BF16=(--set parallel.strategy=fsdp --set parallel.mixed_precision=bf16 --set train.precision=bf16
           --set "scaling.num_workers=$GPUS" --set train.torch_threads=4)

part_tinylm() {
    local run="gpu-tinylm-fsdp-${GPUS}gpu"
    train "$run" 150 tinylm.yaml "${GPU_SETTINGS[@]}" "${FSDP_BF16[@]}" \
        --set "model.options={preset: small}" --set "data.options={seq_len: 256, max_bytes: 4000000}" \
        --set "train.global_batch_size=$((32 * GPUS))" || return
    cp "$TRAINING_BASE_DIR/runs/$run/summary.json" "$OUT_DIR/gpu_check.json"
    "$PY" bench/gpu_check_parts.py summary "$OUT_DIR/gpu_check.json" "tinylm small, FSDP + bf16"
}

LLAMA_1B="{model_type: llama, hidden_size: 2048, intermediate_size: 5632, num_hidden_layers: 22, \
num_attention_heads: 32, num_key_value_heads: 4, max_position_embeddings: 2048, tie_word_embeddings: true}"
part_llama1b() {
    local run="gpu-llama1b-fsdp-${GPUS}gpu"
    train "$run" 60 llama_stdlib.yaml "${GPU_SETTINGS[@]}" "${FSDP_BF16[@]}" \
        --set "model.options.config=$LLAMA_1B" \
        --set data.options.seq_len=1024 --set data.options.max_bytes=4000000 \
        --set "train.global_batch_size=$((16 * GPUS))" || return
    cp "$TRAINING_BASE_DIR/runs/$run/summary.json" "$OUT_DIR/gpu_check_llama1b.json"
    "$PY" bench/gpu_check_parts.py summary "$OUT_DIR/gpu_check_llama1b.json" \
        "HF Llama ~0.97B (model.name hf), FSDP + bf16, seq_len 1024"
}

SMALL_LLAMA="$TRAINING_BASE_DIR/export-llama"
small_llama() {  # the small Llama trained a few steps and exported to $SMALL_LLAMA (once: vllm and qlora)
    local run="gpu-vllm-llama" folder="$SMALL_LLAMA"
    [ -f "$folder/config.json" ] && return
    local small=()
    if [ "$CPU" = 1 ]; then  # the smoke test: a smaller corpus and vocabulary, a few steps
        small=(--set data.options.max_bytes=300000 --set data.options.tokenizer.train.sample_bytes=300000
               --set data.options.tokenizer.train.vocab_size=512 --set data.options.partitions=2
               --set train.global_batch_size=8)
    fi
    train "$run" "$([ "$CPU" = 1 ] && echo 4 || echo 40)" llama_stdlib.yaml "${GPU_SETTINGS[@]}" \
        --set scaling.num_workers=1 --set failure.max_failures=0 "${small[@]}" || return
    "$PY" bench/gpu_check_parts.py summary "$TRAINING_BASE_DIR/runs/$run/summary.json" "small Llama to export" || return
    timeout "$(left_s)" "$PY" -m training export "$run" --format hf --out "$folder"
}

part_vllm() {
    small_llama || return
    cp "$SMALL_LLAMA/config.json" "$OUT_DIR/gpu_check_vllm_config.json"
    timeout "$(left_s)" "$PY" bench/gpu_check_parts.py vllm "$SMALL_LLAMA"
}

part_qlora() {
    local run="gpu-qlora-sft" merged="$TRAINING_BASE_DIR/export-qlora"
    if ! "$PY" -c "import bitsandbytes" 2> /dev/null; then
        if [ "$PY" != .venv-gpu/bin/python ]; then
            echo "skipped: qlora: $PY has no bitsandbytes (pip install bitsandbytes into it, or leave out --python)"
            return 0
        fi
        timeout "$(left_s)" "$PY" -m pip install -q bitsandbytes || {
            echo "skipped: qlora: bitsandbytes could not be installed into $PY"; return 0; }
    fi
    small_llama || return
    local log="$TRAINING_BASE_DIR/qlora.log"
    train "$run" 30 sft_stdlib.yaml "${GPU_SETTINGS[@]}" --set "model.options.pretrained=$SMALL_LLAMA" \
        --set model.adapter.kind=qlora --set parallel.strategy=ddp --set scaling.num_workers=1 \
        --set failure.max_failures=0 2>&1 | tee "$log"
    local status=${PIPESTATUS[0]}
    [ "$status" = 0 ] || return "$status"
    # (the worker's line: the base was 4-bit, not read in full precision)
    grep -m1 "model.adapter.kind qlora: .* base weights 4-bit" "$log" || {
        echo "error: qlora: the run's log never says the base was loaded 4-bit" >&2; return 1; }
    cp "$TRAINING_BASE_DIR/runs/$run/summary.json" "$OUT_DIR/gpu_check_qlora.json"
    "$PY" bench/gpu_check_parts.py summary "$OUT_DIR/gpu_check_qlora.json" "QLoRA (4-bit nf4 base) on the small Llama" \
        || return
    timeout "$(left_s)" "$PY" -m training export "$run" --format hf --out "$merged" || return
    timeout "$(left_s)" "$PY" bench/gpu_check_parts.py merged "$merged"
}

FAILED=()
for part in "${WANTED[@]}"; do
    if [ "$SECONDS" -ge "$DEADLINE_S" ]; then
        echo "part $part: not run, the deadline of ${DEADLINE_S} s has passed"
        FAILED+=("$part")
        continue
    fi
    echo "== part $part ($(left_s) s left)"
    status=0
    "part_$part" || status=$?
    if [ "$status" = 124 ]; then
        echo "part $part: cut at the deadline of ${DEADLINE_S} s"
        FAILED+=("$part")
    elif [ "$status" != 0 ]; then
        echo "part $part: failed (exit $status)"
        FAILED+=("$part")
    fi
done
if [ ${#FAILED[@]} -gt 0 ]; then
    echo "failed: ${FAILED[*]}"
    exit 1
fi
echo "all parts done in ${SECONDS} s"
