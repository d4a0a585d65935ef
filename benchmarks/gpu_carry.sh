#!/usr/bin/env bash
# Download into gpu_wheels/ (git-ignored) every wheel benchmarks/gpu_requirements.txt needs, for a Linux x86_64
# device whose image has a CUDA torch and no network: transformers 5.24 and its dependencies, for each Python in
# GPU_PYTHONS (default "3.11 3.12 3.13"; transformers 5.24 needs >= 3.11). numpy is left out (about 17 MB per Python;
# the image's torch and transformers already need it) unless GPU_CARRY_NUMPY=1. The folder is one carry path of
# the device tool (64 MiB in all): the script fails when it grows past GPU_CARRY_MAX_MIB (default 60).
#
#     bash benchmarks/gpu_carry.sh [DEST]        # then: bash benchmarks/gpu_check.sh on the device (docs/bench.md)
set -euo pipefail
cd "$(dirname "$0")/.."
dest=${1:-gpu_wheels}
pythons=${GPU_PYTHONS:-"3.11 3.12 3.13"}
mkdir -p "$dest"
# accelerate needs torch, which the image has (and which is over 2 GB with its CUDA wheels): it is downloaded
# without its dependencies, and the one of them the rest does not bring (psutil) is named.
grep -v '^accelerate' benchmarks/gpu_requirements.txt > "$dest/.requirements-without-torch.txt"
for python in $pythons; do
    # --only-binary with --platform: wheels for the device, whatever this machine is; the resolver brings
    # every dependency (pure-Python wheels once, compiled ones per Python).
    device=(--dest "$dest" --only-binary=:all: --implementation cp --python-version "$python"
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
    python -m pip download --quiet "${device[@]}" -r "$dest/.requirements-without-torch.txt"
    python -m pip download --quiet "${device[@]}" --no-deps "$(grep '^accelerate' benchmarks/gpu_requirements.txt)" psutil
done
rm "$dest/.requirements-without-torch.txt"
if [ "${GPU_CARRY_NUMPY:-0}" != 1 ]; then
    rm -f "$dest"/numpy-*.whl
fi
size=$(du -sm "$dest" | cut -f1)
echo "gpu_carry: $(ls "$dest" | wc -l) wheels, ${size} MiB in $dest (Pythons: $pythons)"
if [ "$size" -gt "${GPU_CARRY_MAX_MIB:-60}" ]; then
    echo "gpu_carry: $dest is over ${GPU_CARRY_MAX_MIB:-60} MiB: carry fewer Pythons (GPU_PYTHONS)" >&2
    exit 1
fi
