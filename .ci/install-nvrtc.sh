#!/usr/bin/env bash
# Installs NVRTC (libnvrtc.so.13, from PyPI's `nvidia-cuda-nvrtc` wheel) into a cache dir, so
# that `cargo xtask check-kernels` can compile every CUDA kernel on a machine with no GPU and no
# CUDA toolkit. Prints the directory to put on LD_LIBRARY_PATH (the only line on stdout).
#
#   export LD_LIBRARY_PATH="$(.ci/install-nvrtc.sh)${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
#
# NVRTC_VERSION pins the wheel (default 13.0.*, the CUDA version the backend binds by default);
# NVRTC_DIR is the install dir (default ~/.cache/kiln/nvrtc-<version>).
set -euo pipefail
version="${NVRTC_VERSION:-13.0.*}"
dir="${NVRTC_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/kiln/nvrtc-${version//\*/x}}"
lib="$dir/nvidia/cu13/lib"
if [ ! -e "$lib/libnvrtc.so.13" ]; then
    py="$(command -v python3 || command -v python)"
    "$py" -m pip install --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
        --target "$dir" "nvidia-cuda-nvrtc==$version" >&2
fi
if [ ! -e "$lib/libnvrtc.so.13" ]; then
    echo "install-nvrtc: libnvrtc.so.13 not found under $dir after install" >&2
    exit 1
fi
echo "$lib"
