#!/usr/bin/env bash
# Builds .extras/extras.tar.xz: transformers 5.24 (Llama / Mixtral / Qwen3-MoE model files only) and torchtitan
# 0.3.0 (without experiments) with their pure-Python dependencies, for the offline H200 (Python 3.12, ~4.6 MB, so
# it fits beside the 58 MB device kit in one 64 MiB call).  Needs pip and a local install of transformers 5.24.
# On the device:  mkdir -p /tmp/xs && tar -xJf .extras/extras.tar.xz -C /tmp/xs && export PYTHONPATH=$PYTHONPATH:/tmp/xs
# then TT_TORCH_SHIM=1 python -m pytest -m gpu tests/test_integrations.py   (carry [".devkit", ".extras"])
# The shim (tools/device_torch_shim.py, installed as sitecustomize) stubs the three names torchtitan 0.3.0 imports
# from torch >= 2.12 that the device's torch 2.11 lacks; only torchtitan's parallelism helpers use them.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d)
dl() { python3 -m pip download -q --no-deps --python-version 3.12 --only-binary=:all: \
         --platform manylinux2014_x86_64 -d "$work/whl" "$@"; }
dl torchtitan==0.3.0 tyro docstring_parser spmd_types typeguard transformers==5.24.0 huggingface_hub==1.33.0 \
   safetensors regex pyyaml tqdm httpx==0.28.1 httpcore h11 anyio idna certifi sniffio
mkdir -p "$work/site"
for w in "$work"/whl/*.whl; do python3 -m zipfile -e "$w" "$work/site"; done
tf_src=$(python3 -c "import transformers, os; print(os.path.dirname(transformers.__file__))")
rm -rf "$work/site/transformers/models" "$work/site/torchtitan/experiments"
mkdir "$work/site/transformers/models"
for m in __init__.py auto llama mixtral qwen3_moe; do cp -r "$tf_src/models/$m" "$work/site/transformers/models/"; done
cp "$root/tools/device_torch_shim.py" "$work/site/sitecustomize.py"
find "$work/site" -name __pycache__ -prune -exec rm -rf {} +
mkdir -p "$root/.extras"
tar -cJf "$root/.extras/extras.tar.xz" -C "$work/site" .
grep -qx ".extras" "$root/.git/info/exclude" 2>/dev/null || echo ".extras" >> "$root/.git/info/exclude"
ls -la "$root/.extras/extras.tar.xz"
rm -rf "$work"
