#!/usr/bin/env bash
# Numerics check of an exported folder on onnxruntime's aarch64 build, under QEMU user-mode
# emulation, against this machine's x86-64 run. Timings under emulation are NOT device timings.
#   bash devices/arm64_check.sh FOLDER [--tokens 16] [--cpu cortex-a76] [--json out.json] [--atol 1e-3]
# Needs root (apt-get install qemu-user-static debootstrap; unshare -m + bind mount of /proc/cpuinfo).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
py="${PYTHON:-$here/.venv/bin/python}"
[ -x "$py" ] || py=python3
cd "$here"
exec "$py" -m edgeprune_devices.arm64_check "$@"
