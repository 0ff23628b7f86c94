#!/usr/bin/env bash
# The math example (examples/math, docs/math-example.md) for a few GRPO steps on a random 0.89B
# Llama-shaped model, on one CUDA GPU in bfloat16 with TensorBoard logging; prints a summary of the
# metrics (wall time per step, reward, evaluation) and saves it with the run's files under $OUT.
# With --tool: an SFT warm start on conversations that call the Python tool, then GRPO with the tool.
#
# Here, on the CPU machine, once: the project's wheels, annotated-types and the `datasets` library's
# wheels (4.8.5), which the GPU image lacks:
#   bash benchmarks/gpu/prepare.sh
# On the GPU machine, from the repository root with .whl carried (or with the project installed):
#   bash benchmarks/gpu/run_math_example.sh [STEPS (default 5)] [key=value overrides of verl train...]
# Writes under $OUT (default /tmp/out): math-summary.md, math-summary.json, math-metrics.jsonl,
# math-train.log and math-tensorboard.tar.gz (the event files: tensorboard --logdir on the unpacked folder).
# MATH_MODEL (default /tmp/math-model-0.9b, built when missing) and MATH_RUN (/tmp/math-run) set the
# folders. A CPU dry run of the script: make a tiny model (make_model.py --size tiny --out DIR), then
#   MATH_MODEL=DIR bash benchmarks/gpu/run_math_example.sh 2 model.device=cpu model.dtype=float32 \
#     rollout.n=2 batch.prompts_per_step=2 rollout.max_new_tokens=8
#
# With the Python tool (docs/math-example.md, "With the Python tool"), `--tool` first:
#   bash benchmarks/gpu/run_math_example.sh --tool [STEPS (default 5)] [key=value overrides of verl train...]
# first runs the SFT warm start on tool conversations (examples/math/sft_tool.toml; MATH_SFT_ARGS
# holds key=value overrides of verl sft, e.g. "steps=100", and MATH_SFT_RUN, default
# /tmp/math-sft-tool, sets its folder), then the GRPO steps in multi-turn episodes with the tool
# (examples/math/config_tool.toml) from the SFT model. The summary breaks each GRPO step down: the
# rollout (time/rollout) into the generation and the time in the tool calls (time/environment),
# the update (time/update), and the tool calls and errors per episode; it also gives the SFT's
# steps, loss and time. Also writes math-sft.log and math-sft-metrics.jsonl. A CPU dry run:
#   MATH_MODEL=DIR MATH_SFT_ARGS="model.device=cpu model.dtype=float32 steps=100 optim.lr=3e-3" \
#     bash benchmarks/gpu/run_math_example.sh --tool 2 model.device=cpu model.dtype=float32 \
#     rollout.n=2 batch.prompts_per_step=4 'data.eval=""'
set -euo pipefail
cd "$(dirname "$0")/../.."

if [ "${1:-}" = "--wheels" ]; then  # CPU side: what the GPU image lacks (datasets and two packages of its, with this project's wheels)
  bash benchmarks/gpu/prepare.sh
  exit 0
fi

TOOL=0
if [ "${1:-}" = "--tool" ]; then
  TOOL=1
  shift
fi
STEPS=${1:-5}
[ $# -gt 0 ] && shift
OUT=${OUT:-/tmp/out}
MODEL=${MATH_MODEL:-/tmp/math-model-0.9b}
RUN=${MATH_RUN:-/tmp/math-run}
SFT_RUN=${MATH_SFT_RUN:-/tmp/math-sft-tool}
read -r -a SFT_ARGS <<< "${MATH_SFT_ARGS:-}"
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

CONFIG=examples/math/config.toml
POLICY=$MODEL
sft_wall=-1
rc=0
if [ "$TOOL" = 1 ]; then  # the SFT warm start on tool conversations; GRPO starts from its exported model
  t0=$SECONDS
  verl sft examples/math/sft_tool.toml "model.path=\"$MODEL\"" "output_dir=\"$SFT_RUN\"" overwrite=true \
    logging.progress=false ${SFT_ARGS[@]+"${SFT_ARGS[@]}"} 2>&1 | tee "$OUT/math-sft.log" || rc=$?
  sft_wall=$((SECONDS - t0))
  echo "verl sft exited $rc after ${sft_wall}s"
  [ -f "$SFT_RUN/metrics.jsonl" ] && cp "$SFT_RUN/metrics.jsonl" "$OUT/math-sft-metrics.jsonl"
  [ "$rc" = 0 ] || exit "$rc"
  CONFIG=examples/math/config_tool.toml
  POLICY=$SFT_RUN/model-sft
fi

t0=$SECONDS
verl train "$CONFIG" "model.path=\"$POLICY\"" "output_dir=\"$RUN\"" overwrite=true \
  "steps=$STEPS" data.eval_every=0 checkpoint.final=false logging.progress=false "$@" \
  2>&1 | tee "$OUT/math-train.log" || rc=$?
wall=$((SECONDS - t0))
echo "verl train exited $rc after ${wall}s"
[ -f "$RUN/metrics.jsonl" ] && cp "$RUN/metrics.jsonl" "$OUT/math-metrics.jsonl"
[ -d "$RUN/tensorboard" ] && tar -czf "$OUT/math-tensorboard.tar.gz" -C "$RUN" tensorboard

python3 - "$RUN" "$OUT" "$wall" "$STEPS" "$TOOL" "$SFT_RUN" "$sft_wall" <<'EOF'
import json
import statistics
import sys
from pathlib import Path

run, out, wall, steps = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
tool, sft_run, sft_wall = sys.argv[5] == "1", Path(sys.argv[6]), int(sys.argv[7])


def read(folder):
    path = folder / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def cell(value):
    return "" if value is None else f"{value:.4g}"


rows = read(run)
keys = ["time/step", "time/rollout", "time/update", "reward/mean", "response/length_mean", "throughput/tokens_per_s"]
if tool:  # the step broken down: the rollout is the generation plus the time in the tool calls
    keys = ["time/step", "time/rollout", "generation", "time/environment", "time/update", "agent/turns",
            "agent/tool_calls", "agent/tool_errors", "agent/tool_timeouts", "reward/mean", "response/length_mean"]
    for r in rows:
        if "time/rollout" in r and "time/environment" in r:
            r["generation"] = r["time/rollout"] - r["time/environment"]
later = [r["time/step"] for r in rows[1:]] or [r["time/step"] for r in rows]
summary = {
    "mode": "tool" if tool else "single-turn",
    "steps_asked": steps,
    "steps_done": len(rows),
    "verl_train_wall_s": wall,
    "step_s_median_after_first": statistics.median(later) if later else None,
    "steps": [{"step": r["step"], **{k: r.get(k) for k in keys}} for r in rows],
    "eval": {k: v for r in rows for k, v in r.items() if k.startswith("eval/") or k == "time/eval"},
}
lines = [f"# Math example: {len(rows)} of {steps} steps, verl train {wall} s wall"]
if tool:
    sft = read(sft_run)
    sft_later = [r["time/step"] for r in sft[1:]] or [r["time/step"] for r in sft]
    summary["sft"] = s = {
        "steps_done": len(sft), "verl_sft_wall_s": sft_wall,
        "loss_first": sft[0].get("train/loss") if sft else None, "loss_last": sft[-1].get("train/loss") if sft else None,
        "step_s_median_after_first": statistics.median(sft_later) if sft_later else None,
    }
    lines = [f"# Math example with the Python tool: SFT {len(sft)} steps, then {len(rows)} of {steps} GRPO steps", "",
             f"SFT warm start (sft_tool.toml): verl sft {sft_wall} s wall, train/loss {cell(s['loss_first'])} -> "
             f"{cell(s['loss_last'])}, median time/step after the first {cell(s['step_s_median_after_first'])} s", "",
             f"GRPO with the tool (config_tool.toml): verl train {wall} s wall. Seconds per step: time/rollout is the "
             "whole multi-turn rollout, generation plus time/environment (the tool calls); agent/... are means per "
             "episode."]
(out / "math-summary.json").write_text(json.dumps(summary, indent=1) + "\n")
lines += ["", "| step | " + " | ".join(keys) + " |", "|---" * (len(keys) + 1) + "|"]
for r in summary["steps"]:
    lines.append(f"| {r['step']} | " + " | ".join(cell(r[k]) for k in keys) + " |")
lines += ["", f"median time/step after the first: {summary['step_s_median_after_first']}", "",
          "evaluation (after the last step): " + ", ".join(f"{k} = {v:.4g}" for k, v in sorted(summary["eval"].items()))]
(out / "math-summary.md").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
EOF
exit $rc
