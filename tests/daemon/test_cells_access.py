"""With cells, the router's own ``GetClusterState`` (no cell named: every cell served here, added
up) passes the access policy as every other call does, and shows a caller only the cells it may read."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest

from hlb.daemon.cells.host import CellRouter, ShardRun
from hlb.daemon.config import Settings, load_settings
from hlb.daemon.decide.scheduler import Scheduler
from hlb.daemon.decide.scorers import LeastLoaded
from hlb.daemon.serve.auth import Access, load_policy
from hlb.daemon.state.graph import InfraGraph
from hlb.daemon.state.ledger import PlacementLedger
from hlb.v1 import scheduler_pb2 as api

POLICY = """\
identities:
  alice:
    read: [team-a]
    cells: [pod-a]
  ops:
    read: ["*"]
"""


class DeniedError(Exception):
    pass


@dataclass
class _Context:
    identity: str | None = None

    def auth_context(self) -> dict[str, list[bytes]]:
        return {}

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return (("x-hlb-identity", self.identity),) if self.identity else ()

    def time_remaining(self) -> float:
        return 5.0

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise DeniedError(code, details)


@dataclass
class _Shard:
    """What the router reads of a shard: its service, lock, scheduler and staleness."""

    scheduler: Scheduler
    lock: threading.RLock = field(default_factory=threading.RLock)
    service: object = True
    serving: bool = True

    def staleness_ms(self) -> float:
        return 0.0


@dataclass
class _Host:
    settings: Settings
    access: Access
    shards: dict[int, ShardRun]
    instance: str = "instance-1"
    address: str = "127.0.0.1:1"

    def owners(self) -> list[api.ShardOwner]:
        return [
            api.ShardOwner(shard=s, cell=run.daemon.scheduler.cell if run.daemon else "")
            for s, run in self.shards.items()
        ]


def _router(tmp_path: Path) -> CellRouter:
    path = tmp_path / "policy.yaml"
    path.write_text(POLICY)
    settings = load_settings(None, bus="memory", cell="pod-a")
    access = Access(load_policy(path), trust_header=True)
    shards = {}
    for shard, cell in enumerate(["pod-a", "pod-b"]):
        scheduler = Scheduler(InfraGraph(), LeastLoaded(), PlacementLedger(), cell, lambda: 0.0)
        run = ShardRun(shard)
        daemon: Any = _Shard(scheduler)
        run.daemon = daemon
        shards[shard] = run
    host: Any = _Host(settings, access, shards)
    return CellRouter(host)


def _state(router: CellRouter, identity: str | None) -> api.ClusterState:
    context: Any = _Context(identity)
    return asyncio.run(router.GetClusterState(api.GetClusterStateRequest(), context))


def test_the_routers_cluster_state_refuses_a_caller_the_policy_does_not_let_read(tmp_path: Path) -> None:
    router = _router(tmp_path)
    with pytest.raises(DeniedError) as refused:
        _state(router, None)
    assert refused.value.args == (
        grpc.StatusCode.PERMISSION_DENIED,
        "identity 'anonymous' may not read any tenant's tasks in cell 'pod-a'",
    )


def test_the_routers_cluster_state_shows_only_the_cells_a_caller_may_read(tmp_path: Path) -> None:
    router = _router(tmp_path)
    assert [owner.cell for owner in _state(router, "ops").shards] == ["pod-a", "pod-b"]
    assert [owner.cell for owner in _state(router, "alice").shards] == ["pod-a"]
