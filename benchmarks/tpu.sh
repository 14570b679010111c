#!/usr/bin/env bash
# The TPU figures of BENCHMARKS.md, on a host with one TPU chip (a v5e), from the repo root with
# dxrun's dependencies installed (pip install -e '.[tpu]'):
#   benchmarks/tpu.sh [out dir]
# 1. benchmarks/tpu.py times dxrun's step and the hand-written one (bf16 over fp32 masters,
#    optax AdamW, Pallas' splash attention) per shape, on random GPT-2 token ids;
# 2. model=small's time to its first step through `python -m dxrun`, with an empty compile cache
#    and again with the cache it left (the second run also traces two steps for dxrun.profile);
# 3. writes BENCHMARKS.tpu.json and BENCHMARKS.md's TPU section, with plan mode's estimate of
#    each shape (compiled on the host's CPU: `--report` runs anywhere, no chip needed).
# 4. each model as a user runs it with no key but its data (the defaults row);
# 5. the field's dense models (issue 81): a Qwen3-0.6B and a Gemma-2-shaped model in bf16.
# 6. a sparse model (issue 82): moe_small beside small, the dense model of its active FLOPs.
# About 40 minutes on the chip. Where the checkout came without its own git dir, DXRUN_COMMIT names
# the commit the records carry.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-tpu-out}"
mkdir -p "$out"
python3 -c 'import jax, sys; sys.exit(jax.default_backend() != "tpu" and
  f"JAX sees no TPU ({jax.devices()})")'
tok="${DXRUN_TOKENS:-/tmp/dxrun-tokens}"  # random GPT-2 ids: throughput does not read them
[ -f "$tok/meta.json" ] || python3 - "$tok" <<'PY'
import json, sys, numpy as np
out = sys.argv[1]; import os; os.makedirs(out, exist_ok=True)
r = np.random.default_rng(0)
for name, n in (("train", 20_000_000), ("val", 1_000_000)):
    r.integers(0, 50257, n, dtype=np.uint16).tofile(f"{out}/{name}.bin")
json.dump({"vocab_size": 50257, "dtype": "uint16", "train_tokens": 20_000_000,
           "val_tokens": 1_000_000, "max_id": 50256, "eot": 50256},  # ids only: no tokenizer
          open(f"{out}/meta.json", "w"))
PY
# 5. The field's dense models (issue 81), from their presets' seeded init (the chip holds no
#    checkpoint, and a fine-tune's steps are these): Qwen3-0.6B whole in bf16 (2048-token
#    windows); Gemma-2-2B's layers (8 of its 26, its 256,000-token vocabulary cut to the data's,
#    so its fp32 state fits one chip) with its 4096-position window on every other layer of
#    8192 and its soft caps (splash's local masks and cap). The layout is parallelism=auto's;
#    the report puts plan mode's estimate of that layout beside it.
family() {
  local gemma2="gemma2_2b model.n_layers=8 model.vocab_size=50304 data.seq_len=8192"
  local FAMILY=("qwen3_0_6b data.seq_len=2048 data.batch_size=16" "$gemma2 data.batch_size=8")
  local row m args
  for row in "${FAMILY[@]}"; do
    read -r m args <<<"$row"
    [[ -z "${DXRUN_TPU_FAMILY:-}" || "$m" == "$DXRUN_TPU_FAMILY" ]] || continue
    given=("model=$m" data=tokens "data.path=$tok" train.precision=bf16 parallelism.search=fresh
           $args)  # fresh: a short run searches all the same (its layout is the row's)
    rm -rf "$out/family-$m"
    echo "${given[*]}" > "$out/family-$m.args"
    python3 -m dxrun "${given[@]}" "train.steps=${DXRUN_TPU_FAMILY_STEPS:-30}" \
      train.log_every=10 checkpoint.every=0 train.eval_every=0 "hydra.run.dir=$out/family-$m" \
      2>&1 | tee "$out/family-$m.log"
  done
}
# DXRUN_TPU_ONLY=family: section 5 alone (DXRUN_TPU_FAMILY=<preset>: one of its rows), its rows
# printed with plan mode's estimates, no BENCHMARKS.md section written.
if [ "${DXRUN_TPU_ONLY:-}" = family ]; then
  family
  python3 -c 'import sys; from benchmarks.tpu import family_rows
print("\n".join(family_rows(sys.argv[1])))' "$out" | tee "$out/family.md"
  exit 0
fi
B=train.grad_reduce_dtype=bf16  # the gradients' sums in bf16, as the hand-written step's
G=$B,model.scan_layers=false  # and the layers unrolled
# Each model at its fastest shape (where the hand-written step does not fit: its fp32 logits,
# its scanned stack) and at the fastest shape both fit, side by side: large at 16 under full
# remat (scanned: unrolled gains nothing there, and compiles 5 times longer).
# moe_small (8 experts, top 2, GPT-2 small's width) beside small, the dense model of its active
# FLOPs: in one run, on the same chip.
SHAPES=(${DXRUN_TPU_SHAPES:-small:16:none:$G+hand small:8:none:$G+hand medium:8:none:$G+hand
        medium:4:none:$G+hand large:12:keep_attention:$G+hand large:16:full:$B+hand
        moe_small:16:none:$G moe_small:8:none:$G moe_small:16:none:$B})
python3 -m benchmarks.tpu "${SHAPES[@]}" --tokens "$tok" --out "$out" 2>&1 | tee "$out/tpu.log"
first=(python3 -m dxrun model=small data=tokens "data.path=$tok" data.seq_len=1024
       data.batch_size=16 parallelism=dp1 train.precision=bf16 train.grad_reduce_dtype=bf16
       logger=none checkpoint.every=0 train.eval_every=0 train.steps=20 train.log_every=10
       "runtime.compile_cache=$out/cache")
rm -rf "$out/cache" "$out/first-cold" "$out/first-warm"
python3 -c 'from benchmarks.tpu import commit; print(commit())' > "$out/first-commit"
"${first[@]}" "hydra.run.dir=$out/first-cold" 2>&1 | tee "$out/first-cold.log"
"${first[@]}" "hydra.run.dir=$out/first-warm" train.profile.start=12 train.profile.steps=2 \
  2>&1 | tee "$out/first-warm.log"
python3 -m dxrun.profile "$out/first-warm" | tee "$out/profile.txt"
# 4. What a user gets who gives only the model and the data: each model with its defaults
#    (parallelism=auto, train.precision=auto, train.grad_reduce_dtype=auto, data.batch_size 32),
#    the run's own MFU beside the model's fastest tuned shape above.
for m in small medium large; do
  rm -rf "$out/default-$m"
  python3 -m dxrun "model=$m" data=tokens "data.path=$tok" data.seq_len=1024 \
    "train.steps=${DXRUN_TPU_DEFAULT_STEPS:-300}" "hydra.run.dir=$out/default-$m" \
    2>&1 | tee "$out/default-$m.log"
done
family
[ -n "${DXRUN_TPU_NO_REPORT:-}" ] || python3 -m benchmarks.tpu --report "benchmarks/tpu.sh" \
  --tokens "$tok" --out "$out"
