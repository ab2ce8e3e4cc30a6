#!/usr/bin/env bash
# GPU checks then timings for grpo_core (see benchmarks/gpu_check.py). <= 8 minutes on one GPU.
#   bash benchmarks/gpu_check.sh              # on a GPU machine; JSON to $OUT or benchmarks/results
#   bash benchmarks/gpu_check.sh --cpu-smoke  # the same code paths on CPU with a tiny config
# Needs torch (CUDA build), transformers >= 5, safetensors, tokenizers. PYTHON overrides the interpreter.
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ -n "${PYTHON:-}" ]]; then PY="$PYTHON"
elif [[ -x .venv/bin/python ]]; then PY=.venv/bin/python
else PY=python3; fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
OUT_DIR="${OUT:-benchmarks/results}"
mkdir -p "$OUT_DIR"
SMOKE=""
[[ "${1:-}" == "--cpu-smoke" ]] && SMOKE="--cpu-smoke"

echo "== python: $PY"
"$PY" -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__,
      "cuda", torch.cuda.is_available(), "gpus", torch.cuda.device_count())'
if [[ -n "$SMOKE" ]]; then
  NPROC=2  # gloo on CPU
else
  command -v nvidia-smi >/dev/null && nvidia-smi -L || true
  NPROC=$("$PY" -c 'import torch; print(torch.cuda.device_count())')
  if [[ "$NPROC" -lt 1 ]]; then echo "no GPU visible (use --cpu-smoke on CPU)"; exit 2; fi
fi

status=0
echo "== single process: correctness vs CPU references, then generation / training-step timings"
timeout 330 "$PY" benchmarks/gpu_check.py single $SMOKE --out "$OUT_DIR/gpu_check.json" || status=$?
echo "== DDP, then FSDP2, over $NPROC process(es): all_reduce + one Trainer.update each vs one process"
timeout 120 "$PY" -m torch.distributed.run --standalone --nproc_per_node="$NPROC" \
  benchmarks/gpu_check.py ddp $SMOKE --out "$OUT_DIR/gpu_check_ddp.json" || status=$?
if [[ $status -eq 0 ]]; then echo "== gpu_check: all checks passed"; else echo "== gpu_check: FAILED (exit $status)"; fi
exit $status
