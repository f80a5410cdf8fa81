#!/usr/bin/env bash
# The GPU check: one prepared script for the first session lent a GPU, under 12 minutes on one GPU (an H100/H200
# class card; set-up of the venv not counted). Every part prints ratios measured in this same run:
#   1. fit:    the quickstart (SmolLM2-135M target, DFlash-style drafter) for 2 minutes in bf16-mixed with the target
#              in bf16 on the GPU: MAL before/after and the steps reached (the CPU quickstart reaches 38-500 steps in
#              5 minutes, depending on the CPU);
#   2. decode: that drafter on the GPU in bf16 (benchmarks/decode_speed.py): plain vs chain vs tree vs n-gram vs
#              decoding auto, tokens/s over our plain decoding and over transformers' generate, on 16 MT-Bench prompts;
#              and the target's 1-token forward against its memory floor, FastForward against transformers' forward
#              (benchmarks/forward_floor.py);
#   3. fsdp:   an FSDP fit of the same experiment (FULL_SHARD of the drafter, 1 GPU) for 30 steps against the
#              single-device fit's loss at the same steps: the strategy runs, and its loss matches.
# Usage (from the repository root, after `make setup`):
#   benchmarks/gpu_check.sh            # on a machine with a CUDA GPU; output under gpu-check/
#   benchmarks/gpu_check.sh --cpu      # every part shrunk to the tiny target on CPU (seconds; what the test runs),
#                                      # the FSDP part skipped with its reason (Lightning's FSDP needs CUDA)
# Figures go to benchmarks/README.md ("`gpu_check.sh`: the check the first GPU session runs"), with the GPU name.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
LS=${LS:-.venv/bin/lightning-spec}
OUT=${GPU_CHECK_OUT:-gpu-check}
mkdir -p "$OUT"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false

if [ "${1:-}" = "--cpu" ]; then
    MODE=cpu
    FIT=(-c experiments/tiny.yaml --trainer.max_steps=4 --trainer.val_check_interval=null
         --trainer.limit_val_batches=0 --trainer.callbacks=[] --trainer.enable_progress_bar=false)
    DECODE=(--target tiny-random --device cpu --dtype float32 --prompts 2 --max-new-tokens 8 --repeats 2
            --cache-len 16 --plan '{kind: tree, nodes: 4, top_k: 2}' --calibration 1 --no-peers)
    FLOOR=(--target tiny-random --dtypes float32 --repeats 1 --prompts 1 --max-new-tokens 4)
else
    MODE=gpu
    "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'gpu_check: no CUDA GPU; run with --cpu')"
    FIT=(-c experiments/quickstart.yaml --trainer.accelerator=gpu --trainer.devices=1 --trainer.precision=bf16-mixed
         --model.target_dtype=bfloat16 --trainer.max_time=00:00:02:00 --trainer.enable_progress_bar=false)
    DECODE=(--device cuda --dtype bfloat16 --prompts 16 --max-new-tokens 128 --plan '{kind: tree, nodes: 16, top_k: 4}')
    FLOOR=(--device cuda --dtypes bfloat16 --prompts 8 --max-new-tokens 64)
fi
"$PY" - <<'EOF'
import platform, torch
gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
print(f"gpu_check: {gpu}; torch {torch.__version__}; {platform.processor() or platform.machine()}", flush=True)
EOF

echo "== 1. fit ($MODE)"
start=$(date +%s)
"$LS" fit "${FIT[@]}" --trainer.default_root_dir="$OUT/runs" \
    --trainer.logger.init_args.tracking_uri="sqlite:///$OUT/mlflow.db" 2>&1 | tee "$OUT/fit.log" | grep -v "^\s*$" | tail -25
ckpt=$(ls -t "$OUT"/runs/*/*/checkpoints/last.ckpt | head -1)
echo "fit: $(( $(date +%s) - start )) s, checkpoint $ckpt"

echo "== 2. decode ($MODE)"
"$PY" benchmarks/decode_speed.py --drafter "$ckpt" "${DECODE[@]}" 2>&1 | tee "$OUT/decode.log" | tail -40
"$PY" benchmarks/forward_floor.py "${FLOOR[@]}" 2>&1 | tee "$OUT/floor.log" | tail -12

echo "== 3. fsdp ($MODE)"
if [ "$MODE" = cpu ]; then
    echo "fsdp: skipped on CPU (Lightning's FSDPStrategy needs CUDA; tests/test_module.py checks its wiring here)"
    exit 0
fi
SMOKE=(-c experiments/quickstart.yaml --trainer.accelerator=gpu --trainer.devices=1 --trainer.precision=bf16-mixed
       --model.target_dtype=bfloat16 --trainer.max_steps=30 --trainer.max_time=null --trainer.callbacks=[]
       --trainer.limit_val_batches=0 --trainer.enable_progress_bar=false --trainer.log_every_n_steps=30)
for strategy in auto fsdp; do
    "$LS" fit "${SMOKE[@]}" --trainer.strategy=$strategy --trainer.default_root_dir="$OUT/$strategy" \
        --trainer.logger.init_args.tracking_uri="sqlite:///$OUT/mlflow.db" \
        --trainer.logger.init_args.run_name="smoke-$strategy" > "$OUT/$strategy.log" 2>&1
done
"$PY" - "$OUT/mlflow.db" <<'EOF'
import sys
import mlflow
client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{sys.argv[1]}")
exp = client.get_experiment_by_name("lightning_spec")
loss = {}
for name in ("smoke-auto", "smoke-fsdp"):
    (run,) = client.search_runs([exp.experiment_id], f"attributes.run_name = '{name}'", max_results=1)
    loss[name] = client.get_metric_history(run.info.run_id, "train/loss")[-1].value
print(f"fsdp: train/loss at step 30: single device {loss['smoke-auto']:.4f}, FSDP {loss['smoke-fsdp']:.4f}, "
      f"ratio {loss['smoke-fsdp'] / loss['smoke-auto']:.4f}")
EOF
