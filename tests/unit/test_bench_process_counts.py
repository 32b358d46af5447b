"""The bench's counts of what a router process spent: CPU seconds and context switches, read from /proc for a
real child process and its threads."""

from __future__ import annotations

import subprocess
import sys

from bench.report import per_pod
from bench.runner import kv_ingest, process_cpu_s, process_memory_mb, process_switches

# Sleeps 100 times (each a voluntary switch) in a second thread, spins about 0.2 s of CPU, then waits on
# stdin, its thread alive, so that their /proc entries stay readable until the test has read them.
_CHILD = """
import sys, threading, time
napped = threading.Event()
def nap():
    for _ in range(100):
        time.sleep(0.001)
    napped.set()
    threading.Event().wait()
threading.Thread(target=nap, daemon=True).start()
end = time.process_time() + 0.2
while time.process_time() < end:
    pass
napped.wait()
print("ready", flush=True)
sys.stdin.read()
"""


def test_a_processs_cpu_and_its_threads_switches_are_counted_until_it_is_gone():
    child = subprocess.Popen([sys.executable, "-c", _CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        assert process_cpu_s(child.pid) >= 0.2
        # The naps were a thread's, not the main one's: only a count over every thread sees them.
        assert process_switches(child.pid) >= 100
    finally:
        assert child.stdin is not None
        child.stdin.close()
        child.wait(timeout=10)
    assert process_cpu_s(child.pid) == 0.0 and process_switches(child.pid) == 0


def test_a_processs_memory_and_the_cpu_of_its_children_by_name():
    child = subprocess.Popen([sys.executable, "-c", _CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        assert 1 < process_memory_mb(child.pid) < 1024  # an interpreter's PSS
        assert process_cpu_s(child.pid, named="python") >= 0.2
        assert process_cpu_s(child.pid, named="gw-indexer") == 0  # no process of that name
    finally:
        assert child.stdin is not None
        child.stdin.close()
        child.wait(timeout=10)
    assert process_memory_mb(child.pid) == 0


def test_the_kv_events_applied_a_second_and_a_large_fleets_requests_in_brief():
    def exposition(stored: int, removed: int) -> list[str]:
        return [f'gateway_kv_index_blocks_total{{op="blocks_stored"}} {stored}\n'
                f'gateway_kv_index_blocks_total{{op="blocks_removed"}} {removed}\n'
                'gateway_kv_index_blocks_total{op="unknown_parent"} 999\n']

    assert kv_ingest(exposition(100, 50), exposition(1100, 1050), 4.0, 0.5) == \
        {"kv_block_events_per_s": 500.0, "indexer_cpu_s": 0.5}
    assert kv_ingest(exposition(0, 0), exposition(10, 0), 2.0, 0.0) == {"kv_block_events_per_s": 5.0}
    assert per_pod([3, 0, 5]) == "3/0/5"
    assert per_pod([0] * 990 + [2] * 10) == "10 of 1000 pods, at most 2"
