#!/usr/bin/env bash
# Diagnosis on the 2-GPU machine: what the tensor-parallel ranks hold in host memory before the CUDA checkpoint
# (packaging/device/tree-maps.py, the heap walked chunk by chunk), with NCCL's own account of its allocations (NCCL_DEBUG_SUBSYS=ALLOC) and CRIU's
# page account of the capsule after. NCCL_MORE: more NCCL settings (NCCL_X=V,...). Usage (repo root there, .whl and .carry/gpu carried: prepare.sh): packaging/device/tp-maps.sh
source packaging/device/env.sh
rm -f /tmp/nccl.*.log
MAPS_MIN_MIB=${MAPS_MIN_MIB:-30} python3 packaging/device/tree-maps.py capture --device cuda --weights-mode recovery \
    --name tpmaps --engine-opt hidden=6144 --engine-opt heads=48 --engine-opt kv_mib=2048 --engine-opt layers=4 \
    --engine-opt tensor_parallel=2 --engine-opt nccl_env=NCCL_DEBUG=INFO,NCCL_DEBUG_SUBSYS=ALL,NCCL_DEBUG_FILE=/tmp/nccl.%p.log${NCCL_MORE:+,$NCCL_MORE} --json > /tmp/tpmaps.json
echo "capture rc=$?"
D=$(python3 -c "import json;print(json.load(open('/tmp/tpmaps.json'))['result']['capsule'].split(':')[1])")
echo "== NCCL's log lines: where they are"
ls -la /tmp/nccl.*.log; grep -rlc "NCCL INFO" /tmp/coldsnap-run /tmp/coldsnap /tmp/*.log 2>/dev/null | head -5
echo "== NCCL allocations of 1 MiB or more"
cat /tmp/nccl.*.log 2>/dev/null | grep -i "alloc" | \
    python3 -c "
import re,sys,collections
c=collections.Counter()
for l in sys.stdin:
    n=[int(x) for x in re.findall(r'\b(\d{7,})\b', l)]
    if n and max(n) >= 1<<20: c[re.sub(r'0x[0-9a-f]+|\b\d+\b','#',l.split('NCCL INFO',1)[1].strip())[:110]+' size '+str(max(n)>>20)+' MiB']+=1
for k,v in c.most_common(25): print(v,'x',k)"
echo "== NCCL transports and channels"; cat /tmp/nccl.*.log | grep -E "via |nChannels|Channel 00|Init COMPLETE|NCCL version|cudaDriverVersion|[Mm]em" | cut -c1-200 | sort | uniq -c | sort -rn | head -30
python3 -m coldsnap.cli.main restore --capsule sha256:$D --no-fallback --json > /dev/null; echo "restore rc=$?"
python3 -m coldsnap.cli.main stop tpmaps > /dev/null
python3 -m coldsnap_bench.criu_account $COLDSNAP_HOME/staged/$D/images --top 6 --zeros
