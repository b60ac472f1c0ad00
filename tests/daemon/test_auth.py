"""Tenants: who a gRPC caller is, what the access policy lets it do, and task events Kafka may carry.

Every refusal is ``PERMISSION_DENIED`` naming the action and the tenant, given before the task is
looked up: a tenant can neither take another's task id first nor learn whether one exists. On
Kafka, a task event whose tenant its topic may not carry goes to the dead-letter topic
(``tenant_not_allowed``).
"""

from __future__ import annotations

import asyncio
import itertools
import textwrap
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from cryptography.x509.oid import ExtendedKeyUsageOID
from structlog.testing import capture_logs

from hlb.daemon.bus.seam import MemoryBus
from hlb.daemon.config import Topics, load_settings
from hlb.daemon.errors import ConfigError
from hlb.daemon.ingest.pipeline import drain
from hlb.daemon.runtime.daemon import Daemon
from hlb.daemon.serve.auth import ANONYMOUS, Access, AccessPolicy, load_policy
from hlb.daemon.serve.tls import channel_credentials
from hlb.sim.agent import inventory_events
from hlb.sim.kafka_local import free_port
from hlb.v1 import events_pb2 as ev
from hlb.v1 import scheduler_pb2 as api
from hlb.v1 import scheduler_pb2_grpc as api_grpc
from tests.daemon.background import BackgroundDaemon, memory_settings
from tests.daemon.background import wait_until as wait_for
from tests.daemon.test_ingest import make_ingestor, publish
from tests.daemon.test_tls import Pem, make_ca, make_leaf

POLICY = """\
identities:
  alice:
    submit: [team-a]
    read: [team-a]
  bob:
    submit: [team-b]
    read: [team-b]
  carol:                   # may submit for team-c, which hlb.tasks may not carry
    submit: [team-c]
    read: [team-c]
  elsewhere:               # team-b's, but in another cell only
    submit: [team-b]
    read: [team-b]
    cells: [pod-z]
  ops:
    read: ["*"]
  ops-default:
    submit: [default]
kafka:
  topics:
    hlb.tasks: [team-a, team-b, default]
"""
DEVICES = len([e for e in inventory_events("default") if e.HasField("device_upsert")])


def write_policy(path: Path, text: str = POLICY) -> Path:
    path.write_text(textwrap.dedent(text))
    return path


def as_(identity: str) -> tuple[tuple[str, str], ...]:
    return (("x-hlb-identity", identity),)


def task(task_id: str, *dependencies: str) -> ev.TaskSpec:
    return ev.TaskSpec(
        id=task_id, memory_per_device_gb=1, dependencies=[ev.Dependency(task_id=d) for d in dependencies]
    )


def refusal(call: Callable[[], Any]) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as failure:
        call()
    error: Any = failure.value
    return error.code(), error.details()


def denied(call: Callable[[], Any]) -> str:
    """The details of a PERMISSION_DENIED answer (anything else fails the test)."""
    code, details = refusal(call)
    assert code == grpc.StatusCode.PERMISSION_DENIED, details
    return details


# -- the policy file ------------------------------------------------------------------------------


def test_a_task_ids_tenant_is_the_part_before_the_first_slash_else_the_default() -> None:
    policy = AccessPolicy(default_tenant="shared")
    assert policy.tenant_of("team-a/train/7") == "team-a"
    assert policy.tenant_of("train-7") == "shared"
    assert policy.tenant_of("/train-7") == "shared"


def test_grants_hold_for_their_tenants_and_cells_and_star_means_every_one(tmp_path: Path) -> None:
    policy = load_policy(write_policy(tmp_path / "policy.yaml"))
    assert policy.allows("alice", "submit", "team-a", "default")
    assert not policy.allows("alice", "submit", "team-b", "default")
    assert policy.allows("ops", "read", "anything", "any-cell")
    assert not policy.allows("ops", "submit", "team-a", "default")
    assert policy.allows("elsewhere", "read", "team-b", "pod-z")
    assert not policy.allows("elsewhere", "read", "team-b", "default")
    assert not policy.allows(ANONYMOUS, "read", "team-a", "default")  # not named: nothing
    everyone = AccessPolicy.model_validate({"identities": {"*": {"read": ["public"]}}})
    assert everyone.allows(ANONYMOUS, "read", "public", "default")
    assert everyone.allows("alice", "read", "public", "default")
    assert not everyone.allows("alice", "read", "team-a", "default")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("identities:\n  alice:\n    submitt: [team-a]\n", r"line 3: identities\.alice\.submitt: Extra inputs"),
        ("identities:\n  alice:\n    read: [team-a/x]\n", r"line 3: identities\.alice\.read\.0: String should match"),
        ("identities:\n  alice:\n    read: team-a\n", r"line 3: identities\.alice\.read: Input should be"),
        ("identities:\n  alice:\n    cancel: [team-a]\n", r"line 3: identities\.alice\.cancel: .*no gRPC call cancels"),
        ("kafka:\n  topics:\n    hlb.tasks: [a]\n  topic: {}\n", r"line 4: kafka\.topic: Extra inputs"),
        ("identities:\n  alice: {read: [a]}\n  alice: {read: [b]}\n", r"line 3: key 'alice' given twice"),
        ("", r"empty; it would refuse every caller"),
        ("- alice\n", r"must hold a mapping"),
        ("identities: {alice: [\n", r"not valid YAML at line 2"),
    ],
)
def test_a_policy_file_that_does_not_load_names_the_line_and_the_key(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "policy.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message) as failure:
        load_policy(path)
    assert str(path) in str(failure.value)


def test_the_auth_section_loads_and_refuses_a_header_beside_mutual_tls(tmp_path: Path) -> None:
    settings = load_settings(None)
    assert (settings.auth.policy_file, settings.auth.trust_header) == (None, False)
    with pytest.raises(ConfigError, match=r"auth\.policy_file: Path does not point to a file"):
        load_settings(None, auth={"policy_file": str(tmp_path / "missing.yaml")})
    pki = make_pki(tmp_path)
    tls = {
        "cert_file": pki.server.cert,
        "key_file": pki.server.key,
        "client_ca_file": pki.ca.cert,
        "require_client_cert": True,
    }
    with pytest.raises(ConfigError, match=r"auth\.trust_header is for a port without mutual TLS"):
        load_settings(None, grpc={"tls": tls}, auth={"trust_header": True})


def test_a_policy_file_that_does_not_load_stops_the_start(tmp_path: Path) -> None:
    path = tmp_path / "policy.yaml"
    path.write_text("identities:\n  alice:\n    writes: [team-a]\n")
    with pytest.raises(ConfigError, match=r"line 3: identities\.alice\.writes"):
        Daemon(memory_settings(tmp_path, auth={"policy_file": str(path)}), MemoryBus())


# -- gRPC without mutual TLS: the header where it is trusted ---------------------------------------


@dataclass
class Served:
    running: BackgroundDaemon
    stub: api_grpc.SchedulerStub


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """A daemon with the policy above, trusting the identity header, its inventory applied."""
    tmp_path = tmp_path_factory.mktemp("auth")
    policy = write_policy(tmp_path / "policy.yaml")
    settings = memory_settings(
        tmp_path, auth={"policy_file": str(policy), "trust_header": True}, scheduler={"policy": "least-loaded"}
    )
    bus = MemoryBus()
    for event in inventory_events("default"):
        bus.publish(settings.kafka.topics.telemetry, b"default", event.SerializeToString())
    with BackgroundDaemon(settings, bus) as running, grpc.insecure_channel(running.target) as channel:
        stub = api_grpc.SchedulerStub(channel)
        state = api.GetClusterStateRequest()
        wait_for(lambda: stub.GetClusterState(state, metadata=as_("ops"), timeout=5).devices == DEVICES, "inventory")
        yield Served(running, stub)


def test_a_tenant_cannot_take_another_tenants_task_id_first(served: Served) -> None:
    stub = served.stub
    details = denied(lambda: stub.Place(api.PlaceRequest(task=task("team-a/squat")), metadata=as_("bob"), timeout=5))
    assert details == "task: identity 'bob' may not submit tasks of tenant 'team-a' in cell 'default'"
    placed = stub.Place(api.PlaceRequest(task=task("team-a/squat")), metadata=as_("alice"), timeout=5)
    assert placed.placement.task_id == "team-a/squat"  # the owner's submission is no duplicate
    # Nor again once it exists: the same refusal, not a duplicate that would say it does.
    again = denied(lambda: stub.Place(api.PlaceRequest(task=task("team-a/squat")), metadata=as_("bob"), timeout=5))
    assert again == details


def test_reading_another_tenants_task_is_refused_alike_whether_it_exists_or_not(served: Served) -> None:
    stub = served.stub
    stub.Place(api.PlaceRequest(task=task("team-a/read-me")), metadata=as_("alice"), timeout=5)
    assert stub.GetPlacement(api.GetPlacementRequest(task_id="team-a/read-me"), metadata=as_("alice"), timeout=5)
    existing = denied(
        lambda: stub.GetPlacement(api.GetPlacementRequest(task_id="team-a/read-me"), metadata=as_("bob"), timeout=5)
    )
    missing = denied(
        lambda: stub.GetPlacement(api.GetPlacementRequest(task_id="team-a/no-such"), metadata=as_("bob"), timeout=5)
    )
    assert existing == missing == "task_id: identity 'bob' may not read tasks of tenant 'team-a' in cell 'default'"
    code, _ = refusal(
        lambda: stub.GetPlacement(api.GetPlacementRequest(task_id="team-a/no-such"), metadata=as_("alice"), timeout=5)
    )
    assert code == grpc.StatusCode.NOT_FOUND  # its own tenant learns it does not exist
    explain = api.ExplainRequest(task_id="team-a/read-me")
    assert "may not read tasks of tenant 'team-a'" in denied(
        lambda: stub.Explain(explain, metadata=as_("bob"), timeout=5)
    )
    assert stub.Explain(explain, metadata=as_("alice"), timeout=5).placement.task_id == "team-a/read-me"
    hypothetical = api.ExplainRequest(task=task("team-a/what-if"))
    assert "task: identity 'bob' may not read" in denied(
        lambda: stub.Explain(hypothetical, metadata=as_("bob"), timeout=5)
    )
    scores = api.ScoreDevicesRequest(task=task("team-a/what-if"), device_ids=["nope"])
    assert "task: identity 'bob' may not read tasks of tenant 'team-a'" in denied(
        lambda: stub.ScoreDevices(scores, metadata=as_("bob"), timeout=5)
    )


def test_a_batch_with_one_task_of_another_tenant_is_refused_whole(served: Served) -> None:
    stub = served.stub
    batch = api.PlaceBatchRequest(tasks=[task("team-b/batch-0"), task("team-a/batch-1")])
    details = denied(lambda: stub.PlaceBatch(batch, metadata=as_("bob"), timeout=5))
    assert details == "tasks[1]: identity 'bob' may not submit tasks of tenant 'team-a' in cell 'default'"
    code, _ = refusal(
        lambda: stub.GetPlacement(api.GetPlacementRequest(task_id="team-b/batch-0"), metadata=as_("bob"), timeout=5)
    )
    assert code == grpc.StatusCode.NOT_FOUND  # nothing of the batch was taken


def test_a_task_may_depend_only_on_tasks_its_submitter_may_read(served: Served) -> None:
    spec = task("team-b/after", "team-a/squat")
    details = denied(lambda: served.stub.Place(api.PlaceRequest(task=spec), metadata=as_("bob"), timeout=5))
    assert details == ("task.dependencies[0]: identity 'bob' may not read tasks of tenant 'team-a' in cell 'default'")


def test_an_unnamed_caller_is_anonymous_and_the_policy_grants_it_nothing(served: Served) -> None:
    stub = served.stub
    details = denied(lambda: stub.Place(api.PlaceRequest(task=task("plain-id")), timeout=5))
    assert details == "task: identity 'anonymous' may not submit tasks of tenant 'default' in cell 'default'"
    assert denied(lambda: stub.GetClusterState(api.GetClusterStateRequest(), timeout=5)) == (
        "identity 'anonymous' may not read any tenant's tasks in cell 'default'"
    )
    code, details = refusal(lambda: next(iter(stub.WatchPlacements(api.WatchPlacementsRequest(), timeout=5))))
    assert (code, details) == (
        grpc.StatusCode.PERMISSION_DENIED,
        "identity 'anonymous' may not read any tenant's tasks in cell 'default'",
    )


def test_grants_hold_only_in_their_cells(served: Served) -> None:
    details = denied(
        lambda: served.stub.Place(api.PlaceRequest(task=task("team-b/x")), metadata=as_("elsewhere"), timeout=5)
    )
    assert details == "task: identity 'elsewhere' may not submit tasks of tenant 'team-b' in cell 'default'"


def test_a_tenant_the_tasks_topic_may_not_carry_cannot_submit_over_grpc_either(served: Served) -> None:
    """Accepted submissions are recorded on the tasks topic and replayed from it after a restart,
    where ingest would refuse them: the API refuses them first (a dry run records nothing)."""
    stub = served.stub
    details = denied(lambda: stub.Place(api.PlaceRequest(task=task("team-c/1")), metadata=as_("carol"), timeout=5))
    assert "tasks of tenant 'team-c' may not be submitted here" in details
    assert "topic 'hlb.tasks'" in details
    dry = stub.Place(api.PlaceRequest(task=task("team-c/1"), dry_run=True), metadata=as_("carol"), timeout=5)
    assert dry.placement.sequence == 0


def test_watch_placements_shows_a_caller_only_the_tenants_it_may_read(served: Served) -> None:
    stub = served.stub
    for owner, tenant in [("alice", "team-a"), ("bob", "team-b"), ("alice", "team-a"), ("bob", "team-b")]:
        stub.Place(
            api.PlaceRequest(task=task(f"{tenant}/watched-{time.monotonic_ns()}")), metadata=as_(owner), timeout=5
        )
    everything = [p.task_id for p in _first(stub, "ops", lambda p: "watched" in p.task_id, 4)]
    bobs = [p.task_id for p in _first(stub, "bob", lambda p: "watched" in p.task_id, 2)]
    assert [t.split("/")[0] for t in everything] == ["team-a", "team-b", "team-a", "team-b"]
    assert bobs == [t for t in everything if t.startswith("team-b/")]


def test_what_the_api_records_on_the_tasks_topic_passes_ingest_again(served: Served) -> None:
    """Ingest reads back every submission the API recorded (and replays them after a restart):
    none of them is refused for its tenant."""
    running, stub = served.running, served.stub
    stub.Place(api.PlaceRequest(task=task("team-b/recorded")), metadata=as_("bob"), timeout=5)
    stub.Place(api.PlaceRequest(task=task("plain-recorded")), metadata=as_("ops-default"), timeout=5)
    tasks = running.daemon.settings.kafka.topics.tasks
    recorded = len(running.bus.read_all(tasks))
    ingestor = running.daemon.ingest.ingestor
    wait_for(lambda: ingestor.positions.get((tasks, 0), 0) >= recorded, "ingest to read the recorded tasks")
    assert recorded >= 2
    assert running.bus.read_all(running.daemon.settings.kafka.topics.dlq) == []


def _first(stub: api_grpc.SchedulerStub, identity: str, keep: Callable[[ev.Placement], bool], n: int) -> list[Any]:
    stream = stub.WatchPlacements(api.WatchPlacementsRequest(), metadata=as_(identity), timeout=10)
    try:
        return list(itertools.islice((p for p in stream if keep(p)), n))
    finally:
        stream.cancel()  # type: ignore[no-untyped-call]


def test_the_header_is_not_read_unless_the_operator_trusts_it(tmp_path: Path) -> None:
    policy = write_policy(tmp_path / "policy.yaml")
    settings = memory_settings(tmp_path, auth={"policy_file": str(policy)})
    with BackgroundDaemon(settings) as running, grpc.insecure_channel(running.target) as channel:
        stub = api_grpc.SchedulerStub(channel)
        details = denied(lambda: stub.Place(api.PlaceRequest(task=task("team-a/1")), metadata=as_("alice"), timeout=5))
    assert details == "task: identity 'anonymous' may not submit tasks of tenant 'team-a' in cell 'default'"


# -- gRPC with mutual TLS: the certificate's subject CN ---------------------------------------------


@dataclass(frozen=True)
class Pki:
    ca: Pem
    server: Pem
    alice: Pem
    bob: Pem


def make_pki(directory: Path) -> Pki:
    ca = make_ca(directory, "hlb-auth-ca")
    return Pki(
        ca=ca[0],
        server=make_leaf(directory, "server", ca, ExtendedKeyUsageOID.SERVER_AUTH),
        alice=make_leaf(directory, "alice", ca, ExtendedKeyUsageOID.CLIENT_AUTH),
        bob=make_leaf(directory, "bob", ca, ExtendedKeyUsageOID.CLIENT_AUTH),
    )


def test_with_mutual_tls_the_certificate_names_the_caller_and_the_header_is_ignored(tmp_path: Path) -> None:
    pki = make_pki(tmp_path)
    policy = write_policy(tmp_path / "policy.yaml")
    tls = {
        "cert_file": pki.server.cert,
        "key_file": pki.server.key,
        "client_ca_file": pki.ca.cert,
        "require_client_cert": True,
    }
    settings = load_settings(
        None,
        bus="memory",
        state_dir=str(tmp_path / "state"),
        grpc={"listen": f"127.0.0.1:{free_port()}", "tls": tls},
        auth={"policy_file": str(policy)},
    )

    def secure(running: BackgroundDaemon, client: Pem) -> grpc.Channel:
        credentials = channel_credentials(pki.ca.cert, client.cert, client.key)
        return grpc.secure_channel(f"localhost:{running.daemon.port}", credentials)

    with BackgroundDaemon(settings) as running, secure(running, pki.alice) as a, secure(running, pki.bob) as b:
        alice, bob = api_grpc.SchedulerStub(a), api_grpc.SchedulerStub(b)
        placed = alice.Place(api.PlaceRequest(task=task("team-a/tls")), timeout=5)
        details = denied(lambda: bob.Place(api.PlaceRequest(task=task("team-a/tls-2")), timeout=5))
        claimed = denied(
            lambda: bob.GetPlacement(api.GetPlacementRequest(task_id="team-a/tls"), metadata=as_("alice"), timeout=5)
        )
    assert placed.pending.task_id == "team-a/tls"  # no devices: it waits; what matters is that it got through
    assert details == "task: identity 'bob' may not submit tasks of tenant 'team-a' in cell 'default'"
    assert claimed == "task_id: identity 'bob' may not read tasks of tenant 'team-a' in cell 'default'"


# -- without a policy, and on SIGHUP ----------------------------------------------------------------


def test_without_a_policy_everything_is_allowed_and_the_start_says_so_once(tmp_path: Path) -> None:
    running = BackgroundDaemon(memory_settings(tmp_path))
    with capture_logs() as logs, running, grpc.insecure_channel(running.target) as channel:
        stub = api_grpc.SchedulerStub(channel)
        stub.Place(api.PlaceRequest(task=task("team-a/open")), metadata=as_("bob"), timeout=5)
        assert stub.GetPlacement(api.GetPlacementRequest(task_id="team-a/open"), timeout=5).pending
    said = [entry for entry in logs if entry["event"].startswith("authorization off")]
    assert len(said) == 1
    assert said[0]["log_level"] == "warning"


def test_sighup_reads_the_policy_file_again_and_keeps_the_running_one_when_it_does_not_load(tmp_path: Path) -> None:
    policy = write_policy(tmp_path / "policy.yaml")
    config = tmp_path / "config.yaml"
    config.write_text(f"bus: memory\nauth:\n  policy_file: {policy}\n")
    daemon = Daemon(load_settings(config), MemoryBus(), config_path=config)
    assert daemon.access.policy is not None
    assert not daemon.access.policy.allows("bob", "read", "team-a", "default")

    write_policy(policy, POLICY.replace("read: [team-b]", "read: [team-a, team-b]", 1))
    result = asyncio.run(daemon.reload())  # no key changed: the file is read all the same
    assert result.failed == ()
    assert daemon.access.policy.allows("bob", "read", "team-a", "default")

    policy.write_text("identities:\n  bob:\n    reads: [team-a]\n")
    with capture_logs() as logs:
        result = asyncio.run(daemon.reload())
    assert result.failed == ("auth.policy_file",)
    assert daemon.access.policy.allows("bob", "read", "team-a", "default")  # the running policy is kept
    assert any("line 3: identities.bob.reads" in str(entry.get("error")) for entry in logs)

    other = write_policy(tmp_path / "other.yaml", "identities: {}\n")
    config.write_text(f"bus: memory\nauth:\n  policy_file: {other}\n  trust_header: true\n")
    result = asyncio.run(daemon.reload())
    assert set(result.applied) == {"auth.policy_file", "auth.trust_header"}
    assert daemon.access.policy is not None
    assert daemon.access.policy.identities == {}


# -- Kafka: which tenants a topic may carry ---------------------------------------------------------


def test_a_task_event_whose_tenant_its_topic_may_not_carry_is_dead_lettered(tmp_path: Path) -> None:
    access = Access(load_policy(write_policy(tmp_path / "policy.yaml")))
    bus = MemoryBus()
    ingestor = make_ingestor(bus, tenants=access.task_event_refusal)
    tasks = Topics().tasks
    publish(bus, tasks, ev.TaskEvent(submitted=ev.TaskSpec(id="team-a/ok")).SerializeToString())
    publish(bus, tasks, ev.TaskEvent(submitted=ev.TaskSpec(id="team-c/squat")).SerializeToString())
    publish(bus, tasks, ev.TaskEvent(cancelled=ev.EntityRef(id="team-c/other")).SerializeToString())
    publish(bus, tasks, ev.TaskEvent(cancelled=ev.EntityRef(id="team-a/ok")).SerializeToString())
    publish(bus, tasks, ev.TaskEvent(finished=ev.TaskFinished(task_id="team-c/x")).SerializeToString())
    drain(ingestor)
    assert ingestor.stats.applied == 2
    assert dict(ingestor.stats.rejected) == {"tenant_not_allowed": 3}
    assert "team-c/squat" not in ingestor.scheduler.graph.tasks
    dead = [dict(r.headers) for r in bus.read_all(Topics().dlq)]
    assert [h["hlb.error.reason"] for h in dead] == [b"tenant_not_allowed"] * 3
    assert dead[0]["hlb.error.message"] == (
        b"task 'team-c/squat' is of tenant 'team-c', which topic 'hlb.tasks' may not carry (kafka.topics)"
    )


def test_a_topic_the_policy_does_not_list_carries_every_tenant(tmp_path: Path) -> None:
    access = Access(load_policy(write_policy(tmp_path / "policy.yaml", "identities: {}\n")))
    bus = MemoryBus()
    ingestor = make_ingestor(bus, tenants=access.task_event_refusal)
    publish(bus, Topics().tasks, ev.TaskEvent(submitted=ev.TaskSpec(id="team-c/1")).SerializeToString())
    drain(ingestor)
    assert ingestor.stats.applied == 1


def test_the_daemons_ingest_refuses_a_tenant_its_tasks_topic_may_not_carry(tmp_path: Path) -> None:
    policy = write_policy(tmp_path / "policy.yaml")
    settings = memory_settings(tmp_path, auth={"policy_file": str(policy)})
    topics = settings.kafka.topics
    with BackgroundDaemon(settings) as running:
        running.bus.publish(topics.tasks, b"default", ev.TaskEvent(submitted=task("team-c/k")).SerializeToString())
        running.bus.publish(topics.tasks, b"default", ev.TaskEvent(submitted=task("team-b/k")).SerializeToString())
        wait_for(lambda: "team-b/k" in running.daemon.scheduler.graph.tasks, "the allowed task")
        dead = running.bus.read_all(topics.dlq)
    assert [dict(r.headers)["hlb.error.reason"] for r in dead] == [b"tenant_not_allowed"]
    assert "team-c/k" not in running.daemon.scheduler.graph.tasks
