#!/usr/bin/env bash
# The GPU figures of BENCHMARKS.md, for a session on a machine with an NVIDIA GPU (an H200):
# GPT-2 small and medium on one device in bf16, tokens/s and MFU, with model.attention=
# dot_product (cuDNN's fused flash attention where dxrun/plan/kernels.py selects it) and
# the einsum reference. First says which attention kernel this GPU gets, then per figure the
# kernel the step selected and the cuDNN fused-attention calls in its compiled program.
# Writes the "GPU figures" section of BENCHMARKS.md and BENCHMARKS.gpu.json.
# A few minutes: two compiles per model, 1 + 2 x (1 + 10) steps per variant.
# Needs JAX with CUDA (pip install -e '.[gpu]') already installed.
set -euo pipefail
cd "$(dirname "$0")/.."
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python -c 'import jax, sys; sys.exit(jax.default_backend() != "gpu" and
  f"JAX sees no GPU ({jax.devices()}): pip install -e .[gpu]")'
python -c 'import jax
from dxrun.plan.run_plan import Inputs, attention_target, choose
t = attention_target(jax.devices()[0])
print("attention kernel, bf16, head dim 64, 1024 positions (GPT-2):",
      choose("dot_product", Inputs(t, "bfloat16", 64, 1024, True)), t)'
python -m benchmarks --gpu "$@"
