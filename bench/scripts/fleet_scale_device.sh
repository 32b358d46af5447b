#!/usr/bin/env bash
# The fleet-scale numbers that need more cores than a laptop: KV-event ingest with 1, 2 and 4 workers and the
# cost of a request at 4, 100 and 1,000 simulated pods with 1, 2 and 4 workers, in one go.
#
#     bench/scripts/fleet_scale_device.sh            # from the repo root, after `make install`
#
# Meant for a machine with 16 cores and no network: it installs nothing (a peer router runs only if
# `gateway bench` installed it earlier: smg 1.13 under ~/.cache/kv-gateway/peers), and takes about 5 minutes.
# It prints the machine, then two tables (docs/fleet-scale.md says how to read them); each part stops at its
# time limit, printing what it finished. Sizes and limits can be changed: FIREHOSE_PODS, FIREHOSE_RATE,
# INGEST_PROCESSES, PODS, SCALE, CONTENDERS, FIREHOSE_LIMIT_S, FLEET_LIMIT_S, OUT (defaults below).
set -uo pipefail

PY=${PY:-.venv/bin/python}
OUT=${OUT:-bench-results/fleet-scale-device}
FIREHOSE_PODS=${FIREHOSE_PODS:-1000}
FIREHOSE_RATE=${FIREHOSE_RATE:-600}       # block events a second per pod: 600k/s from 1,000 pods
PODS=${PODS:-4 100 1000}
INGEST_PROCESSES=${INGEST_PROCESSES:-1 2}
SCALE=${SCALE:-0.3}                       # of the scenario's 2,000 requests at 100 a second
FIREHOSE_LIMIT_S=${FIREHOSE_LIMIT_S:-120}
FLEET_LIMIT_S=${FLEET_LIMIT_S:-170}
CONTENDERS=${CONTENDERS:-gateway-kv_aware gateway-kv_aware-2-workers gateway-kv_aware-4-workers gateway-kv_aware-full-scan smg-cache_aware}

if ! "$PY" -c 'import gateway.kv._blockindex' 2>/dev/null; then
    echo "no gateway here: run \`make install\` in the repo root first" >&2
    exit 2
fi
mkdir -p "$OUT"
echo "machine: $(nproc) cores, $(awk '/MemTotal/ {printf "%.0f GiB", $2 / 1048576}' /proc/meminfo), $(uname -r)"
echo "gateway: $(git rev-parse --short HEAD 2>/dev/null || echo '?'); started $(date -u +%H:%M:%S) UTC"

echo
echo "## 1. KV-event ingest alone: $FIREHOSE_PODS pods x $FIREHOSE_RATE block events/s, no requests"
timeout --signal=INT "$FIREHOSE_LIMIT_S" "$PY" bench/scripts/kv_firehose.py --pods "$FIREHOSE_PODS" --rate "$FIREHOSE_RATE" \
    --workers 1 2 4 --ingest-processes $INGEST_PROCESSES --warmup 20 --seconds 8 2>"$OUT/firehose.log" \
    || echo "(kv_firehose.py stopped: exit $?; its log: $OUT/firehose.log)"

echo
echo "## 2. gateway bench --scenario fleet-scale at $PODS pods (--scale $SCALE)"
# A peer router that is not installed here is left out (saying so), not installed.
read -r -a kept < <("$PY" - $CONTENDERS <<'EOF2'
import sys
from bench.peers import PeerMissing, PeerRefused
from bench.runner import CONTENDERS, prepare_peers
kept = []
for name in sys.argv[1:]:
    try:
        prepare_peers([CONTENDERS[name]], install=False)
        kept.append(name)
    except (PeerMissing, PeerRefused) as exc:
        print(f"{name} left out: {exc}", file=sys.stderr)
print(" ".join(kept))
EOF2
)
contenders=()
for c in "${kept[@]}"; do contenders+=(--contender "$c"); done
timeout --signal=INT "$FLEET_LIMIT_S" "$PY" bench/scripts/fleet_scale.py --pods $PODS --out "$OUT" -- \
    --scale "$SCALE" --no-install-peers "${contenders[@]}" \
    || echo "(fleet_scale.py stopped: exit $?; each fleet size's results: $OUT/pods-N/latest.json)"
echo "finished $(date -u +%H:%M:%S) UTC"
