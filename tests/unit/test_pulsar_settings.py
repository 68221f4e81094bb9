"""[pulsar] TLS and token settings: validation at load, and the Pulsar client options they make."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pulsar
import pytest
from pydantic import SecretStr

from lbd.adapters.pulsar_client import (
    PulsarConnection,
    PulsarSecurity,
    TokenFile,
    client_kwargs,
)
from lbd.cli.main import main
from lbd.config import SettingsError, load_settings
from lbd.config.schema import PulsarSettings
from lbd.core.errors import InvalidInputError

TLS_URL = "pulsar+ssl://pulsar.example:6651"
SYSTEM_CA = "/system/ca-bundle.crt"
TOKEN = "eyJhbGciOiJIUzI1NiJ9.c2lkZWNhcg.secret-signature"


@pytest.fixture
def files(tmp_path: Path) -> dict[str, str]:
    """Readable stand-ins for the CA bundle, client certificate, key and token file."""
    out = {}
    for name, text in [("ca", "CA"), ("cert", "CERT"), ("key", "KEY"), ("token", TOKEN + "\n")]:
        path = tmp_path / name
        path.write_text(text)
        out[name] = str(path)
    return out


def problems(env: dict[str, str]) -> list[str]:
    with pytest.raises(SettingsError) as info:
        load_settings(None, env=env)
    return list(info.value.problems)


# --- validation ---------------------------------------------------------------------------------


def test_defaults_are_plaintext_without_authentication() -> None:
    pulsar_settings = load_settings(None, env={}).pulsar
    assert pulsar_settings.tls_trust_certs_file is None
    assert pulsar_settings.tls_cert_file is pulsar_settings.tls_key_file is None
    assert pulsar_settings.tls_validate_hostname is True
    assert pulsar_settings.tls_allow_insecure_connection is False
    assert pulsar_settings.auth_token is None
    assert pulsar_settings.auth_token_file is None


def test_full_tls_with_certificate_authentication_loads(files: dict[str, str]) -> None:
    settings = load_settings(
        None,
        env={
            "LBD_PULSAR_URL": TLS_URL,
            "LBD_PULSAR__TLS_TRUST_CERTS_FILE": files["ca"],
            "LBD_PULSAR__TLS_CERT_FILE": files["cert"],
            "LBD_PULSAR__TLS_KEY_FILE": files["key"],
            "LBD_PULSAR__TLS_VALIDATE_HOSTNAME": "false",
        },
    ).pulsar
    assert (settings.tls_cert_file, settings.tls_key_file) == (files["cert"], files["key"])
    assert settings.tls_validate_hostname is False


def test_token_from_the_environment_is_allowed_on_plain_pulsar() -> None:
    settings = load_settings(None, env={"LBD_PULSAR__AUTH_TOKEN": TOKEN}).pulsar
    assert settings.auth_token is not None
    assert settings.auth_token.get_secret_value() == TOKEN
    assert TOKEN not in repr(settings)


def test_missing_and_unreadable_files_are_named(tmp_path: Path, files: dict[str, str]) -> None:
    locked = tmp_path / "locked"
    locked.write_text("x")
    locked.chmod(0)
    env = {
        "LBD_PULSAR_URL": TLS_URL,
        "LBD_PULSAR__TLS_TRUST_CERTS_FILE": str(tmp_path / "nope.pem"),
        "LBD_PULSAR__AUTH_TOKEN_FILE": str(locked),
    }
    found = problems(env)
    assert any("pulsar.tls_trust_certs_file:" in p and "nope.pem: no such file" in p for p in found)
    if os.geteuid() != 0:  # root reads any file
        assert any("pulsar.auth_token_file:" in p and "not readable" in p for p in found)


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("tls_trust_certs_file", "ca"),
        ("tls_cert_file", "cert"),
        ("tls_validate_hostname", "false"),
        ("tls_allow_insecure_connection", "true"),
    ],
)
def test_tls_settings_need_a_tls_service_url(files: dict[str, str], key: str, value: str) -> None:
    env = {f"LBD_PULSAR__{key.upper()}": files.get(value, value)}
    if key == "tls_cert_file":
        env["LBD_PULSAR__TLS_KEY_FILE"] = files["key"]
    [problem] = problems(env)
    assert f"pulsar.{key}: needs a pulsar+ssl:// or https:// service_url" in problem
    assert "'pulsar://127.0.0.1:6650'" in problem


def test_https_service_url_counts_as_tls(files: dict[str, str]) -> None:
    env = {
        "LBD_PULSAR_URL": "https://pulsar.example:8443",
        "LBD_PULSAR__TLS_TRUST_CERTS_FILE": files["ca"],
    }
    assert load_settings(None, env=env).pulsar.tls_trust_certs_file == files["ca"]


def test_certificate_and_key_go_together(files: dict[str, str]) -> None:
    [cert_only] = problems({"LBD_PULSAR_URL": TLS_URL, "LBD_PULSAR__TLS_CERT_FILE": files["cert"]})
    assert "pulsar.tls_key_file: must be set too: tls_cert_file is set" in cert_only
    [key_only] = problems({"LBD_PULSAR_URL": TLS_URL, "LBD_PULSAR__TLS_KEY_FILE": files["key"]})
    assert "pulsar.tls_key_file: needs tls_cert_file" in key_only


def test_token_and_token_file_exclude_each_other_without_showing_the_token(
    files: dict[str, str],
) -> None:
    env = {"LBD_PULSAR__AUTH_TOKEN": TOKEN, "LBD_PULSAR__AUTH_TOKEN_FILE": files["token"]}
    [problem] = problems(env)
    assert "pulsar.auth_token: auth_token and auth_token_file exclude each other" in problem
    assert "(value hidden)" in problem
    assert TOKEN not in problem


@pytest.mark.parametrize("token_key", ["auth_token", "auth_token_file"])
def test_token_and_certificate_authentication_exclude_each_other(
    files: dict[str, str], token_key: str
) -> None:
    env = {
        "LBD_PULSAR_URL": TLS_URL,
        "LBD_PULSAR__TLS_CERT_FILE": files["cert"],
        "LBD_PULSAR__TLS_KEY_FILE": files["key"],
        f"LBD_PULSAR__{token_key.upper()}": TOKEN if token_key == "auth_token" else files["token"],
    }
    [problem] = problems(env)
    assert f"pulsar.{token_key}: {token_key} and tls_cert_file exclude each other" in problem
    assert "Pulsar takes one authentication" in problem
    assert TOKEN not in problem


def test_every_problem_is_reported_at_once(files: dict[str, str]) -> None:
    env = {
        "LBD_PULSAR__TLS_ALLOW_INSECURE_CONNECTION": "true",
        "LBD_PULSAR__TLS_KEY_FILE": files["key"],
        "LBD_PULSAR__AUTH_TOKEN": TOKEN,
        "LBD_PULSAR__AUTH_TOKEN_FILE": files["token"],
    }
    keys = {p.split(": ")[1] for p in problems(env)}
    assert keys == {
        "pulsar.tls_allow_insecure_connection",
        "pulsar.tls_key_file",
        "pulsar.auth_token",
    }


def test_settings_built_in_code_are_checked_too(files: dict[str, str]) -> None:
    with pytest.raises(ValueError, match="tls_cert_file exclude each other"):
        PulsarSettings(
            service_url=TLS_URL,
            tls_cert_file=files["cert"],
            tls_key_file=files["key"],
            auth_token_file=files["token"],
        )


def test_config_validate_and_defaults_cover_the_keys(
    tmp_path: Path, files: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "lbd.toml"
    config.write_text(f'[pulsar]\ntls_trust_certs_file = "{files["ca"]}"\n')
    assert main(["config", "validate", str(config)]) != 0
    assert "pulsar.tls_trust_certs_file: needs a pulsar+ssl://" in capsys.readouterr().err
    assert main(["config", "defaults"]) == 0
    defaults = capsys.readouterr().out
    for key in (
        "tls_trust_certs_file",
        "tls_cert_file",
        "tls_key_file",
        "tls_validate_hostname",
        "tls_allow_insecure_connection",
        "auth_token_file",
        "auth_token",
    ):
        assert f"\n{key} = " in defaults


# --- client options -------------------------------------------------------------------------------


def test_plain_url_without_security_adds_no_client_option() -> None:
    assert client_kwargs("pulsar://127.0.0.1:6650", PulsarSecurity(), system_trust=SYSTEM_CA) == {}


def test_tls_url_trusts_the_system_bundle_and_checks_host_names() -> None:
    assert client_kwargs(TLS_URL, PulsarSecurity(), system_trust=SYSTEM_CA) == {
        "tls_trust_certs_file_path": SYSTEM_CA,
        "tls_validate_hostname": True,
        "tls_allow_insecure_connection": False,
    }


def test_tls_url_without_a_system_bundle_leaves_the_client_default() -> None:
    assert "tls_trust_certs_file_path" not in client_kwargs(
        TLS_URL, PulsarSecurity(), system_trust=None
    )


def test_settings_become_the_client_options(files: dict[str, str]) -> None:
    settings = PulsarSettings(
        service_url=TLS_URL,
        tls_trust_certs_file=files["ca"],
        tls_cert_file=files["cert"],
        tls_key_file=files["key"],
        tls_validate_hostname=False,
        tls_allow_insecure_connection=True,
    )
    kwargs = client_kwargs(TLS_URL, PulsarSecurity.from_settings(settings), system_trust=SYSTEM_CA)
    authentication = kwargs.pop("authentication")
    assert kwargs == {
        "tls_trust_certs_file_path": files["ca"],
        "tls_validate_hostname": False,
        "tls_allow_insecure_connection": True,
    }
    assert isinstance(authentication, pulsar.AuthenticationTLS)


@pytest.mark.parametrize("source", ["auth_token", "auth_token_file"])
def test_token_settings_become_token_authentication(files: dict[str, str], source: str) -> None:
    value = TOKEN if source == "auth_token" else files["token"]
    security = PulsarSecurity.from_settings(PulsarSettings.model_validate({source: value}))
    kwargs = client_kwargs("pulsar://127.0.0.1:6650", security, system_trust=SYSTEM_CA)
    assert list(kwargs) == ["authentication"]
    assert isinstance(kwargs["authentication"], pulsar.AuthenticationToken)
    assert TOKEN not in repr(security)


def test_security_refuses_two_authentications_and_tls_options_on_plain_urls() -> None:
    with pytest.raises(InvalidInputError, match="one authentication"):
        PulsarSecurity(auth_token=TOKEN, auth_token_file="/t")
    with pytest.raises(InvalidInputError, match="certificate and key go together"):
        PulsarSecurity(tls_cert_file="/c")
    with pytest.raises(InvalidInputError, match="need a pulsar\\+ssl:// or https://"):
        client_kwargs(
            "pulsar://h:6650", PulsarSecurity(tls_trust_certs_file="/ca"), system_trust=None
        )


def test_describe_names_the_choices_but_never_the_token() -> None:
    line = PulsarSecurity(auth_token=TOKEN, tls_validate_hostname=False).describe(TLS_URL)
    assert line == (
        "TLS trusting the system CA bundle, broker host name not checked; token from the settings"
    )


async def test_connection_logs_its_security_without_the_token(
    caplog: pytest.LogCaptureFixture,
) -> None:
    settings = PulsarSettings(auth_token=SecretStr(TOKEN))
    with caplog.at_level(logging.DEBUG):
        connection = PulsarConnection.from_settings(settings)
        await connection.close()
    assert "plaintext; token from the settings" in caplog.text
    assert TOKEN not in caplog.text


# --- the token file -----------------------------------------------------------------------------


def test_token_file_is_read_again_on_each_call(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text(" first \n")
    supplier = TokenFile(str(path))
    assert supplier() == "first"
    path.write_text("second\n")
    assert supplier() == "second"


def test_token_file_keeps_the_last_token_when_the_file_goes_bad(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "token"
    path.write_text("first")
    supplier = TokenFile(str(path))
    path.write_text("")
    assert supplier() == "first"
    path.unlink()
    assert supplier() == "first"
    assert "presenting the token read before" in caplog.text
    assert "first" not in caplog.text


def test_token_file_must_be_readable_and_non_empty_at_start(tmp_path: Path) -> None:
    with pytest.raises(InvalidInputError, match="cannot read"):
        TokenFile(str(tmp_path / "missing"))
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(InvalidInputError, match="empty"):
        TokenFile(str(tmp_path / "empty"))
