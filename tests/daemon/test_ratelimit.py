"""The request-rate limit: a token bucket on an injected clock, and RESOURCE_EXHAUSTED on a real server."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from hlb.daemon.config import load_settings
from hlb.daemon.errors import ConfigError
from hlb.daemon.serve.ratelimit import TokenBucket, default_burst
from hlb.sim.kafka_local import free_port
from hlb.v1 import events_pb2 as ev
from hlb.v1 import scheduler_pb2 as api
from hlb.v1 import scheduler_pb2_grpc as api_grpc
from tests.daemon.background import BackgroundDaemon


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


def test_the_bucket_starts_full_and_refills_at_its_rate() -> None:
    clock = FakeClock()
    bucket = TokenBucket(rate_per_s=2.0, burst=3, clock=clock)
    assert [bucket.try_take() for _ in range(4)] == [True, True, True, False]
    clock.now_s += 0.25  # half a token
    assert not bucket.try_take()
    clock.now_s += 0.25
    assert bucket.try_take()
    assert not bucket.try_take()
    clock.now_s += 60  # a long quiet spell refills to the burst, no more
    assert [bucket.try_take() for _ in range(4)] == [True, True, True, False]


def test_reconfiguring_keeps_tokens_up_to_the_new_burst() -> None:
    clock = FakeClock()
    bucket = TokenBucket(rate_per_s=10.0, burst=10, clock=clock)
    bucket.configure(rate_per_s=1.0, burst=2)
    assert [bucket.try_take() for _ in range(3)] == [True, True, False]
    clock.now_s += 1.0
    assert bucket.try_take()


@pytest.mark.parametrize(("rate", "burst"), [(0.0, 1), (-1.0, 1), (float("nan"), 1), (float("inf"), 1), (1.0, 0)])
def test_a_bucket_refuses_nonsense(rate: float, burst: int) -> None:
    with pytest.raises(ValueError, match=r"rate must be|burst must be"):
        TokenBucket(rate, burst)


def test_default_burst_is_one_seconds_worth() -> None:
    assert default_burst(50.0, 0) == 50
    assert default_burst(0.5, 0) == 1
    assert default_burst(50.0, 7) == 7


def test_requests_past_the_limit_get_resource_exhausted_and_health_is_exempt() -> None:
    clock = FakeClock()  # frozen: no token comes back during the test
    settings = load_settings(
        None,
        bus="memory",
        grpc={"listen": f"127.0.0.1:{free_port()}", "max_requests_per_s": 1.0, "request_burst": 2},
    )
    with BackgroundDaemon(settings, monotonic=clock) as running, grpc.insecure_channel(running.target) as channel:
        stub = api_grpc.SchedulerStub(channel)
        for _ in range(2):
            stub.GetClusterState(api.GetClusterStateRequest(), timeout=5)
        with pytest.raises(grpc.RpcError) as limited:
            stub.GetClusterState(api.GetClusterStateRequest(), timeout=5)
        assert limited.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "rate limit of 1 requests/s exceeded" in (limited.value.details() or "")
        # A refused Place changes nothing: the task is unknown afterwards.
        with pytest.raises(grpc.RpcError) as place_limited:
            stub.Place(api.PlaceRequest(task=ev.TaskSpec(id="limited")), timeout=5)
        assert place_limited.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "limited" not in running.daemon.scheduler.graph.tasks
        health = health_pb2_grpc.HealthStub(channel)
        for _ in range(5):
            reply = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        clock.now_s += 1.0
        stub.GetClusterState(api.GetClusterStateRequest(), timeout=5)
        limited_count = running.daemon.metrics.registry.get_sample_value(
            "hlb_rpc_rate_limited_total", {"rpc": "GetClusterState"}
        )
        assert limited_count == 1.0


def test_no_limit_by_default() -> None:
    settings = load_settings(None, bus="memory", grpc={"listen": f"127.0.0.1:{free_port()}"})
    with BackgroundDaemon(settings) as running, grpc.insecure_channel(running.target) as channel:
        stub = api_grpc.SchedulerStub(channel)
        for _ in range(50):
            stub.GetClusterState(api.GetClusterStateRequest(), timeout=5)
        assert running.daemon.rate_limit.bucket is None


@pytest.mark.parametrize("rate", [-1.0, float("inf"), float("nan")])
def test_a_nonsense_rate_in_the_config_is_a_config_error(rate: float) -> None:
    with pytest.raises(ConfigError, match=r"grpc\.max_requests_per_s"):
        load_settings(None, grpc={"max_requests_per_s": rate})
