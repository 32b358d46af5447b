"""Who this gateway process is among its siblings (the workers of one replica) and its replicas."""

from __future__ import annotations

import os
import secrets
import socket
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class WorkerIdentity:
    replica: str  # the same for every worker of one ``gateway serve``, restarts included
    index: int = 0
    count: int = 1
    run_dir: str | None = None  # the workers' private sockets and shared tables; none: one worker
    # Where the host's indexers write the prefix index the workers read (none: each process keeps its own).
    index_dir: str | None = None

    @staticmethod
    def single() -> WorkerIdentity:
        return WorkerIdentity(new_replica_id())

    @property
    def origin(self) -> str:
        """This process on the state bus: a restarted worker is a new origin."""
        return f"{self.replica}/w{self.index}/{os.getpid()}"

    @property
    def name(self) -> str:
        return f"w{self.index}"

    def _in_run_dir(self, name: str) -> str:
        assert self.run_dir is not None
        return os.path.join(self.run_dir, name)

    def bus_socket(self, index: int) -> str:
        return self._in_run_dir(f"bus-{index}.sock")

    def http_socket(self, index: int) -> str:
        """Where worker ``index`` also answers HTTP, so that a sibling can ask it for its own metrics."""
        return self._in_run_dir(f"http-{index}.sock")

    @property
    def load_table(self) -> str:
        return self._in_run_dir("load-table")

    def index_path(self, shard: int) -> str:
        """The prefix index that ingest process ``shard`` writes (its data files beside it)."""
        assert self.index_dir is not None
        return os.path.join(self.index_dir, f"index-{shard}")

    @property
    def release_order(self) -> str:
        """The table through which the workers agree which held request goes next (flow control)."""
        return self._in_run_dir("release-order")


def new_replica_id() -> str:
    return f"{socket.gethostname()}-{secrets.token_hex(3)}"
