#!/usr/bin/env bash
# Runs a command beside CPU hogs: HOGS_PER_CORE (default 1) busy loops pinned to each core, each in a session
# of its own. With the kernel's autogroup scheduling (/proc/sys/kernel/sched_autogroup_enabled) a CPU share
# goes to each session, not each process: hogs sharing one session would together take one share, and a vLLM
# pod (in its own session) would slow only 2x however many there were. With N hogs a core, a pod gets about
# 1/(N+1) of its core: HOGS_PER_CORE=4 made the e2e pods' prefill 8x slower (docs/flow-isolation.md).
#   tools/beside-hogs.sh make test
#   HOGS_PER_CORE=4 tools/beside-hogs.sh tests/e2e/run.sh -k "flow_control and floor" -s
set -u
pids=()
for core in $(seq 0 $(($(nproc) - 1))); do
    for _ in $(seq "${HOGS_PER_CORE:-1}"); do
        setsid taskset -c "$core" python3 -c 'while True: pass' &
        pids+=($!)
    done
done
trap 'kill "${pids[@]}" 2>/dev/null' EXIT
"$@"
