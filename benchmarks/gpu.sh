#!/usr/bin/env bash
# The GPU figures of BENCHMARKS.md, for a session on a machine with an NVIDIA GPU (an H200):
# GPT-2 small and medium on one device in bf16, tokens/s and MFU, with and without the fused
# attention. Writes the "GPU figures" section of BENCHMARKS.md and BENCHMARKS.gpu.json.
# A few minutes: two compiles per model, 1 + 2 x (1 + 10) steps per variant.
# Needs JAX with CUDA (pip install -e '.[gpu]') already installed.
set -euo pipefail
cd "$(dirname "$0")/.."
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python -c 'import jax, sys; sys.exit(jax.default_backend() != "gpu" and
  f"JAX sees no GPU ({jax.devices()}): pip install -e .[gpu]")'
python -m dxrun.bench --gpu "$@"
