#!/usr/bin/env bash
# The device command (docs/bench.md#on-a-gpu): install what hf_tev needs from the carried wheels (no index, no
# network), then run benchmarks/gpu_check.py under a time limit, its JSON and log in $OUT (or ./gpu_out).
#
#     run(command="bash benchmarks/gpu_check.sh", carry=["gpu_wheels"], timeout_s=480)
#
# Extra arguments go to gpu_check.py. GPU_CHECK_LIMIT_S (default 400) bounds the check itself; its sections
# past --time-budget (default 330 s) are skipped, and the JSON is rewritten after every section.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu_out}
wheels=${GPU_WHEELS:-gpu_wheels}
mkdir -p "$out"
{
    echo "== image: $(python --version 2>&1), $(python -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.is_available())' 2>&1)"
    python -c 'import transformers; print("image transformers", transformers.__version__)' 2>&1
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1
} | tee "$out/environment.txt"
# Only what the image lacks or has too old is installed; --no-index: the folder is the only source.
PIP_BREAK_SYSTEM_PACKAGES=1 python -m pip install --quiet --no-index --find-links "$wheels" \
    -r benchmarks/gpu_requirements.txt \
    2>&1 | tee "$out/install.txt"
python -m pip check 2>&1 | tee -a "$out/install.txt"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
timeout --signal=INT --kill-after=20 "${GPU_CHECK_LIMIT_S:-400}" \
    python benchmarks/gpu_check.py --output "$out/gpu_check.json" "$@" 2>&1 | tee "$out/gpu_check.log"
status=${PIPESTATUS[0]}
echo "== gpu_check.py exit status $status" | tee -a "$out/gpu_check.log"
exit "$status"
