#!/usr/bin/env bash
# One-device accelerator check for training: parity of the fused attention against the fp32
# reference, train-step tokens/s and MFU (fused vs XLA attention) for a Qwen3-8B-shaped step,
# peak device memory and the DFlash decode step cost ratio. Prints one JSON line on stdout
# (progress on stderr); under 8 minutes on one H100/H200. See bench/device_check.py.
#
#   bash bench/device_check.sh            # Qwen3-8B shapes, bf16, on the first accelerator
#   bash bench/device_check.sh --tiny     # tiny shapes, any machine (CPU: a few minutes)
#   bash bench/device_check.sh --parts=step   # a subset: parity, step, decode
#   timeout -s ABRT 300 bash bench/device_check.sh   # on a new machine: a hang prints its stacks
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# One device, and let JAX take most of its memory up front (the step is sized to fit one).
export CUDA_VISIBLE_DEVICES="${CUDA_VISIBLE_DEVICES:-0}"
export XLA_PYTHON_CLIENT_MEM_FRACTION="${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.92}"
# Python's fault handler prints every thread's stack on SIGABRT, so a check stopped by
# `timeout -s ABRT` says where it hung (its first H200 run printed nothing before its timeout).
export PYTHONFAULTHANDLER=1
python="$(command -v python || command -v python3)"
echo "[device_check.sh $(date +%H:%M:%S)] $python, importing jax and the project" >&2
exec "$python" "$here/device_check.py" "$@"
