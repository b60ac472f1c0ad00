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

from hlb.daemon.cells.bus import Claim
from hlb.daemon.cells.host import FORWARDED, CellRouter, ShardRun
from hlb.daemon.cells.plan import shard_of
from hlb.daemon.config import Settings, load_settings
from hlb.daemon.decide.scheduler import Scheduler
from hlb.daemon.decide.scorers import LeastLoaded
from hlb.daemon.serve.api import SERVICE_NAME
from hlb.daemon.serve.auth import IDENTITY_HEADER, Access, load_policy
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


class _Board:
    def __init__(self, claim: Claim) -> None:
        self.claim = claim

    def get(self, shard: int) -> Claim | None:
        return self.claim if shard == self.claim.shard else None


async def _forwarded_metadata(router: CellRouter, identity: str | None) -> dict[str, str]:
    """Ask the router for a placement of a cell owned elsewhere: the metadata its owner got."""
    seen: dict[str, str] = {}

    async def get_placement(request: api.GetPlacementRequest, context: Any) -> api.GetPlacementResponse:
        seen.update({key: value for key, value in context.invocation_metadata() if isinstance(value, str)})
        return api.GetPlacementResponse()

    handler = grpc.method_handlers_generic_handler(
        SERVICE_NAME,
        {
            "GetPlacement": grpc.unary_unary_rpc_method_handler(
                get_placement,
                request_deserializer=api.GetPlacementRequest.FromString,
                response_serializer=api.GetPlacementResponse.SerializeToString,
            )
        },
    )
    owner = grpc.aio.server()
    owner.add_generic_rpc_handlers((handler,))
    port = owner.add_insecure_port("127.0.0.1:0")
    await owner.start()
    try:
        host: Any = router.host
        shard = shard_of("pod-c", host.settings.cells.partitions)
        host.partitions = host.settings.cells.partitions
        host.board = _Board(Claim(shard=shard, instance="instance-2", address=f"127.0.0.1:{port}", serving=True))
        context: Any = _Context(identity)
        await router.GetPlacement(api.GetPlacementRequest(task_id="team-a/1", cell="pod-c"), context)
    finally:
        await owner.stop(None)
    return seen


def test_a_forwarded_request_carries_its_callers_identity_to_the_owner(tmp_path: Path) -> None:
    router = _router(tmp_path)
    router.host.shards = {}  # nothing served here: every cell is forwarded
    seen = asyncio.run(_forwarded_metadata(router, "alice"))
    assert seen[FORWARDED] == "instance-1"
    assert seen[IDENTITY_HEADER] == "alice"  # the owner checks alice, not an anonymous router
    anonymous = asyncio.run(_forwarded_metadata(router, None))
    assert anonymous[FORWARDED] == "instance-1"
    assert IDENTITY_HEADER not in anonymous
