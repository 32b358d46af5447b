"""A machine of our kind with slower engines, simulated: each vLLM pod's processes in a cgroup of their own
whose CPU time is capped (``E2E_POD_CPU_QUOTA``: the share of one CPU a pod may use, per 100 ms).

Machines of our kind differ up to 5x in vLLM's CPU speed. CPU hogs beside the suite slow the gateway and the
test clients too, and by a factor the kernel's autogroups make hard to set; a quota slows the engines alone.
The factor is not the quota's inverse (the engine's threads share it, and a throttled step waits for the next
period), and it differs between machines: measured, with the quota for 5x on two, in docs/flow-isolation.md.
Needs root and the cgroup cpu controller (v1 or v2).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

PERIOD_US = 100_000
_V1_ROOT = Path("/sys/fs/cgroup/cpu")
_V2_ROOT = Path("/sys/fs/cgroup")


def requested_share() -> float | None:
    """The share ``E2E_POD_CPU_QUOTA`` asks for, or None when unset."""
    value = os.environ.get("E2E_POD_CPU_QUOTA")
    if not value:
        return None
    share = float(value)
    if not 0 < share <= 64:
        raise ValueError(f"E2E_POD_CPU_QUOTA={value}: a share of a CPU, above 0")
    return share


class PodCpuQuota:
    """One pod's cgroup: created capped at ``share`` of a CPU, joined by the pod's first process (the ones it
    starts later inherit it), removed once they are gone."""

    def __init__(self, name: str, share: float) -> None:
        quota = str(int(share * PERIOD_US))
        # Named after the run's directory, so that tests/e2e/run.sh removes what a killed run left behind.
        group = f"{Path(os.environ.get('E2E_RUN_DIR', f'kvgw-e2e-{os.getpid()}')).name}-{name}"
        if (_V2_ROOT / "cgroup.controllers").exists():
            if "cpu" not in (_V2_ROOT / "cgroup.controllers").read_text().split():
                raise OSError("the cgroup v2 hierarchy has no cpu controller")
            (_V2_ROOT / "cgroup.subtree_control").write_text("+cpu")
            self.path = _V2_ROOT / group
            self.path.mkdir(exist_ok=True)
            (self.path / "cpu.max").write_text(f"{quota} {PERIOD_US}")
        else:
            self.path = _V1_ROOT / group
            self.path.mkdir(exist_ok=True)
            (self.path / "cpu.cfs_period_us").write_text(str(PERIOD_US))
            (self.path / "cpu.cfs_quota_us").write_text(quota)

    def join(self, pid: int) -> None:
        (self.path / "cgroup.procs").write_text(str(pid))

    def remove(self) -> None:
        """Remove the cgroup; its killed processes may take a moment to leave it."""
        for _ in range(50):
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:  # busy: not empty yet
                time.sleep(0.1)
