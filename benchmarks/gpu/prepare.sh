#!/usr/bin/env bash
# Here (CPU machine): put the wheels the GPU machine needs into .whl (git-ignored): megatron-core
# 0.19.2 for Python 3.12 and this project's own wheels.
set -euo pipefail
cd "$(dirname "$0")/../.."
grep -qx '/.whl/' .git/info/exclude || echo /.whl/ >> .git/info/exclude
mkdir -p .whl
rm -f .whl/verl_*.whl
ls .whl/megatron_core-0.19.2-*.whl >/dev/null 2>&1 || python3 -m pip download -q --no-deps --only-binary=:all: \
  --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 \
  -d .whl megatron-core==0.19.2
# peft (verl-hf's LoRA), accelerate (which peft imports) and annotated-types (verl-core): pure-Python wheels
ls .whl/peft-*.whl >/dev/null 2>&1 || python3 -m pip download -q --no-deps --only-binary=:all: -d .whl \
  "peft==$(.venv/bin/python -c 'import peft; print(peft.__version__)')" \
  "accelerate==$(.venv/bin/python -c 'import accelerate; print(accelerate.__version__)')"
ls .whl/annotated_types-*.whl >/dev/null 2>&1 || python3 -m pip download -q --no-deps --only-binary=:all: -d .whl \
  "annotated-types==$(.venv/bin/python -c 'from importlib.metadata import version; print(version("annotated-types"))')"
# datasets (verl's data loading) and TRL 1.16.0 (the other side of bench_grpo_vs_trl.py), which the GPU
# image lacks, with the two packages of datasets' it lacks too (the rest of TRL's needs are there)
# psutil (the conformance suite's process checks): the GPU image may lack it
ls .whl/psutil-*.whl >/dev/null 2>&1 || python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl "psutil==$(.venv/bin/python -c 'import psutil; print(psutil.__version__)')"
# pytest-xdist and execnet (the conformance step's CONF_WORKERS): pure-Python wheels
ls .whl/pytest_xdist-*.whl >/dev/null 2>&1 || python3 -m pip download -q --no-deps --only-binary=:all: -d .whl \
  "pytest-xdist==$(.venv/bin/python -c 'import xdist; print(xdist.__version__)')" \
  "execnet==$(.venv/bin/python -c 'import execnet; print(execnet.__version__)')"
ls .whl/trl-*.whl >/dev/null 2>&1 || python3 -m pip download -q --no-deps --only-binary=:all: -d .whl "trl==1.16.0"
ls .whl/datasets-*.whl >/dev/null 2>&1 || python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl "datasets==4.8.5" "dill==0.4.1" "multiprocess==0.70.19"
# the decode before cache windows and the decode kernel (commit 1170138, the code whose 2048-token decode
# ran at 21k tokens/s on an H200): verl-core and verl-hf wheels in .whl-today, the baseline of
# run.sh decode-today
today=1170138
grep -qx '/.whl-today/' .git/info/exclude || echo /.whl-today/ >> .git/info/exclude
if [ "$(cat .whl-today/commit 2>/dev/null)" != "$today" ]; then
  rm -rf .whl-today /tmp/verl-today-src && mkdir -p .whl-today
  git worktree add -q --detach /tmp/verl-today-src "$today"
  for d in packages/verl-core packages/verl-hf; do
    .venv/bin/python -m build -q --wheel --outdir .whl-today "/tmp/verl-today-src/$d" >/dev/null
  done
  git worktree remove --force /tmp/verl-today-src
  echo "$today" > .whl-today/commit
fi
for d in packages/verl-core packages/verl-hf packages/verl-megatron packages/verl-vllm conformance; do
  .venv/bin/python -m build -q --wheel --outdir .whl "$d" >/dev/null
done
ls -la .whl
