#!/usr/bin/env bash
# Build the separate virtual environment for benchmarks/max_peer.py and benchmarks/max_manager_peer.py.
#
# Modular MAX is never a dependency of sparsekv: it lives only in .venv-max at
# the repository root, next to a CPU build of torch and an editable sparsekv, so
# that the peer benchmark can check MAX's kernels against sparsekv's reference
# in one process.
#
# Usage:  bash benchmarks/setup_max_peer.sh            (from anywhere)
#         PYTHON=python3.11 bash benchmarks/setup_max_peer.sh
#
# torch is pinned exactly, and repeated on every pip line: a looser spec lets
# pip pick a CUDA build of several GB, and sparsekv's own `torch>=2.4` would
# happily accept one.
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv_dir="${repo_root}/.venv-max"
python_bin="${PYTHON:-python3}"
max_pin="max==26.7.0"
torch_pin="torch==2.13.0"

if [ ! -x "${venv_dir}/bin/python" ]; then
    "${python_bin}" -m venv "${venv_dir}"
fi
pip=("${venv_dir}/bin/python" -m pip install)

"${pip[@]}" --upgrade pip
"${pip[@]}" "${torch_pin}" numpy
"${pip[@]}" "${max_pin}" "${torch_pin}" numpy
# MAX's context and KV cache manager modules (max_manager_peer.py) import these; max itself does not pull them in.
"${pip[@]}" pydantic pillow av pyyaml "${torch_pin}"
"${pip[@]}" -e "${repo_root}" "${torch_pin}"

"${venv_dir}/bin/python" - <<'EOF'
import importlib.metadata as md
import torch
import max.graph  # noqa: F401  (fails here, not in the benchmark, if MAX is broken)
import sparsekv
print("max", md.version("max"), "| torch", torch.__version__, "| sparsekv", sparsekv.__version__)
EOF
echo "MAX peer environment ready: ${venv_dir}/bin/python benchmarks/max_peer.py --help"
