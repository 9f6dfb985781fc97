#!/usr/bin/env bash
# The GPU checks of issues 35 and 36, as one script for a lent one-GPU machine (no network
# there: lark travels as a wheel in .whl/, see ../.library/device/README.md). Writes under
# $OUT. The 1.1B Llama's plan is benchmarks/data/gpu_llama_1b.plan.json (tracing the model
# takes a minute; recompile it with the command in benchmarks/data/gpu_measured_h200.json).
#   bash benchmarks/gpu_rehearse.sh          # every part; PARTS="1 3" bash ... for some
set -u
OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT" .gpu
LLAMA_1B=benchmarks/data/gpu_llama_1b.plan.json
export PYTHONUNBUFFERED=1
if ! python3 -c "import lark" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD
F="python3 -m fivedc.cli.main"
PARTS=${PARTS:-1 2 3 4 5}
want() { [[ " $PARTS " == *" $1 "* ]]; }
exec > >(tee -a "$OUT/log.txt") 2>&1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"
[ -f .gpu/llama8b.plan.json ] || $F compile benchmarks/llama3_8b.5d --mesh 1x4x1x1x1 --microbatches 8 --gpu h200 -q -o .gpu/llama8b.plan.json
want 1 && echo "== 1. the 1.1B Llama rehearsed on the GPU: CUDA peak and seconds by kind against the h200 estimate"
want 1 && timeout 120 $F rehearse "$LLAMA_1B" --device cuda --report "$OUT/rehearse_llama1b.json"
want 2 && echo "== 2. calibrate on a 0.4B Llama of another shape"
want 2 && timeout 120 $F rehearse benchmarks/gpu_calibrate.5d --mesh 1x1x1x1x1 --device cuda --calibrate "$OUT/h200_measured.toml"
want 3 && echo "== 3. fivedc run of the 1.1B plan (NCCL, one rank, bf16): the measured step"
want 3 && timeout 150 $F run "$LLAMA_1B" --steps 8 --report "$OUT/run_llama1b.json" --force
want 4 && echo "== 4. kernels at the shapes plans make"
want 4 && timeout 90 python3 benchmarks/gpu_kernels.py --json "$OUT/gpu_kernels.json"
want 5 && echo "== 5. Llama 3 8B, four pipeline stages, each rehearsed on the GPU"
want 5 && timeout 200 $F rehearse .gpu/llama8b.plan.json --device cuda --report "$OUT/rehearse_llama8b.json"
echo "== done"
