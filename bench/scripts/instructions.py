"""What a request costs the gateway in instructions, counted by valgrind's callgrind: a measure of CPU per request
that another process's load does not move, for comparing two versions on a shared machine.

    python bench/scripts/instructions.py [--policy kv_aware] [--requests 300] [--tree DIR [--pythonpath P]]

The gateway (one worker) runs under callgrind with counting off while it starts and serves ``--warm`` requests,
then counts an idle spell (its timers: the loop-lag probe, health checks) and ``--requests`` sequential 4 KB chat
requests (``proxy_overhead.py``'s) to ``trivial_backend.py``. Per request: the requests' instructions, less the
idle rate over their seconds, over their number. The model has no tokenizer here: ``kv_aware`` asks the backend's
``/tokenize`` once (a 404) and routes by text after, as in ``proxy_overhead.py``; ``--tokenizer DIR`` gives it one
(``tokenization.models``). Two runs of one version agree within about 1.5%; wall-clock CPU
per request (``proxy_overhead.py``) moved up to 40% between runs here. ``--tree`` runs another checkout from its
own directory (``python -m gateway`` puts the working directory first on ``sys.path``); its entry points come from
``--pythonpath``, a folder holding its installed metadata (``*.dist-info``) before the tree itself.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from bench.runner import wait_http
from bench.workloads import overhead_chat
from simulator.pod import free_ports

HERE = Path(__file__).resolve().parent
BODY = json.dumps(overhead_chat("bench")).encode()


class Callgrind:
    """A process under callgrind, its counting switched on and off and its counts dumped on demand."""

    def __init__(self, command: list[str], cwd: str, env: dict[str, str]) -> None:
        self.out = Path(tempfile.mkdtemp(prefix="kvgw-callgrind-"))
        with open(self.out / "valgrind.log", "w") as log:
            self.proc = subprocess.Popen(["valgrind", "--tool=callgrind", "--instr-atstart=no",
                                          f"--callgrind-out-file={self.out}/cg.%p", *command], cwd=cwd, env=env,
                                         stderr=log)
        self._read: set[Path] = set()

    def control(self, *args: str) -> None:
        subprocess.run(["callgrind_control", *args, str(self.proc.pid)], capture_output=True, check=False)

    def dumped(self, timeout_s: float = 120) -> int:
        """The instructions counted since the last dump or zeroing (a new dump file each time)."""
        self.control("-d")
        deadline = time.monotonic() + timeout_s
        while not (new := set(self.out.glob("cg.*.*")) - self._read) and time.monotonic() < deadline:
            time.sleep(0.5)
        time.sleep(0.5)  # written whole
        self._read |= new
        return sum(_instructions(path) for path in new)


def _instructions(dump: Path) -> int:
    for line in dump.read_text().splitlines():
        if line.startswith(("summary:", "totals:")):
            return int(line.split()[1])
    raise ValueError(f"no totals in {dump}")


def post(url: str) -> None:
    request = urllib.request.Request(f"{url}/v1/chat/completions", BODY, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        response.read()


def measure(args: argparse.Namespace) -> dict[str, float]:
    backend_port, port = free_ports(2)
    backend = subprocess.Popen([sys.executable, str(HERE / "trivial_backend.py"), str(backend_port)])
    env = {**os.environ, "GATEWAY_LOGGING__ACCESS_LOG": "false"}
    if args.pythonpath:
        env["PYTHONPATH"] = args.pythonpath
    command = [sys.executable, "-m", "gateway", "serve", "--port", str(port), "--workers", "1", "--policy", args.policy,
               "--pod", f"http://127.0.0.1:{backend_port}"]
    if args.tokenizer:
        config = Path(tempfile.mkdtemp(prefix="kvgw-instructions-")) / "gateway.json"
        config.write_text(json.dumps({"tokenization": {"models": {"bench": {"path": args.tokenizer}}}}))
        command += ["--config", str(config)]
    gateway = Callgrind(command, args.tree, env)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(f"{url}/readyz", timeout_s=600)
        for _ in range(args.warm):
            post(url)
        gateway.control("-z")
        gateway.control("-i", "on")
        started = time.monotonic()
        time.sleep(args.idle_s)
        idle_per_s = gateway.dumped() / (time.monotonic() - started)
        gateway.control("-z")
        started = time.monotonic()
        for _ in range(args.requests):
            post(url)
        seconds = time.monotonic() - started
        counted = gateway.dumped()
    finally:
        gateway.proc.terminate()
        backend.terminate()
        gateway.proc.wait(60)
    return {"instructions_per_request": round((counted - idle_per_s * seconds) / args.requests),
            "counted_per_request": round(counted / args.requests), "idle_per_s": round(idle_per_s),
            "seconds": round(seconds, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--policy", default="kv_aware")
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--warm", type=int, default=60, help="requests served before counting")
    parser.add_argument("--idle-s", type=float, default=10.0)
    parser.add_argument("--tree", default=str(HERE.parents[1]), help="the checkout whose gateway runs")
    parser.add_argument("--pythonpath", help="PYTHONPATH of the gateway (another tree's metadata, then the tree)")
    parser.add_argument("--tokenizer", help="a tokenizer directory for the model (none: the backend is asked)")
    args = parser.parse_args()
    print(json.dumps({"policy": args.policy, "tree": args.tree, **measure(args)}))


if __name__ == "__main__":
    main()
