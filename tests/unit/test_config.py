"""Settings: defaults, the TOML file, LBD_* environment, flags, invariants, and `lbd config`."""

from __future__ import annotations

import argparse
import dataclasses
import re
from pathlib import Path

import pytest
from pydantic import ValidationError

from lbd.cli.main import main
from lbd.config import (
    INVARIANTS,
    EtcdSettings,
    Section,
    Settings,
    SettingsError,
    add_cluster_flags,
    load_settings,
    render_defaults,
    settings_from_args,
)
from lbd.config.schema import section_models
from lbd.core.errors import InvalidInputError
from lbd.core.settings import AssignmentConfig, SheddingConfig, SplitConfig

EXAMPLE = Path(__file__).resolve().parents[2] / "deploy" / "lbd.example.toml"


def write(tmp_path: Path, text: str, name: str = "lbd.toml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def problems_of(
    path: Path | None,
    env: dict[str, str] | None = None,
    overrides: dict[str, object] | None = None,
) -> list[str]:
    """The problem lines loading ``path`` gives (failing the test if it loads)."""
    with pytest.raises(SettingsError) as info:
        load_settings(path, env={} if env is None else env, overrides=overrides)
    assert isinstance(info.value, InvalidInputError)
    return list(info.value.problems)


# --- defaults ---------------------------------------------------------------------------------


def test_defaults_are_valid_and_match_the_core_dataclasses() -> None:
    settings = load_settings(None, env={})
    assert settings == Settings()
    assert settings.shedding.to_core() == SheddingConfig()
    assert settings.split.to_core() == SplitConfig()
    assert settings.assignment.to_core() == AssignmentConfig()
    assert settings.cluster.name == "standalone"
    assert settings.cluster.etcd_prefix == "/lbd/standalone"
    assert settings.grpc.addr == "127.0.0.1:7000"
    assert settings.broker.auto_ack is False
    assert settings.monitor.inflight_timeout_s == 30
    assert settings.monitor.tombstone_after_s == 3600
    assert settings.pulsar.state_channel_topic == (
        "persistent://pulsar/system/loadbalancer-service-unit-state"
    )


@pytest.mark.parametrize(
    ("section", "core"),
    [("shedding", SheddingConfig), ("split", SplitConfig), ("assignment", AssignmentConfig)],
)
def test_every_core_knob_is_a_key_with_the_core_default(section: str, core: type) -> None:
    model = section_models()[section]
    instance = model()
    for field in dataclasses.fields(core):
        assert field.name in model.model_fields, f"{section}.{field.name} missing"
        assert getattr(instance, field.name) == getattr(core(), field.name)


def test_core_values_pass_through_to_core() -> None:
    settings = load_settings(
        None, env={}, overrides={"shedding.target_std": 0.5, "split.max_topics": 7}
    )
    assert settings.shedding.to_core().target_std == 0.5
    assert settings.split.to_core().max_topics == 7


def test_every_key_is_documented() -> None:
    for name, model in section_models().items():
        assert model.__doc__ and f"[{name}]" in model.__doc__
        for attr, field in model.model_fields.items():
            assert field.description and len(field.description) > 20, f"{name}.{attr}"


def test_defaults_output_round_trips(tmp_path: Path) -> None:
    text = render_defaults()
    path = write(tmp_path, text)
    assert load_settings(path, env={}) == Settings()
    for name, model in section_models().items():
        assert f"\n[{name}]\n" in text
        for attr, field in model.model_fields.items():
            assert f"\n{field.alias or attr} = " in text


def test_example_config_is_the_defaults_output() -> None:
    assert EXAMPLE.read_text(encoding="utf-8") == render_defaults(), (
        "regenerate: lbd config defaults > deploy/lbd.example.toml"
    )


# --- file errors ------------------------------------------------------------------------------


def test_out_of_range_value_names_file_section_key_and_value(tmp_path: Path) -> None:
    path = write(tmp_path, "[etcd]\nlease_ttl_s = -1\n")
    assert problems_of(path) == [f"{path}: etcd.lease_ttl_s: must be >= 2 (got -1)"]


def test_unknown_key_names_section_and_suggests(tmp_path: Path) -> None:
    path = write(tmp_path, "[etcd]\nlease_ttl = 10\n")
    assert problems_of(path) == [
        f"{path}: etcd.lease_ttl: unknown key in section [etcd] (did you mean 'lease_ttl_s'?)"
    ]


def test_unknown_section_and_stray_top_level_key(tmp_path: Path) -> None:
    path = write(tmp_path, 'name = "x"\n[shedder]\ntarget_std = 0.1\n')
    assert problems_of(path) == [
        f"{path}: name: unknown top-level key",
        f"{path}: shedder: unknown section (did you mean 'shedding'?)",
    ]


def test_section_that_is_not_a_table(tmp_path: Path) -> None:
    path = write(tmp_path, "etcd = 5\n")
    assert problems_of(path) == [f"{path}: etcd: must be a table [etcd] (got 5)"]


@pytest.mark.parametrize(
    ("toml", "expected"),
    [
        ('[etcd]\nlease_ttl_s = "x"', 'etcd.lease_ttl_s: must be an integer (got "x")'),
        ("[etcd]\nlease_ttl_s = 2.5", "etcd.lease_ttl_s: must be a whole number (got 2.5)"),
        ('[etcd]\nendpoints = "http://a:1"', 'etcd.endpoints: must be a list (got "http://a:1")'),
        ("[etcd]\nendpoints = []", "etcd.endpoints: must have at least 1 item(s) (got [])"),
        (
            '[etcd]\nendpoints = ["ftp://a:1"]',
            "etcd.endpoints[0]: must be a URL starting with http:// or https://",
        ),
        (
            '[etcd]\nsession_expired_policy = "retry"',
            "etcd.session_expired_policy: must be one of 'reconnect' or 'shutdown' (got \"retry\")",
        ),
        ('[broker]\nauto_ack = "maybe"', 'broker.auto_ack: must be true or false (got "maybe")'),
        ('[broker]\nbroker_id = "a/b"', "broker.broker_id: must be letters, digits"),
        ("[cluster]\nname = 3", "cluster.name: must be a string (got 3)"),
        ('[cluster]\netcd_prefix = "lbd/x/"', "cluster.etcd_prefix: must start with '/'"),
        ('[grpc]\naddr = "7000"', "grpc.addr: must be HOST:PORT with a port in 0..65535"),
        ('[grpc]\naddr = "host:70000"', "grpc.addr: must be HOST:PORT"),
        ('[pulsar]\nservice_url = "localhost:6650"', "pulsar.service_url: must be a URL"),
        (
            '[pulsar]\nstate_channel_topic = "non-persistent://pulsar/system/x"',
            "pulsar.state_channel_topic: must be a persistent:// topic",
        ),
        ('[pulsar]\nbroker_load_topic = "my-topic"', "pulsar.broker_load_topic: invalid topic"),
        (
            '[split]\nalgorithm = "specified_positions_divide"',
            "split.algorithm: must be one of 'range_equally_divide'",
        ),
        ("[shedding]\ntarget_std = 0", "shedding.target_std: must be > 0 (got 0)"),
        ('[logging]\nlevel = "LOUD"', "logging.level: must be one of 'DEBUG'"),
        ("[monitor]\ntombstone_after_s = 10", "monitor.tombstone_after_s: must be >= 30"),
    ],
)
def test_wrong_values_are_reported_by_key(tmp_path: Path, toml: str, expected: str) -> None:
    path = write(tmp_path, toml + "\n")
    problems = problems_of(path)
    assert len(problems) == 1, problems
    assert problems[0].startswith(f"{path}: {expected}"), problems[0]


def test_bad_toml_gives_line_and_column(tmp_path: Path) -> None:
    path = write(tmp_path, "[etcd]\nlease_ttl_s = = 3\n")
    [problem] = problems_of(path)
    assert problem.startswith(f"{path}: invalid TOML: ")
    assert "line 2, column" in problem


def test_missing_and_non_utf8_files(tmp_path: Path) -> None:
    assert problems_of(tmp_path / "absent.toml") == [
        f"{tmp_path / 'absent.toml'}: cannot read: No such file or directory"
    ]
    binary = tmp_path / "bin.toml"
    binary.write_bytes(b"[etcd]\n\xff\n")
    assert problems_of(binary) == [f"{binary}: not UTF-8 text (byte 7)"]


def test_optional_keys_take_empty_string_as_unset(tmp_path: Path) -> None:
    path = write(
        tmp_path, '[broker]\nbroker_id = ""\n[metrics]\naddr = ""\n[grpc]\nadmin_token = ""\n'
    )
    settings = load_settings(path, env={})
    assert settings.broker.broker_id is None
    assert settings.metrics.addr is None
    assert settings.grpc.admin_token is None


def test_case_insensitive_log_level_and_json_key(tmp_path: Path) -> None:
    path = write(tmp_path, '[logging]\nlevel = "debug"\njson = true\n')
    settings = load_settings(path, env={})
    assert settings.logging.level == "DEBUG"
    assert settings.logging.json_lines is True


def test_cluster_name_sets_the_default_prefix_unless_one_is_given(tmp_path: Path) -> None:
    assert load_settings(write(tmp_path, '[cluster]\nname = "prod"\n'), env={}).cluster == (
        load_settings(None, env={}, overrides={"cluster.name": "prod"}).cluster
    )
    named = load_settings(write(tmp_path, '[cluster]\nname = "prod"\n'), env={})
    assert named.cluster.etcd_prefix == "/lbd/prod"
    given = write(tmp_path, '[cluster]\nname = "prod"\netcd_prefix = "/x/y"\n')
    assert load_settings(given, env={}).cluster.etcd_prefix == "/x/y"


# --- invariants -------------------------------------------------------------------------------

INVARIANT_CASES = [
    (
        "[etcd]\nlease_ttl_s = 9\nkeepalive_interval_s = 3\nrequest_timeout_s = 1\n"
        "fence_after_s = 10\n[monitor]\norphan_cleanup_grace_s = 9",
        "etcd.keepalive_interval_s: must be < etcd.lease_ttl_s / 3 = 3 (got 3)",
    ),
    (
        "[etcd]\nrequest_timeout_s = 1.2",
        "etcd.request_timeout_s: etcd.keepalive_interval_s + 2 x etcd.request_timeout_s must be "
        "<= etcd.lease_ttl_s (0.8 + 2 x 1.2 = 3.2 > 3)",
    ),
    (
        "[etcd]\nfence_after_s = 2.5",
        "etcd.fence_after_s: must be >= etcd.lease_ttl_s = 3 (got 2.5)",
    ),
    (
        "[monitor]\norphan_cleanup_grace_s = 1",
        "etcd.fence_after_s: etcd.fence_after_s + broker.serving_lease_s + etcd.fence_margin_s "
        "must be <= monitor.orphan_cleanup_grace_s + the hand-over wait "
        "(etcd.channel_fence_after_s + broker.serving_lease_s + etcd.fence_margin_s), that is "
        "fence_after_s <= orphan_cleanup_grace_s + channel_fence_after_s (3 > 1 + 1.5)",
    ),
    (
        "[etcd]\nchannel_fence_after_s = 1.5\nfence_check_interval_s = 0.75",
        "etcd.channel_fence_after_s: must be > 2 x etcd.fence_check_interval_s = 1.5 (got 1.5)",
    ),
    (
        "[broker]\nrelease_ack_timeout_s = 27",
        "broker.release_ack_timeout_s: broker.release_ack_timeout_s + broker.serving_lease_s + "
        "etcd.fence_margin_s must be < monitor.inflight_timeout_s (27 + 2 + 1 = 30 >= 30)",
    ),
    (
        "[broker]\nown_ack_timeout_s = 30\n[assignment]\nsettle_timeout_s = 31",
        "broker.own_ack_timeout_s: must be < monitor.inflight_timeout_s = 30 (got 30)",
    ),
    (
        "[front]\ndrain_timeout_s = 3",
        "front.drain_timeout_s: must be < broker.release_ack_timeout_s = 3 (got 3)",
    ),
    (
        "[front]\nlookup_hold_s = 30",
        "front.lookup_hold_s: must be < 30, the Pulsar client's operation timeout in seconds "
        "(got 30)",
    ),
    (
        "[assignment]\nsettle_timeout_s = 3",
        "assignment.settle_timeout_s: must be > broker.own_ack_timeout_s = 3 (got 3)",
    ),
    (
        "[etcd]\nfence_check_interval_s = 0.9\nchannel_fence_after_s = 2",
        "etcd.fence_check_interval_s: must be <= etcd.keepalive_interval_s = 0.8 (got 0.9)",
    ),
    ("[etcd]\nretry_s = 3", "etcd.retry_s: must be < etcd.lease_ttl_s = 3 (got 3)"),
    (
        "[pulsar]\npublish_timeout_s = 30",
        "pulsar.publish_timeout_s: must be < assignment.settle_timeout_s = 30 (got 30)",
    ),
    (
        "[broker]\nsilence_timeout_s = 2",
        "broker.silence_timeout_s: must be > broker.serving_lease_s = 2 (got 2)",
    ),
    (
        "[monitor]\ninflight_timeout_s = 40\ntombstone_after_s = 40",
        "monitor.tombstone_after_s: must be > monitor.inflight_timeout_s = 40 (got 40)",
    ),
    (
        "[load_report]\ninterval_s = 1000",
        "shedding.load_data_ttl_s: must be >= 2 x load_report.interval_s = 2000 (got 1800)",
    ),
    (
        '[pulsar]\ntop_bundles_topic = "non-persistent://pulsar/system/'
        'loadbalancer-broker-load-data"',
        "pulsar.state_channel_topic: state_channel_topic, broker_load_topic and "
        "top_bundles_topic must be distinct",
    ),
    (
        '[metrics]\naddr = "127.0.0.1:7000"',
        "metrics.addr: must differ from grpc.addr (both are '127.0.0.1:7000')",
    ),
    ('[history]\nenabled = true\nuri = ""', "history.uri: must be set when history.enabled"),
    (
        '[grpc]\naddr = "0.0.0.0:7000"\nadvertised_addr = "10.0.0.5:7000"',
        "grpc.addr: 0.0.0.0:7000 is reachable from other hosts, but the API has no TLS "
        "(grpc.tls_cert_file, grpc.tls_key_file) and no authentication",
    ),
    (
        '[grpc]\nadmin_token = "t"\n[auth]\nanonymous_role = "admin"',
        'auth.anonymous_role: is "admin" while credentials are configured',
    ),
]


@pytest.mark.parametrize(("toml", "expected"), INVARIANT_CASES)
def test_each_invariant_violation_is_reported(tmp_path: Path, toml: str, expected: str) -> None:
    path = write(tmp_path, toml + "\n")
    problems = problems_of(path)
    assert len(problems) == 1, problems
    assert problems[0].startswith(f"{path}: {expected}"), problems[0]


def test_every_invariant_has_a_case() -> None:
    covered = {expected.split(":")[0] for _, expected in INVARIANT_CASES}
    assert covered == {rule.keys[0] for rule in INVARIANTS}


def test_fencing_rule_allows_the_exact_bound(tmp_path: Path) -> None:
    path = write(tmp_path, "[etcd]\nfence_after_s = 4\n[monitor]\norphan_cleanup_grace_s = 2.5\n")
    assert load_settings(path, env={}).monitor.orphan_cleanup_grace_s == 2.5


def test_settings_built_in_code_are_checked_too() -> None:
    expected = "etcd.fence_after_s: must be >= etcd.lease_ttl_s"
    with pytest.raises(ValidationError, match=re.escape(expected)):
        Settings(etcd=EtcdSettings(fence_after_s=2.5))


def test_all_problems_are_reported_together(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "[etcd]\nlease_ttl_s = -1\nlease_tll_s = 3\n"
        '[grpc]\naddr = "nope"\n'
        "[monitor]\ninflight_timeout_s = 40\ntombstone_after_s = 40\n"
        "[broker]\nrelease_ack_timeout_s = 50\n"
        '[logging]\nlevel = "LOUD"\n',
    )
    problems = problems_of(path)
    keys = [p.removeprefix(f"{path}: ").split(":")[0] for p in problems]
    assert keys == [
        "etcd.lease_ttl_s",
        "etcd.lease_tll_s",
        "grpc.addr",
        "logging.level",
        "monitor.tombstone_after_s",
    ]
    # Rules over a section that failed are skipped rather than judged on stand-in values: the
    # fencing rules, and the release rule, which reads etcd.fence_margin_s.
    assert not any("fence" in p for p in problems)


def test_invariant_is_blamed_on_where_its_keys_were_set(tmp_path: Path) -> None:
    path = write(tmp_path, "[etcd]\nlease_ttl_s = 3\n")
    problems = problems_of(path, env={"LBD_ETCD__KEEPALIVE_INTERVAL_S": "1"})
    assert problems == [
        "env LBD_ETCD__KEEPALIVE_INTERVAL_S: etcd.keepalive_interval_s: must be < "
        "etcd.lease_ttl_s / 3 = 1 (got 1): the lease must survive two failed renewals in a row"
    ]


# --- environment and flags --------------------------------------------------------------------


def test_env_overrides_file_including_short_aliases(tmp_path: Path) -> None:
    path = write(
        tmp_path, '[etcd]\nreconnect_retries = 20\n[pulsar]\nservice_url = "pulsar://f:1"\n'
    )
    settings = load_settings(
        path,
        env={
            "LBD_PULSAR_URL": "pulsar://env:6650",
            "LBD_ETCD_ENDPOINTS": "http://a:2379, http://b:2379",
            "LBD_CLUSTER": "prod",
            "LBD_ETCD__RECONNECT_RETRIES": "30",
            "LBD_BROKER__AUTO_ACK": "true",
            "LBD_LOGGING__JSON": "1",
            "LBD_GRPC__ADMIN_TOKEN": "s3cret",
            "LBD_DEVCLUSTER_BIN": "/ignored",  # not a settings name: left alone
            "OTHER": "x",
        },
    )
    assert settings.pulsar.service_url == "pulsar://env:6650"
    assert settings.etcd.endpoints == ["http://a:2379", "http://b:2379"]
    assert settings.cluster.name == "prod"
    assert settings.cluster.etcd_prefix == "/lbd/prod"
    assert settings.etcd.reconnect_retries == 30
    assert settings.broker.auto_ack is True
    assert settings.logging.json_lines is True
    assert settings.grpc.admin_token is not None
    assert settings.grpc.admin_token.get_secret_value() == "s3cret"


def test_env_defaults_to_the_process_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LBD_CLUSTER", "from-env")
    assert load_settings(None).cluster.name == "from-env"


def test_env_errors_name_the_variable() -> None:
    problems = problems_of(
        None,
        env={
            "LBD_ETCD__LEASE_TTL_S": "soon",
            "LBD_ETCD__LEASE_TTL": "3",
            "LBD_SHEDING__TARGET_STD": "1",
        },
    )
    assert problems == [
        "env LBD_ETCD__LEASE_TTL: etcd.lease_ttl: unknown key in section [etcd] "
        "(did you mean 'lease_ttl_s'?)",
        "env LBD_SHEDING__TARGET_STD: sheding.target_std: unknown section "
        "(did you mean 'shedding'?)",
        'env LBD_ETCD__LEASE_TTL_S: etcd.lease_ttl_s: must be an integer (got "soon")',
    ]


def test_alias_and_long_name_must_agree() -> None:
    env = {"LBD_PULSAR_URL": "pulsar://a:1", "LBD_PULSAR__SERVICE_URL": "pulsar://b:1"}
    [problem] = problems_of(None, env=env)
    assert "pulsar.service_url" in problem and "set only one" in problem
    same = {"LBD_PULSAR_URL": "pulsar://a:1", "LBD_PULSAR__SERVICE_URL": "pulsar://a:1"}
    assert load_settings(None, env=same).pulsar.service_url == "pulsar://a:1"


def test_overrides_beat_env_and_none_means_not_given(tmp_path: Path) -> None:
    settings = load_settings(
        write(tmp_path, '[cluster]\nname = "file"\n'),
        env={"LBD_CLUSTER": "env", "LBD_PULSAR_URL": "pulsar://env:1"},
        overrides={"cluster.name": "flag", "pulsar.service_url": None},
    )
    assert settings.cluster.name == "flag"
    assert settings.pulsar.service_url == "pulsar://env:1"


def test_bad_override_is_blamed_on_the_command_line() -> None:
    problems = problems_of(None, overrides={"grpc.addr": "x", "grpc.adress": "y"})
    assert problems == [
        "command line: grpc.adress: unknown key in section [grpc] (did you mean 'addr'?)",
        "command line: grpc.addr: must be HOST:PORT with a port in 0..65535, e.g. "
        '127.0.0.1:7000 (got "x")',
    ]


def test_cluster_flags(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    add_cluster_flags(parser)
    path = write(tmp_path, '[cluster]\nname = "file"\n[etcd]\nreconnect_retries = 21\n')
    args = parser.parse_args(
        [
            "--config",
            str(path),
            "--pulsar-url",
            "pulsar://flag:1",
            "--etcd-endpoints",
            "http://x:1,http://y:2",
            "--cluster",
            "flag",
        ]
    )
    settings = settings_from_args(
        args, overrides={"broker.broker_id": "b-1", "grpc.addr": None}, env={"LBD_CLUSTER": "env"}
    )
    assert settings.cluster.name == "flag"
    assert settings.pulsar.service_url == "pulsar://flag:1"
    assert settings.etcd.endpoints == ["http://x:1", "http://y:2"]
    assert settings.etcd.reconnect_retries == 21
    assert settings.broker.broker_id == "b-1"
    assert settings.grpc.addr == "127.0.0.1:7000"
    unset = settings_from_args(parser.parse_args([]), env={})
    assert unset == Settings()


def test_secrets_are_never_echoed(tmp_path: Path) -> None:
    path = write(tmp_path, "[grpc]\nadmin_token = 12345\n")
    assert problems_of(path) == [f"{path}: grpc.admin_token: must be a string (value hidden)"]


# --- the `lbd config` verbs -------------------------------------------------------------------


def test_cli_defaults_output_validates(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", "defaults"]) == 0
    out = capsys.readouterr().out
    assert "# Deadline of one etcd request." in out
    path = write(tmp_path, out)
    assert main(["config", "validate", str(path)]) == 0
    captured = capsys.readouterr()
    assert captured.out == f"{path}: OK\n"
    assert captured.err == ""


def test_cli_validate_lists_every_problem_and_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write(tmp_path, "[etcd]\nlease_ttl_s = -1\n[grpc]\nadr = 1\n")
    assert main(["config", "validate", str(path)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == (
        "lbd: error: 2 problems in the settings:\n"
        f"  {path}: etcd.lease_ttl_s: must be >= 2 (got -1)\n"
        f"  {path}: grpc.adr: unknown key in section [grpc] (did you mean 'addr'?)\n"
    )


@pytest.mark.parametrize(
    "text", ["[etcd\n", "\xff", "[[etcd]]\nx = 1\n", "[etcd]\nendpoints = [1, {a = 2}]\n"]
)
def test_cli_validate_never_shows_a_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str
) -> None:
    path = write(tmp_path, text)
    assert main(["config", "validate", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("lbd: error: ")
    assert str(path) in err
    assert "Traceback" not in err and "pydantic" not in err


def test_cli_validate_ignores_the_environment(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LBD_ETCD__RECONNECT_RETRIES", "-5")
    path = write(tmp_path, "[etcd]\nreconnect_retries = 20\n")
    assert main(["config", "validate", str(path)]) == 0
    assert capsys.readouterr().out == f"{path}: OK\n"


def test_cli_validate_missing_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", "validate", str(tmp_path / "nope.toml")]) == 2
    assert "nope.toml: cannot read" in capsys.readouterr().err


def test_cli_show_prints_effective_settings_with_secrets_masked(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LBD_GRPC__ADMIN_TOKEN", "s3cret")
    monkeypatch.setenv("LBD_CLUSTER", "env")
    path = write(tmp_path, "[etcd]\nreconnect_retries = 21\n")
    assert main(["config", "show", "--config", str(path), "--cluster", "flag"]) == 0
    out = capsys.readouterr().out
    assert "s3cret" not in out
    assert 'admin_token = "********"' in out
    assert 'name = "flag"' in out
    assert 'etcd_prefix = "/lbd/flag"' in out
    assert "reconnect_retries = 21" in out
    # What show prints, minus the masked secret, is itself a valid settings file.
    shown = write(tmp_path, out.replace('"********"', '""'), "shown.toml")
    assert load_settings(shown, env={}).etcd.reconnect_retries == 21


def test_every_section_model_forbids_unknown_keys() -> None:
    for model in section_models().values():
        assert issubclass(model, Section)
        assert model.model_config.get("extra") == "forbid"
        assert model.model_config.get("frozen") is True


def test_invalid_cluster_name_is_one_problem(tmp_path: Path) -> None:
    path = write(tmp_path, '[cluster]\nname = "a b"\n')
    assert problems_of(path) == [
        f"{path}: cluster.name: must be letters, digits, '.', '_' or '-', starting with a letter "
        'or digit (got "a b")'
    ]


def test_durations_must_be_finite(tmp_path: Path) -> None:
    [problem] = problems_of(write(tmp_path, "[monitor]\ninterval_s = inf\n"))
    assert problem.startswith(f"{tmp_path / 'lbd.toml'}: monitor.interval_s: must be a finite")
