#!/usr/bin/env bash
# On the GPU machine: install the carried wheels (.whl: megatron-core and this project's wheels,
# built by benchmarks/gpu/prepare.sh), then run one step: conformance | bench | grpo | lora | async | decode-long |
# decode-today | profile-decode | profile-prefill | profile-update | vs-trl | targets | levers | pending | ragged.
# Usage: bash benchmarks/gpu/run.sh conformance|bench|grpo|lora|async|decode-long|decode-today|profile-decode|profile-prefill|profile-update|vs-trl|targets|levers|pending|ragged [args]   (writes under $OUT)
#   conformance BACKEND...: CONF_DTYPES (default "float32 bfloat16"), CONF_TIMEOUT (s a dtype, default 300: the whole suite took about 130 s on an H100), CONF_OPTIONS
#   (a JSON object passed as --verl-options), CONF_TAG (suffix of the log names), CONF_K (pytest -k: some checks only),
#   CONF_WORKERS (pytest-xdist processes sharing the GPU: each engine's compile runs on its own CPU core),
#   CONF_DIST (their distribution, default load: check by check; loadscope kept TestNumerics on one worker)
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
# install once per machine: later calls of this script in the same command reuse /tmp/site
if [ ! -f /tmp/site/.verl-wheels ] || [ "$(cat /tmp/site/.verl-wheels)" != "$(ls -l .whl)" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  ls -l .whl > /tmp/site/.verl-wheels
fi
export PYTHONPATH=/tmp/site HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export VERL_TESTKIT_CACHE=/tmp/verl-testkit PATH=/tmp/site/bin:$PATH
python3 -c "import torch, transformers, megatron.core, verl_core; print('torch', torch.__version__, 'transformers', transformers.__version__, 'megatron-core', megatron.core.__version__, torch.cuda.get_device_name())"
step=$1; shift
case $step in
  conformance)
    for backend in "$@"; do
      for dtype in ${CONF_DTYPES:-float32 bfloat16}; do
        t0=$SECONDS
        (cd /tmp && timeout ${CONF_TIMEOUT:-300} python3 -m pytest -v --tb=short -p no:cacheprovider --pyargs verl_conformance --verl-backend "$backend" \
           --verl-device cuda --verl-dtype "$dtype" ${CONF_WORKERS:+-n "$CONF_WORKERS" --dist "${CONF_DIST:-load}"} ${CONF_OPTIONS:+--verl-options "$CONF_OPTIONS"} ${CONF_K:+-k "$CONF_K"} \
           2>&1) > "$OUT/conformance-$backend-$dtype${CONF_TAG:-}.log"
        echo "conformance $backend $dtype ${CONF_OPTIONS:-}: rc=$? in $((SECONDS - t0))s: $(tail -1 "$OUT/conformance-$backend-$dtype${CONF_TAG:-}.log")"
      done
    done ;;
  bench) python3 benchmarks/gpu/bench_gpu.py --out "$OUT" "$@" 2>&1 | tee "$OUT/bench.log" ;;
  #   grpo ARGS: one GRPO step per stage (benchmarks/bench_step.py ARGS on CUDA), appended to grpo.log
  grpo) python3 benchmarks/bench_step.py --device cuda --no-trl "$@" 2>&1 | tee -a "$OUT/grpo.log" ;;
  #   lora ARGS: LoRA vs full fine-tuning GRPO steps (benchmarks/bench_lora.py ARGS on CUDA), appended to lora.log
  lora) python3 benchmarks/bench_lora.py --device cuda "$@" 2>&1 | tee -a "$OUT/lora.log" ;;
  #   async ARGS: asynchronous against synchronous training (benchmarks/bench_async.py ARGS on CUDA), appended to async.log
  async) python3 benchmarks/bench_async.py --device cuda "$@" 2>&1 | tee -a "$OUT/async.log" ;;
  #   decode-long ARGS: hf rollout decode tokens/s as responses grow, against the bandwidth bound
  decode-long) python3 benchmarks/gpu/bench_decode_long.py --out "$OUT" "$@" 2>&1 | tee -a "$OUT/decode_long.log" ;;
  #   decode-today ARGS: bench_decode_long.py ARGS twice in this call: the code of the decode before cache
  #   windows and the decode kernel (the wheels of .whl-today, built by prepare.sh; carry it too), then
  #   this code; prints both rows and this code's tokens/s over that code's
  decode-today)
    if [ ! -f /tmp/site-today/commit ] || [ "$(cat /tmp/site-today/commit)" != "$(cat .whl-today/commit)" ]; then
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site-today \
        .whl-today/*.whl || exit 1
      cp .whl-today/commit /tmp/site-today/commit
    fi
    PYTHONPATH=/tmp/site-today:/tmp/site python3 benchmarks/gpu/bench_decode_long.py --variant "today-$(cat .whl-today/commit)={}" \
      "$@" 2>&1 | tee -a "$OUT/decode_today.log"
    python3 benchmarks/gpu/bench_decode_long.py --variant this={} "$@" 2>&1 | tee -a "$OUT/decode_today.log"
    python3 - "$OUT/decode_today.log" <<'PY'
import sys
rows = {}
for line in open(sys.argv[1]):
    cells = [c.strip() for c in line.split("|")[1:-1]]
    if len(cells) == 13 and cells[0] != "variant" and not cells[0].startswith("-"):
        rows[(cells[0].split("-")[0], cells[2])] = float(cells[6].replace(",", ""))
for (name, length), tok_s in sorted(rows.items()):
    if name == "this" and ("today", length) in rows:
        print(f"{length} new tokens: this code {tok_s:,.0f} tok/s, the decode before cache windows "
              f"{rows[('today', length)]:,.0f} tok/s: {tok_s / rows[('today', length)]:.2f}x")
PY
    ;;
  #   pending: the open GPU measurements in one call of under 10 minutes, each under its own limit: the
  #   fused token log-probs against the eager passes (a 32,000 and a 151,936 vocabulary), the decode
  #   step's time between kernels at 256 rows, the multi-turn workload with and without its compiled step
  pending)
    timeout 100 python3 benchmarks/bench_logprobs.py --device cuda --dtype bfloat16 --chunks auto 2>&1 | tee "$OUT/logprobs.log" | grep -E "^\|"
    timeout 100 python3 benchmarks/bench_logprobs.py --device cuda --dtype bfloat16 --chunks auto --vocab 151936 --batch 4 \
      2>&1 | tee -a "$OUT/logprobs.log" | grep -E "^\|"
    timeout 150 bash "$0" profile-decode --out "$OUT/pd512" --prompts 32 --new 512 --calls 2 > /dev/null 2>&1
    head -17 "$OUT/pd512/profile_decode.md"
    for compile in "" --multi-turn-compile; do
      timeout 120 bash "$0" async --size 0.9b --workloads ragged --staleness 1 --steps 3 --repeats 1 --tool-s 0.1 \
        --turn-tokens 340 --max-turns 6 $compile --out "$OUT/async${compile:+-compile}" 2>&1 | tail -8
    done ;;
  #   ragged ARGS: 2048-token responses that end at different steps (a stop chance of 1/512 a step), the
  #   decode where finished rows attend only the slot they write against finished rows reading all they
  #   wrote, in this call (bench_decode_long.py --finished-rows-read; the card's bandwidth from its name)
  ragged)
    bw=$(nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 && echo 4.8e12 || echo 3.35e12)
    for baseline in --finished-rows-read ""; do
      python3 benchmarks/gpu/bench_decode_long.py --lengths 2048 --stop-every 512 --calls 3 --bandwidth "$bw" \
        --variant "default${baseline:+-finished-rows-read}={}" $baseline "$@" 2>&1 | tee -a "$OUT/ragged.log" | grep -E "^\|"
    done ;;
  #   profile-decode ARGS: where the hf rollout's decode step goes (benchmarks/gpu/profile_decode.py ARGS, e.g. --out "$OUT/pd")
  profile-decode) (cd "$(dirname "$0")" && python3 profile_decode.py "$@") 2>&1 | tee -a "$OUT/profile_decode.log" ;;
  #   profile-prefill ARGS: where the hf rollout's prefill goes (benchmarks/gpu/profile_prefill.py ARGS, e.g. --out "$OUT/pp")
  profile-prefill) (cd "$(dirname "$0")" && python3 profile_prefill.py "$@") 2>&1 | tee -a "$OUT/profile_prefill.log" ;;
  #   targets: the GPU performance targets in one call of under 10 minutes (about 8 on an H100): 16 x 8 x 128
  #   and 32 x 8 x 512 against TRL, the 2048-token decode against the code before cache windows (decode-today;
  #   the card's bandwidth from its name)
  targets)
    bash "$0" vs-trl --shape 0.9b-16x8x128 > /dev/null 2>&1; grep -E "^(TRL GRPOTrainer|verl train) +[0-9]|speed-up" "$OUT/vs_trl.log"
    bw=$(nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 && echo 4.8e12 || echo 3.35e12)
    bash "$0" decode-today --lengths 2048 --calls 2 --bandwidth "$bw" > /dev/null 2>&1
    grep -E "^\| (today|this)|tok/s:" "$OUT/decode_today.log"
    bash "$0" vs-trl --shape 0.9b-32x8x512 > /dev/null 2>&1; grep -E "^(TRL GRPOTrainer|verl train) +[0-9]|speed-up" "$OUT/vs_trl.log" | tail -3 ;;
  #   levers: where the 32 x 8 x 512 step goes, in one call of about 4 minutes: the decode step's parts and
  #   kernels at 256 rows x 512 new tokens, then one forward_backward of 256 x (32 + 512) tokens by operator (micro-batches of 32,768 tokens: they fit 80 GB)
  levers)
    bash "$0" profile-decode --out "$OUT/pd512" --prompts 32 --new 512 --calls 2 > /dev/null 2>&1
    head -14 "$OUT/pd512/profile_decode.md"
    bash "$0" profile-update --size 0.9b --rows 256 --prompt 32 --response 512 --budgets 32768 --reps 2 --top 15 \
      > /dev/null 2>&1; grep -vE "^(/tmp|  warnings)" "$OUT/profile_update.log" | tail -30 ;;
  #   profile-update ARGS: where the hf actor's update goes (benchmarks/gpu/profile_update.py ARGS; model under /tmp)
  profile-update) python3 benchmarks/gpu/profile_update.py --out /tmp/profile-update "$@" 2>&1 | tee -a "$OUT/profile_update.log" ;;
  #   vs-trl ARGS: bench_grpo_vs_trl.py on CUDA (e.g. --shape 0.9b-16x8x2048 --sides verl --out /tmp/vs-trl-2048)
  vs-trl) python3 benchmarks/bench_grpo_vs_trl.py --device cuda "$@" 2>&1 | tee -a "$OUT/vs_trl.log" ;;
esac
