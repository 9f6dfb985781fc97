#!/usr/bin/env bash
# The GPU checks of issue 19, as one script for a lent one-GPU machine (no network there:
# lark travels as a wheel in .whl/, see ../.library/device/README.md). Writes under $OUT.
#   bash benchmarks/gpu_session.sh
set -u
OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if ! python3 -c "import lark" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"
echo "== 1. fivedc verify on the GPU (NCCL, one rank, float64)"
timeout 90 python3 -m fivedc.cli.main verify examples/tiny_llama.5d --mesh 1x1x1x1x1 2>&1 | tail -4
echo "== 2. CUDA memory against the plan's estimate (fivedc run --report, bf16, 0.44B Llama)"
for rc in none full; do
  timeout 90 python3 -m fivedc.cli.main run benchmarks/gpu_llama.py:memory_factory --mesh 1x1x1x1x1 --dtype bf16 \
    --steps 3 --recompute $rc --report "$OUT/memory_$rc.json" 2>&1 | tail -8
done
echo "== 3. 1.1B Llama, bf16 autocast, fp32 master weights: eager, torch.compile, fivedc, fivedc+compile"
timeout 300 python3 benchmarks/gpu_llama.py --steps 10 --warmup 3 --json "$OUT/gpu_llama.json" 2>&1 | grep -v Warning
