"""Configuration: config.yaml, then HLB_ environment variables; bad values name their key, exit 78."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from hlb.daemon.config import EX_CONFIG, load_settings
from hlb.daemon.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]


def test_the_shipped_config_yaml_loads_with_its_documented_defaults() -> None:
    settings = load_settings(REPO / "config.yaml")
    assert settings.bus == "kafka"
    assert settings.kafka.topics.placements == "hlb.placements"
    assert settings.grpc.listen == "127.0.0.1:50051"
    assert settings.scheduler.profiles == "nameplate"
    assert settings.scheduler.policy == "gnn"
    assert load_settings(None).scheduler.policy == "gnn"  # the same without a file


def test_the_removed_gnn_shortlist_is_refused_saying_why(tmp_path: Path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text("model:\n  shortlist: 64\n")
    with pytest.raises(ConfigError, match=r"model\.shortlist is gone"):
        load_settings(config)


def test_environment_overrides_yaml_with_double_underscore_nesting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "config.yaml"
    config.write_text("kafka:\n  bootstrap_servers: yaml-host:9092\n  batch_size: 10\n")
    monkeypatch.setenv("HLB_KAFKA__BOOTSTRAP_SERVERS", "env-host:9093")
    settings = load_settings(config)
    assert settings.kafka.bootstrap_servers == "env-host:9093"
    assert settings.kafka.batch_size == 10  # the rest of the section still comes from the file


def test_an_invalid_value_names_its_key(tmp_path: Path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text("kafka:\n  batch_size: -3\n")
    with pytest.raises(ConfigError, match=r"kafka\.batch_size"):
        load_settings(config)


def test_an_unknown_key_is_an_error_not_silently_ignored(tmp_path: Path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text("grpc:\n  lisen: 127.0.0.1:1\n")
    with pytest.raises(ConfigError, match=r"grpc\.lisen"):
        load_settings(config)


def test_a_missing_config_file_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not found"):
        load_settings(tmp_path / "absent.yaml")


def test_secrets_in_client_config_are_not_shown_in_errors(tmp_path: Path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text("kafka:\n  client_config:\n    sasl.password: [hunter2]\n")
    with pytest.raises(ConfigError) as error:
        load_settings(config)
    assert "hunter2" not in str(error.value)


def test_serve_with_a_bad_value_exits_78_naming_the_key(tmp_path: Path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text("log:\n  level: loud\n")
    result = _serve(config)
    assert result.returncode == EX_CONFIG
    assert "log.level" in result.stderr


def test_librdkafka_keys_hlb_depends_on_cannot_be_overridden_and_the_error_names_them(tmp_path: Path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(
        "kafka:\n  client_config:\n    enable.auto.offset.store: 'true'\n    fetch.wait.max.ms: '5'\n"
        "    group.instance.id: x\n"
    )
    with pytest.raises(ConfigError) as error:
        load_settings(config)
    message = str(error.value)
    assert "enable.auto.offset.store: offsets are stored only after a batch is applied" in message
    assert "group.instance.id: set kafka.group_instance_id" in message
    assert "fetch.wait.max.ms" not in message  # a tunable: allowed


def test_tunables_override_hlb_defaults_while_fixed_keys_and_static_membership_reach_librdkafka() -> None:
    from hlb.daemon.bus.kafka import KafkaSource

    settings = load_settings(
        None,
        kafka={
            "bootstrap_servers": "127.0.0.1:1",  # nothing listens: the consumer is made, never used
            "group_instance_id": "hlb-host-a",
            "client_config": {"fetch.wait.max.ms": "5", "session.timeout.ms": "30000"},
        },
    )
    source = KafkaSource(settings.kafka, ["t"], "g")
    try:
        assert source.config["fetch.wait.max.ms"] == "5"  # hlb's default is 50
        assert source.config["session.timeout.ms"] == "30000"
        assert source.config["group.instance.id"] == "hlb-host-a"
        assert source.config["enable.auto.offset.store"] is False
        assert source.config["group.id"] == "g"
    finally:
        source.close()
    default = KafkaSource(load_settings(None, kafka={"bootstrap_servers": "127.0.0.1:1"}).kafka, ["t"], "g")
    try:
        assert "group.instance.id" not in default.config
        assert default.config["fetch.wait.max.ms"] == 50
        assert default.config["fetch.queue.backoff.ms"] == 10  # librdkafka's 1 s idled a catching-up ingest
    finally:
        default.close()


def test_cells_need_kafka_and_a_static_instance_id() -> None:
    with pytest.raises(ConfigError, match="group_instance_id"):
        load_settings(None, cells={"enabled": True})
    with pytest.raises(ConfigError, match="bus: kafka"):
        load_settings(None, bus="memory", cells={"enabled": True}, kafka={"group_instance_id": "i1"})
    with pytest.raises(ConfigError, match=r"cells\.advertise"):
        load_settings(None, cells={"advertise": "no-port"})
    settings = load_settings(None, cells={"enabled": True, "partitions": 12}, kafka={"group_instance_id": "i1"})
    assert settings.cells.partitions == 12


def test_models_tried_by_cells_need_one_named_canary_cell() -> None:
    cells = {"cells": {"enabled": True}, "kafka": {"group_instance_id": "i1"}}
    with pytest.raises(ConfigError, match=r"learning\.canary_cell"):
        load_settings(None, learning={"auto_models": True}, **cells)
    settings = load_settings(None, learning={"auto_models": True, "canary_cell": "cell-03"}, **cells)
    assert settings.learning.canary_cell == "cell-03"


def _serve(config: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "hlb.cli", "serve", "--config", str(config)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
        check=False,
    )


@pytest.mark.parametrize(
    ("text", "where"),
    [
        ("log: [\n", "line 2, column 1: expected the node content"),  # an unclosed flow list
        ("log:\n\tlevel: info\n", "line 2, column 1: found character '\\t'"),  # YAML forbids tab indents
        ("log:\n  level: info\n format: json\n", "line 3, column 2: expected <block end>"),
    ],
    ids=["unclosed", "tab", "indent"],
)
def test_a_file_that_is_not_yaml_is_a_config_error_with_line_and_column(tmp_path: Path, text: str, where: str) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(text)
    with pytest.raises(ConfigError, match=rf"^config file {config}: not valid YAML at ") as error:
        load_settings(config)
    assert where in str(error.value)


@pytest.mark.parametrize(("text", "found"), [("- log\n- grpc\n", "a list"), ("hello\n", "a single value")])
def test_a_file_without_a_mapping_of_sections_says_so(tmp_path: Path, text: str, found: str) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(text)
    with pytest.raises(ConfigError, match=f"must hold a mapping of sections .*, found {found}$"):
        load_settings(config)


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("log: [\n", "not valid YAML at line 2, column 1"),
        ("- log\n", "must hold a mapping of sections"),
        ("grpc:\n  listen: notanaddress\n", "grpc.listen"),
    ],
    ids=["syntax", "list", "grpc-listen"],
)
def test_serve_with_a_broken_file_exits_78_with_one_message(tmp_path: Path, text: str, says: str) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(text)
    result = _serve(config)
    assert result.returncode == EX_CONFIG
    assert result.stderr.startswith(f"hlb: config file {config}: ")
    assert says in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    "listen",
    ["notanaddress", "", "127.0.0.1", "127.0.0.1:99999", "127.0.0.1:-1", ":50051", "::1:50051", "[::1", "unix:"],
)
def test_an_unusable_grpc_listen_address_names_its_key(listen: str) -> None:
    with pytest.raises(ConfigError, match=r"grpc\.listen: Value error, expected host:port"):
        load_settings(None, grpc={"listen": listen})


@pytest.mark.parametrize(
    "listen",
    [
        "127.0.0.1:0",
        "127.0.0.1:50051",
        "0.0.0.0:50051",
        "localhost:65535",
        "[::]:50051",
        "[::1]:0",
        "unix:/run/hlb/grpc.sock",
        "unix:///run/hlb/grpc.sock",
        "unix-abstract:hlb",
    ],
)
def test_grpc_listen_takes_host_port_bracketed_ipv6_and_unix_sockets(listen: str) -> None:
    assert load_settings(None, grpc={"listen": listen}).grpc.listen == listen


def test_every_host_port_address_refuses_a_port_beyond_65535() -> None:
    for key, section in [
        ("metrics.listen", {"metrics": {"listen": "127.0.0.1:65536"}}),
        ("kafka.bootstrap_servers", {"kafka": {"bootstrap_servers": "a:9092,b:70000"}}),
        ("cells.advertise", {"cells": {"advertise": "10.0.0.1:123456"}}),
    ]:
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            load_settings(None, **section)
    assert load_settings(None, metrics={"listen": "[::]:9464"}).metrics.listen == "[::]:9464"


def test_an_unknown_top_level_key_does_not_point_at_an_environment_variable(tmp_path: Path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text("bogus: 1\nlog:\n  bogus: 2\n")
    with pytest.raises(ConfigError) as error:
        load_settings(config)
    lines = str(error.value).splitlines()
    assert "  bogus: Extra inputs are not permitted (got 1)" in lines  # HLB_BOGUS would set nothing
    assert "  log.bogus: Extra inputs are not permitted (got 2; env HLB_LOG__BOGUS)" in lines


def test_malformed_json_in_an_environment_variable_names_the_variable_not_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "config.yaml"
    config.write_text("log:\n  level: info\n")
    monkeypatch.setenv("HLB_KAFKA__CLIENT_CONFIG", '{"sasl.password": s3cr3t')
    with pytest.raises(ConfigError) as error:
        load_settings(config)
    message = str(error.value)
    assert message.startswith("environment variable HLB_KAFKA__CLIENT_CONFIG: not valid JSON")
    assert str(config) not in message
    assert "s3cr3t" not in message


def test_every_limit_has_a_default_documented_in_config_yaml() -> None:
    from hlb.daemon.config import LimitsSettings

    shipped = load_settings(REPO / "config.yaml")
    assert shipped.limits == LimitsSettings() == load_settings(None).limits
    text = (REPO / "config.yaml").read_text()
    for name, value in LimitsSettings().model_dump().items():
        assert f"  {name}: {value:g}" in text, f"limits.{name} is not documented with its default"
    assert shipped.limits.text_bytes == 1024
    assert shipped.kafka.dead_letter_max_bytes == 1_000_000


def test_a_limit_out_of_its_range_names_its_key(tmp_path: Path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text("limits:\n  id_bytes: 300\n")  # the graph refuses ids over 256 bytes itself
    with pytest.raises(ConfigError, match=r"limits\.id_bytes"):
        load_settings(config)


def test_the_producer_limit_fits_every_accepted_event_and_dead_letter_and_the_consumers_fetch_it() -> None:
    from hlb.daemon.bus.kafka import KafkaSource

    settings = load_settings(None, kafka={"bootstrap_servers": "127.0.0.1:1", "max_event_bytes": 4 << 20})
    assert settings.kafka.record_max_bytes == (4 << 20) + 64 * 1024
    source = KafkaSource(settings.kafka, ["t"], "g")  # librdkafka checks fetch.max.bytes against it
    try:
        assert source.config["message.max.bytes"] == settings.kafka.record_max_bytes
    finally:
        source.close()
    with pytest.raises(ConfigError, match=r"message\.max\.bytes: set from kafka\.max_event_bytes"):
        load_settings(None, kafka={"client_config": {"message.max.bytes": "1000000"}})
    with pytest.raises(ConfigError, match=r"fetch\.max\.bytes must be at least 1114112"):
        load_settings(None, kafka={"client_config": {"fetch.max.bytes": "1048576"}})
    assert load_settings(None, kafka={"client_config": {"fetch.max.bytes": "2000000"}})
