#!/usr/bin/env bash
# Installs the peers that benchmarks/bench_loader.py runs side by side: FFCV 1.0.2 and NVIDIA DALI (CPU-only here).
# They go into their own venv, .venv-peers, which sees the project's .venv (torch, lightning_fastdata) through a .pth
# file, so the test environment is never changed. Needs root for the system libraries FFCV builds against.
#
#   bash benchmarks/install_peers.sh && .venv-peers/bin/python benchmarks/bench_loader.py
set -euo pipefail
cd "$(dirname "$0")/.."
test -x .venv/bin/python || make venv
if ! dpkg -s libturbojpeg0-dev libopencv-dev pkg-config >/dev/null 2>&1; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq pkg-config libturbojpeg0-dev libopencv-dev >/dev/null
fi
test -x .venv-peers/bin/python || python3 -m venv .venv-peers
base=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
peers=$(.venv-peers/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
# "import" lines of a .pth run at start-up: addsitedir also runs the base venv's own .pth files (the editable install)
echo "import site; site.addsitedir('$base')" > "$peers/lightning_fastdata_base.pth"
# FFCV builds from its sdist (no wheels); numba and numpy as FFCV 1.0.2 runs with them today
.venv-peers/bin/pip install --quiet "numpy>=2" "numba>=0.60" "ffcv==1.0.2" "nvidia-dali-cuda120"
.venv-peers/bin/python -c "import ffcv, nvidia.dali; print('peers: ffcv', ffcv.__version__, '/ dali', nvidia.dali.__version__)"
