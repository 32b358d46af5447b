"""The bench's counts of what a router process spent: CPU seconds and context switches, read from /proc for a
real child process and its threads."""

from __future__ import annotations

import subprocess
import sys

from bench.runner import process_cpu_s, process_switches

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
