#!/usr/bin/env bash
# GPU check: on a machine with NVIDIA GPUs, installs what it needs into .venv-gpu and runs the
# GPU benchmark row (tinylm in bf16 on 1 GPU, and on all GPUs if more than one): tokens/s and MFU.
# Under 5 minutes on one modern GPU. Never needed for the tests.
set -euo pipefail
cd "$(dirname "$0")/.."
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -m venv .venv-gpu
.venv-gpu/bin/pip install -q --upgrade pip
.venv-gpu/bin/pip install -q "torch==${TORCH_VERSION:-2.13.0}"   # the CUDA build from PyPI
.venv-gpu/bin/pip install -q -e .
.venv-gpu/bin/python -c "import torch; assert torch.cuda.is_available(), 'no CUDA'; print('torch', torch.__version__, torch.cuda.get_device_name(0))"
.venv-gpu/bin/python -m bench --rows gpu --out "${OUT:-bench/out}"
