"""The load table workers share: each writes its own cell, everyone reads the row's sum."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.load.ledger import InFlightLedger
from gateway.load.shared_table import SharedLoadTable


@pytest.fixture
def tables(tmp_path: Path):
    path = str(tmp_path / "table")
    supervisor = SharedLoadTable.create(path, 3, slots=4)
    workers = [SharedLoadTable(path, i, 3, slots=4, retry_full_s=0.0) for i in range(3)]
    yield supervisor, workers
    for table in [supervisor, *workers]:
        table.close()


def test_each_worker_writes_its_cell_and_reads_the_sum(tables):
    _, (w0, w1, w2) = tables
    w0.write("pod-a", 2, 0.25, 0.0)
    w1.write("pod-a", 3, 0.5, 0.125)
    w1.write("pod-b", 1, 0.1, 0.0)
    assert w2.in_flight("pod-a") == 5 and w2.consumption("pod-a") == 0.75 and w2.embedding("pod-a") == 0.125
    assert w0.in_flight("pod-b") == 1
    w0.write("pod-a", 0, 0.0, 0.0)  # a write replaces the worker's own cell, never another's
    assert w2.in_flight("pod-a") == 3
    assert w2.debug(["pod-a"])["pod-a"]["in_flight"] == [0, 3, 0]


def test_a_row_is_reused_only_once_no_worker_uses_it(tables):
    _, (w0, w1, _) = tables
    for i in range(4):
        w0.write(f"pod-{i}", 1, 0.1, 0.0)
    assert w0.in_flight("pod-4") is None  # full: this pod's load is counted by each worker alone
    w1.in_flight("pod-0")  # w1 reads pod-0 too
    w0.release("pod-0")
    assert w1.in_flight("pod-5") is None  # pod-0's row is still w1's
    w1.release("pod-0")
    w1.write("pod-5", 4, 0.4, 0.0)
    assert w0.in_flight("pod-5") == 4  # the freed row, zeroed for its new pod


def test_the_supervisor_clears_a_dead_workers_cells(tables):
    supervisor, (w0, w1, _) = tables
    w0.write("pod-a", 2, 0.2, 0.0)
    w1.write("pod-a", 5, 0.5, 0.0)
    supervisor.clear_worker(1)
    assert w0.in_flight("pod-a") == 2 and w0.consumption("pod-a") == pytest.approx(0.2)


def test_ledgers_of_two_workers_see_each_others_requests(tables):
    _, (w0, w1, _) = tables
    first, second = InFlightLedger(w0), InFlightLedger(w1)
    a = first.dispatch("r1", "pod-a", 0.1, "chat")
    b = second.dispatch("r2", "pod-a", 0.2, "embeddings")
    assert first.on_pod("pod-a") == second.on_pod("pod-a") == 2
    assert first.consumption("pod-a") == pytest.approx(0.3)
    assert first.embedding_consumption("pod-a") == pytest.approx(0.2)
    assert first.total() == 1  # what this worker itself has in flight
    second.finish(b)
    assert first.on_pod("pod-a") == 1 and first.consumption("pod-a") == pytest.approx(0.1)
    first.forget_pod("pod-a")
    assert second.on_pod("pod-a") == 0
    first.finish(a)  # finishing on a forgotten pod is quiet


def test_worker_count_is_the_cores_the_cgroup_quota_allows(tmp_path: Path):
    import os

    from gateway.config import GatewayConfig, ServerConfig
    from gateway.supervisor import worker_count

    cores = len(os.sched_getaffinity(0))
    cpu_max = tmp_path / "cpu.max"
    cpu_max.write_text("150000 100000\n")  # 1.5 CPUs → 2 workers (if the machine has them)
    assert worker_count(GatewayConfig(), str(cpu_max)) == min(cores, 2)
    cpu_max.write_text("max 100000\n")
    assert worker_count(GatewayConfig(), str(cpu_max)) == cores
    assert worker_count(GatewayConfig(), str(tmp_path / "absent")) == cores
    assert worker_count(GatewayConfig(server=ServerConfig(workers=3)), str(cpu_max)) == 3
