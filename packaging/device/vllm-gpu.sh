#!/usr/bin/env bash
# vLLM's CUDA build through ColdSnap on the GPU machine (device tool). Each call carries everything (62 MiB of the
# 64 a call may carry), so that a machine lost between calls costs a reinstall, not the run:
#   here:      python3 packaging/device/vllm_carry.py        # .carry/vllm-gpu (40 MiB), from PyPI, reproducible
#              packaging/device/prepare.sh                   # .whl and .carry/gpu/criu.tar.xz
#   carry [".carry/vllm-gpu", ".whl", ".carry/gpu"], then, back to back:
#   call 1:    STEPS="install models tests" bash packaging/device/vllm-gpu.sh
#   call 2:    STEPS="install models bench" bash packaging/device/vllm-gpu.sh   (install and models: done unless lost)
#   call 3:    carry [".carry/runc"] (the rest is still there while the machine is warm), then
#              STEPS="install models container" bash packaging/device/vllm-gpu.sh
# STEPS (in this order, any subset):
#   install  the carry into /tmp/vllm-site (kept while the machine stays warm)
#   models   /tmp/llama-1b (1.0 GB, tests, container), then, where bench or ab follows, /tmp/llama-8b (16.1 GB,
#            Llama 3 8B's shape) in the background while the next steps run (bench and ab wait for it)
#   probe    packaging/device/vllm-sleep-probe.py: sleep levels 1 and 2 around the driver's checkpoint, by hand
#   tests    tests/test_engine_vllm_gpu.py (capture/restore native and recovery, sleep/wake; TESTS_K: pytest -k),
#            results in $OUT
#   container  tests/test_gpu_container.py -k "${CASE:-vllm}": vLLM in a runc container through coldsnap-runtime
#            (packaging/device/gpu-container.sh; runc from .carry/runc), results in $OUT
#   bench    coldsnap bench --engine vllm --device cuda on the 8B shape (SAMPLES, default 5; VANILLA: fewer vanilla
#            samples when device time is short; BENCH_ENV: VAR=VALUE settings for it, comma-separated), into $OUT
#   ab       a recovery capture of the 8B shape, then its restores taking turns between settings (AB, N rounds;
#            packaging/device/ab.sh), each validated; lines in $OUT/ab.log, receipts in $OUT/ab.receipts.jsonl
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export COLDSNAP_VLLM_CUDA_SITE=/tmp/vllm-site COLDSNAP_TEST_VLLM_MODEL=/tmp/llama-1b
STEPS=${STEPS:-"install models probe tests"}
has() { case " $STEPS " in *" $1 "*) return 0;; esac; return 1; }
t0=$(date +%s); say() { echo "[vllm-gpu +$(( $(date +%s) - t0 ))s] $*"; }
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv,noheader
if has install; then
  stamp=$(sha256sum .carry/vllm-gpu/vllm-carry.tar.xz | cut -c1-16)
  if [ "$(cat "$COLDSNAP_VLLM_CUDA_SITE/.carry-stamp" 2>/dev/null)" = "$stamp" ]; then
    say "install: kept from an earlier call"
  else
    bash .carry/vllm-gpu/install.sh "$COLDSNAP_VLLM_CUDA_SITE" > "$OUT/install.log" 2>&1; rc=$?; say "install rc=$rc"
    [ $rc = 0 ] && echo "$stamp" > "$COLDSNAP_VLLM_CUDA_SITE/.carry-stamp"
  fi
fi
[ -f packaging/device/env.sh ] && [ -d .whl ] && source packaging/device/env.sh
if has models && { has tests || has probe || has container; } && [ ! -f /tmp/llama-1b/config.json ]; then
  python3 -m coldsnap_reference.tinymodel /tmp/llama-1b --shape 1b > "$OUT/models.log" 2>&1; say "1b rc=$?"
fi  # the bench needs only the 8B:
if has models && { has bench || has ab; } && ! grep -q '^rc=0' /tmp/llama-8b.log 2>/dev/null; then
  # a session of its own: it outlives this call while the machine stays warm
  pgrep -f "tinymodel /tmp/llama-8b" > /dev/null || setsid bash -c 'python3 -m coldsnap_reference.tinymodel /tmp/llama-8b --shape 8b > /tmp/llama-8b.log 2>&1;
                  echo "rc=$?" >> /tmp/llama-8b.log' < /dev/null > /dev/null 2>&1 &
fi
if has probe; then
  PYTHONPATH=$COLDSNAP_VLLM_CUDA_SITE timeout 300 python3 packaging/device/vllm-sleep-probe.py /tmp/llama-1b "$OUT" \
      --deadline-s 240 > "$OUT/probe.log" 2>&1; say "probe rc=$?"; tail -5 "$OUT/probe.log"
fi
if has tests; then
  timeout "${TESTS_S:-560}" python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/test_engine_vllm_gpu.py -rs -s \
      ${TESTS_K:+-k "$TESTS_K"} \
      > "$OUT/tests.log" 2>&1; say "tests rc=$?"; tail -15 "$OUT/tests.log"
fi
if has container; then
  NO_DEVICE_ENV=1 CASE=${CASE:-vllm} TEST_TIMEOUT=${CONTAINER_S:-540} bash packaging/device/gpu-container.sh; say "container rc=$?"
fi
if has bench; then
  while ! grep -q '^rc=' /tmp/llama-8b.log 2>/dev/null; do sleep 2; done; say "8b model: $(tail -1 /tmp/llama-8b.log)"
  bench_env=${BENCH_ENV:-}; [ -n "$bench_env" ] && say "bench with $bench_env"
  timeout "${BENCH_S:-560}" env ${bench_env//,/ } python3 -m coldsnap.cli.main bench --engine vllm --device cuda --weights-mode recovery \
      --engine-opt model=/tmp/llama-8b --engine-opt site="$COLDSNAP_VLLM_CUDA_SITE" --samples "${SAMPLES:-5}" ${VANILLA:+--vanilla-samples "$VANILLA"} \
      --out "$OUT" > "$OUT/bench.log" 2>&1; say "bench rc=$?"; tail -8 "$OUT/bench.log"
fi
if has ab; then
  while ! grep -q '^rc=' /tmp/llama-8b.log 2>/dev/null; do sleep 2; done; say "8b model: $(tail -1 /tmp/llama-8b.log)"
  timeout "${CAPTURE_S:-400}" python3 -m coldsnap.cli.main capture --engine vllm --device cuda --weights-mode recovery \
      --engine-opt model=/tmp/llama-8b --engine-opt site="$COLDSNAP_VLLM_CUDA_SITE" --json > "$OUT/ab-capture.json" \
      2> "$OUT/ab-capture.log"; say "capture rc=$?"
  D=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["result"]["capsule"])' "$OUT/ab-capture.json")
  [ -n "$D" ] && N=1 AB="COLDSNAP_PREFETCH=1" bash packaging/device/ab.sh "$D" > "$OUT/ab-warmup.log" 2>&1  # stages it
  [ -n "$D" ] && RECEIPTS="$OUT/ab.receipts.jsonl" N=${N:-3} AB="${AB:?name the settings in AB}" \
      bash packaging/device/ab.sh "$D" 2>&1 | tee "$OUT/ab.log" | cut -c1-400; say "ab done"
  cp "$OUT/ab.receipts.jsonl" /tmp/ab.receipts.jsonl  # for a bench in the next call: packaging/device/ab_pick.py
  python3 packaging/device/ab_pick.py /tmp/ab.receipts.jsonl --json
fi
