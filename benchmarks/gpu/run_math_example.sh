#!/usr/bin/env bash
# The math example (examples/math, docs/math-example.md) for a few GRPO steps on a random 0.89B
# Llama-shaped model, on one CUDA GPU in bfloat16 with TensorBoard logging; prints a summary of the
# metrics (wall time per step, reward, evaluation) and saves it with the run's files under $OUT.
#
# Here, on the CPU machine, once: the project's wheels (benchmarks/gpu/prepare.sh), then the
# `datasets` library's wheels (4.8.5, as carried before), which the GPU image lacks:
#   bash benchmarks/gpu/prepare.sh && bash benchmarks/gpu/run_math_example.sh --wheels
# On the GPU machine, from the repository root with .whl carried (or with the project installed):
#   bash benchmarks/gpu/run_math_example.sh [STEPS (default 5)] [key=value overrides of verl train...]
# Writes under $OUT (default /tmp/out): math-summary.md, math-summary.json, math-metrics.jsonl,
# math-train.log and math-tensorboard.tar.gz (the event files: tensorboard --logdir on the unpacked folder).
# MATH_MODEL (default /tmp/math-model-0.9b, built when missing) and MATH_RUN (/tmp/math-run) set the
# folders. A CPU dry run of the script: make a tiny model (make_model.py --size tiny --out DIR), then
#   MATH_MODEL=DIR bash benchmarks/gpu/run_math_example.sh 2 model.device=cpu model.dtype=float32 \
#     rollout.n=2 batch.prompts_per_step=2 rollout.max_new_tokens=8
set -euo pipefail
cd "$(dirname "$0")/../.."

if [ "${1:-}" = "--wheels" ]; then  # CPU side: datasets and the two packages of its that the GPU image lacks
  mkdir -p .whl
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl "datasets==4.8.5" "dill==0.4.1" "multiprocess==0.70.19"
  ls -la .whl
  exit 0
fi

STEPS=${1:-5}
[ $# -gt 0 ] && shift
OUT=${OUT:-/tmp/out}
MODEL=${MATH_MODEL:-/tmp/math-model-0.9b}
RUN=${MATH_RUN:-/tmp/math-run}
mkdir -p "$OUT"
if ls .whl/verl_core-*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} PATH=/tmp/site/bin:$PATH
fi
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
python3 -c "import datasets, tensorboard, torch, transformers, verl_core, verl_hf; print('torch', torch.__version__, 'transformers', transformers.__version__, 'datasets', datasets.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else 'no CUDA device')" \
  || { echo "missing packages: run benchmarks/gpu/prepare.sh and '$0 --wheels' on the CPU machine and carry .whl" >&2; exit 1; }

t0=$SECONDS
[ -f "$MODEL/model.safetensors" ] || python3 examples/math/make_model.py --size 0.9b --out "$MODEL"
echo "model ready in $((SECONDS - t0))s: $MODEL"

t0=$SECONDS
rc=0
verl train examples/math/config.toml "model.path=\"$MODEL\"" "output_dir=\"$RUN\"" overwrite=true \
  "steps=$STEPS" data.eval_every=0 checkpoint.final=false logging.progress=false "$@" \
  2>&1 | tee "$OUT/math-train.log" || rc=$?
wall=$((SECONDS - t0))
echo "verl train exited $rc after ${wall}s"
[ -f "$RUN/metrics.jsonl" ] && cp "$RUN/metrics.jsonl" "$OUT/math-metrics.jsonl"
[ -d "$RUN/tensorboard" ] && tar -czf "$OUT/math-tensorboard.tar.gz" -C "$RUN" tensorboard

python3 - "$RUN" "$OUT" "$wall" "$STEPS" <<'EOF'
import json
import statistics
import sys
from pathlib import Path

run, out, wall, steps = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
path = run / "metrics.jsonl"
rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
keys = ["time/step", "time/rollout", "time/update", "reward/mean", "response/length_mean", "throughput/tokens_per_s"]
later = [r["time/step"] for r in rows[1:]] or [r["time/step"] for r in rows]
summary = {
    "steps_asked": steps,
    "steps_done": len(rows),
    "verl_train_wall_s": wall,
    "step_s_median_after_first": statistics.median(later) if later else None,
    "steps": [{"step": r["step"], **{k: r.get(k) for k in keys}} for r in rows],
    "eval": {k: v for r in rows for k, v in r.items() if k.startswith("eval/") or k == "time/eval"},
}
(out / "math-summary.json").write_text(json.dumps(summary, indent=1) + "\n")
lines = [f"# Math example: {len(rows)} of {steps} steps, verl train {wall} s wall", "",
         "| step | " + " | ".join(keys) + " |", "|---" * (len(keys) + 1) + "|"]
for r in summary["steps"]:
    lines.append(f"| {r['step']} | " + " | ".join("" if r[k] is None else f"{r[k]:.4g}" for k in keys) + " |")
lines += ["", f"median time/step after the first: {summary['step_s_median_after_first']}", "",
          "evaluation (after the last step): " + ", ".join(f"{k} = {v:.4g}" for k, v in sorted(summary["eval"].items()))]
(out / "math-summary.md").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
EOF
exit $rc
