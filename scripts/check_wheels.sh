#!/usr/bin/env bash
# Build every distribution's sdist and wheel, install the wheels (not editable) into a fresh
# virtual environment, and check the installed result: metadata, py.typed, entry points,
# `verl backends`, and the conformance suite on one backend.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
DIST=$(mktemp -d)
FRESH=$(mktemp -d)/venv
trap 'rm -rf "$DIST" "$(dirname "$FRESH")"' EXIT

DISTS=(packages/verl-core packages/verl-hf packages/verl-megatron packages/verl-vllm conformance)
[ -f examples/third-party-backend/pyproject.toml ] && DISTS+=(examples/third-party-backend)
UV=("$VENV/bin/uv" --quiet)  # scripts/setup.sh installs uv beside the project
for d in "${DISTS[@]}"; do
  "${UV[@]}" build --sdist --wheel --out-dir "$DIST" "$d" >/dev/null
done
ls "$DIST"
# Each distribution's sdist carries its changelog.
for d in verl_core verl_hf verl_megatron verl_vllm verl_conformance; do
  grep -q '^[^/]*/CHANGELOG.md$' < <(tar tzf "$DIST"/$d-*.tar.gz) || { echo "$d sdist: no CHANGELOG.md"; exit 1; }
done

"$VENV/bin/python" - "$DIST" <<'PY'
import sys, zipfile, pathlib, email
for whl in sorted(pathlib.Path(sys.argv[1]).glob("*.whl")):
    z = zipfile.ZipFile(whl)
    names = z.namelist()
    meta = email.message_from_bytes(z.read(next(n for n in names if n.endswith("METADATA"))))
    pkg = whl.name.split("-")[0]
    problems = []
    if not any(n.endswith("py.typed") for n in names): problems.append("no py.typed")
    if "Typing :: Typed" not in meta.get_all("Classifier", []): problems.append("no Typing :: Typed classifier")
    if not meta.get("License-Expression") and not meta.get("License"): problems.append("no license")
    if len(meta.get_payload() or "") < 20: problems.append("no long description")
    eps = [n for n in names if n.endswith("entry_points.txt")]
    if pkg.startswith("verl_") and pkg not in ("verl_core", "verl_conformance") and not eps:
        problems.append("no entry points")
    print(f"{whl.name}: {'ok' if not problems else ', '.join(problems)}")
    if problems: sys.exit(1)
PY

python3 -m venv "$FRESH"
PIP=("$FRESH/bin/python" -m pip --disable-pip-version-check -q)
INSTALL=("${UV[@]}" pip install --compile-bytecode --python "$FRESH/bin/python")  # .pyc as pip writes them
# Engines are heavy; the check installs the distributions whose tests it runs (core, hf,
# conformance, the example backend) plus megatron's and vllm's wheels without their engines.
# pip installs torch (on CPU machines from the local wheel folder pip.conf names, which uv does not read).
if command -v nvidia-smi >/dev/null 2>&1; then TORCH="torch>=2.11"; else TORCH="torch==2.13.0+cpu"; fi
"${PIP[@]}" install "$TORCH" 2>&1 | grep -v "^WARNING: Location" || true
"${INSTALL[@]}" "$TORCH" "$DIST"/verl_core-*.whl "$DIST"/verl_hf-*.whl "$DIST"/verl_conformance-*.whl \
  $(ls "$DIST"/verl_example_backend-*.whl 2>/dev/null)
"${INSTALL[@]}" --no-deps "$DIST"/verl_megatron-*.whl "$DIST"/verl_vllm-*.whl
"${UV[@]}" pip uninstall --python "$FRESH/bin/python" torchvision torchaudio torchcodec triton >/dev/null 2>&1 || true
"$FRESH/bin/verl" --version
"$FRESH/bin/verl" backends
# The suite from the installed wheel, outside the source tree.
backend=${CHECK_BACKEND:-hf}
(cd "$(dirname "$FRESH")" && HF_HUB_OFFLINE=1 "$FRESH/bin/python" -m pytest -q -p no:cacheprovider --pyargs verl_conformance --verl-backend "$backend" -x)
