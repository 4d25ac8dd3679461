#!/usr/bin/env bash
# Tensor parallel 2 over NCCL on the 2-GPU machine (device tool kind nvidia-h200-x2), and the one-GPU baseline with
# the same per-rank state. Usage (repo root there, .whl and .carry/gpu carried: prepare.sh): packaging/device/tp-bench.sh STEPS
# STEPS: any of test tp2 tp1 gpumap noprefetch threads account (default: test tp2 tp1). N samples (default 10), NV vanilla samples
# (default 1). TP_OPTS: more options for the TP2 bench, e.g. smaller NCCL buffers (fewer pinned pages per rank):
# TP_OPTS="--engine-opt nccl_env=NCCL_BUFFSIZE=1048576" TP_NAME=-buf1m. Both benches prefetch the weights onto each GPU
# during the restore (COLDSNAP_PREFETCH=0 turns that off for both). The engines move their CUDA device code
# into files at capture (coldsnap/codestash.py; COLDSNAP_CODE_STASH=0 turns that off for both benches).
STEPS=${*:-test tp2 tp1}; N=${N:-10}; NV=${NV:-1}
source packaging/device/env.sh
CS="python3 -m coldsnap.cli.main"
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
# Per rank: 2 layers' worth of weights (hidden 6144: 1.8 GB a layer) + KV_MIB of KV cache. TP2 runs 2×LAYERS layers
# split over two ranks, so each rank holds what the TP1 baseline holds.
LAYERS=${LAYERS:-2}; KV_MIB=${KV_MIB:-2048}
SHAPE="--engine-opt hidden=6144 --engine-opt heads=48 --engine-opt kv_mib=$KV_MIB"
nvidia-smi --query-gpu=index,name,uuid,memory.used --format=csv,noheader; nvidia-smi topo -m | head -3
python3 -c "from coldsnap.gpu import nvml; r=nvml.discover(); print('gpus', len(r.gpus), 'links', r.links, r.error or '')"
for step in $STEPS; do
  case $step in
  test)
    echo "== tests (GPU + distributed)"
    timeout ${TEST_TIMEOUT:-420} python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/test_distributed.py -k "nccl or admission" \
        -rfs 2>&1 | tail -25 ;;
  tp2)
    echo "== bench tensor parallel 2 ($((2 * LAYERS)) layers)"
    timeout ${BENCH_TIMEOUT:-400} $CS bench --device cuda -n "$N" --vanilla-samples "$NV" --weights-mode recovery \
        $SHAPE --engine-opt layers=$((2 * LAYERS)) --engine-opt tensor_parallel=2 $TP_OPTS --out "$OUT" \
        --name reference-cuda-tp2${TP_NAME:-}
    echo "bench rc=$?" ;;
  tp1)
    echo "== bench one GPU, same per-rank state ($LAYERS layers)"
    timeout ${BENCH_TIMEOUT:-400} $CS bench --device cuda -n "$N" --vanilla-samples "$NV" --weights-mode recovery \
        $SHAPE --engine-opt layers=$LAYERS --out "$OUT" --name reference-cuda-tp1-per-rank
    echo "bench rc=$?" ;;
  gpumap)
    # Restore a one-GPU capsule captured on GPU 0 onto GPU 1: the driver remaps by UUID pairs (every GPU listed).
    D=$(python3 -c "import json;print(json.load(open('$OUT/reference-cuda-tp1-per-rank.json'))['capsule']['digest'])")
    U0=$(nvidia-smi --query-gpu=uuid --format=csv,noheader | sed -n 1p); U1=$(nvidia-smi --query-gpu=uuid --format=csv,noheader | sed -n 2p)
    echo "== restore $D with --gpu-map GPU0->GPU1, GPU1->GPU0"
    $CS restore --capsule "$D" --gpu-map "$U0=$U1" --gpu-map "$U1=$U0" --no-fallback --json > "$OUT/gpumap.json"; echo "rc=$?"
    python3 -c "import json;r=json.load(open('$OUT/gpumap.json'));print(r['state'],r['result'].get('time_to_first_token_s'),r['result'].get('hydrate',{}).get('cuda_restore_s'), r.get('error'))"
    nvidia-smi --query-gpu=index,memory.used --format=csv,noheader
    $CS stop bench-reference ;;
  noprefetch)
    # The TP2 capsule restored 3 times without the prefetchers: do their page-cache reads (the whole file onto each
    # GPU) slow CRIU's page restore and the driver's down? Compare the spans with the bench's.
    D=$(python3 -c "import json;print(json.load(open('$OUT/reference-cuda-tp2${TP_NAME:-}.json'))['capsule']['digest'])")
    for i in 1 2 3; do
      COLDSNAP_PREFETCH=0 $CS restore --capsule "$D" --no-fallback --json > "$OUT/noprefetch-$i.json"; echo "rc=$?"
      python3 -c "import json;r=json.load(open('$OUT/noprefetch-$i.json'));h=r['result'].get('hydrate',{});print({s['name']:round(s['duration_s'],3) for s in r['spans']}, h.get('cuda_restore_per_pid_s'), r['result'].get('criu_stats',{}).get('restore_s'))"
      $CS stop bench-reference >/dev/null
    done ;;
  threads)
    # A/B on the TP2 capsule: 5 restores with PREFETCH_THREADS readers per prefetcher (the bench: 8 per GPU).
    D=$(python3 -c "import json;print(json.load(open('$OUT/reference-cuda-tp2${TP_NAME:-}.json'))['capsule']['digest'])")
    for i in 1 2 3 4 5; do
      COLDSNAP_PREFETCH_THREADS=${PREFETCH_THREADS:-4} $CS restore --capsule "$D" --no-fallback --json > "$OUT/threads-$i.json"
      python3 -c "import json;r=json.load(open('$OUT/threads-$i.json'));h=r['result'].get('hydrate',{});print(r['result'].get('time_to_first_token_s'), {s['name']:round(s['duration_s'],3) for s in r['spans']}, h.get('cuda_restore_per_pid_s'), r['result'].get('criu_stats',{}).get('restore_s'))"
      $CS stop bench-reference >/dev/null
    done ;;
  account)
    # Where each capsule's CRIU pages are, per process (python -m coldsnap_bench.criu_account).
    for j in "$OUT"/*.json; do
      D=$(python3 -c "import json;print(json.load(open('$j')).get('capsule',{}).get('digest','').split(':')[-1])" 2>/dev/null)
      [ -n "$D" ] && [ -d $COLDSNAP_HOME/staged/$D/images ] || continue
      echo "== $(basename $j)"; python3 -m coldsnap_bench.criu_account $COLDSNAP_HOME/staged/$D/images --top 8 --zeros
    done ;;
  esac
done
python3 packaging/device/summary.py
tar czf "$OUT/receipts-tp.tgz" -C /tmp/coldsnap receipts 2>/dev/null
