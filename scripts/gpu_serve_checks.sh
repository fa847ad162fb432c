#!/usr/bin/env bash
# The serving checks that need a GPU (docs/chat-benchmarks.md), each against the code's default in
# the same run, results as JSON in OUT_DIR:
#   tests  the GPU tests of chat/ (recorded steps = eager steps: greedy, adapters by lanes, beams)
#   lanes  ten adapters, 64 chats spread over them: static batcher vs adapters' rows in the slots (the
#          default), then the base alone
#   beams  one chat in four beam search (faithful): static batcher vs a slot per beam
#   serve  the app through its server (gradio's /chat, the OpenAI-compatible API) vs the engine alone,
#          with CHAT_SCHEDULER's scheduler (default step; results serve-SCHEDULER.json)
#   process the step loop in an engine process of its own (chat.stepproc) vs in the server's, fp32 then TF32
# Usage: bash scripts/gpu_serve_checks.sh OUT_DIR [tests lanes beams serve process]   (default: all five)
# MODEL (default random-400M: the 400M architecture, random weights, offline) and REPLIES (256)
# override the benchmarks' model and replies per round, CONCURRENCY (1,64) serve's clients. serve reads
# the app's CPU through the time limit's process (--app_pid: it and its descendants, the engine process too).
set -uo pipefail
out=${1:?usage: bash scripts/gpu_serve_checks.sh OUT_DIR [tests lanes beams serve process]}
shift
parts=${*:-tests lanes beams serve process}
model=${MODEL:-random-400M}
replies=${REPLIES:-256}
python=${PYTHON:-python3}
mkdir -p "$out"
# The app started apart, its log in OUT_DIR/app-SCHEDULER.log, both processes under a time limit (the
# app's 60 s longer: it outlives the benchmark) that makes Python print every thread's stack
# (faulthandler) instead of hanging silently: a call on the H100 once printed nothing for 4.5 minutes
# here, with the app's output kept inside the benchmark.
serve_checks() {
  local port=${PORT:-7861} limit=${SERVE_LIMIT_S:-420} app tag=${CHAT_SCHEDULER:-step}
  CHAT_MODEL="$model" GRADIO_SERVER_NAME=127.0.0.1 GRADIO_SERVER_PORT=$port GRADIO_ANALYTICS_ENABLED=False \
    PERSONA_CHAT_BEHIND_PROXY=1 timeout -s ABRT $((limit + 60)) "$python" -X faulthandler app.py > "$out/app-$tag.log" 2>&1 &
  app=$!
  for _ in $(seq 300); do
    "$python" -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$port/config', timeout=2)" \
      2> /dev/null && break
    kill -0 $app 2> /dev/null || { echo "app.py ended before it served:"; tail -30 "$out/app-$tag.log"; return 1; }
    sleep 1
  done
  echo "app up ($(date -u +%H:%M:%S))"
  timeout -s ABRT "$limit" "$python" -X faulthandler -m bench.chat_serve --url "http://127.0.0.1:$port/" \
    --model "$model" --concurrency "${CONCURRENCY:-1,64}" --replies "$replies" --app_pid $app \
    --out "$out/serve-$tag.json" 2>&1 | tee "$out/serve-$tag.log"
  local rc=${PIPESTATUS[0]}
  kill $app 2> /dev/null
  wait $app 2> /dev/null
  return $rc
}

status=0
for part in $parts; do
  echo "== $part ($(date -u +%H:%M:%S))"
  case $part in
    tests) "$python" -m pytest -m gpu -q -p no:cacheprovider tests/chat ;;
    lanes) "$python" -m bench.chat_load --model "$model" --schedulers static,step-apart,step --concurrency 64 \
      --replies "$replies" --max_batch 64 --adapters 10 --out "$out/lanes.json" &&
      "$python" -m bench.chat_load --model "$model" --schedulers step --concurrency 64 \
      --replies "$replies" --max_batch 64 --out "$out/lanes-base.json" ;;  # the base alone, no adapters
    beams) "$python" -m bench.chat_load --model "$model" --schedulers static,step,step-beams --concurrency 8,64 \
      --replies "$replies" --max_batch 64 --faithful_every 4 --out "$out/beams.json" ;;
    serve) serve_checks ;;
    process) "$python" -m bench.chat_load --model "$model" --schedulers step,step-process --concurrency 1,64 \
      --replies "$replies" --max_batch 64 --out "$out/process-fp32.json" &&
      "$python" -m bench.chat_load --model "$model" --schedulers step,step-process --concurrency 64,256 \
      --replies $((replies * 2)) --max_batch 256 --tf32 --out "$out/process-tf32.json" ;;
    *) echo "unknown part $part (tests, lanes, beams, serve, process)" >&2; exit 2 ;;
  esac || status=1
done
exit $status
