"""[etcd] TLS and password settings: validation at load, and the adapter options they make."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from lbd.adapters.etcd import EtcdConnection, EtcdOptions, EtcdSecurity, uses_tls
from lbd.adapters.session import SessionPolicy
from lbd.cli.main import main
from lbd.config import SettingsError, load_settings
from lbd.config.schema import EtcdSettings
from lbd.core.errors import InvalidInputError
from lbd.devcluster.pki import DevPki

HTTPS = "https://etcd.example:2379"
PASSWORD = "etcd-root-secret"


@pytest.fixture
def files(tmp_path: Path) -> dict[str, str]:
    """Readable stand-ins for the CA bundle, client certificate and key."""
    out = {}
    for name in ("ca", "cert", "key"):
        path = tmp_path / f"{name}.pem"
        path.write_text(name.upper())
        out[name] = str(path)
    return out


def problems(env: dict[str, str]) -> list[str]:
    with pytest.raises(SettingsError) as info:
        load_settings(None, env=env)
    return list(info.value.problems)


def full_env(files: dict[str, str]) -> dict[str, str]:
    return {
        "LBD_ETCD_ENDPOINTS": f"{HTTPS},https://etcd-2.example:2379",
        "LBD_ETCD__CA_FILE": files["ca"],
        "LBD_ETCD__CERT_FILE": files["cert"],
        "LBD_ETCD__KEY_FILE": files["key"],
        "LBD_ETCD__USERNAME": "lbd",
        "LBD_ETCD__PASSWORD": PASSWORD,
    }


# --- validation ---------------------------------------------------------------------------------


def test_defaults_are_plaintext_without_authentication() -> None:
    etcd = load_settings(None, env={}).etcd
    assert etcd.endpoints == ["http://127.0.0.1:2379"]
    assert etcd.ca_file is etcd.cert_file is etcd.key_file is None
    assert etcd.username is etcd.password is None


def test_tls_with_a_client_certificate_and_a_password_loads(files: dict[str, str]) -> None:
    etcd = load_settings(None, env=full_env(files)).etcd
    assert (etcd.ca_file, etcd.cert_file, etcd.key_file) == (
        files["ca"],
        files["cert"],
        files["key"],
    )
    assert etcd.username == "lbd"
    assert etcd.password is not None and etcd.password.get_secret_value() == PASSWORD
    assert PASSWORD not in repr(etcd)


def test_https_without_a_ca_file_loads_and_means_the_system_roots() -> None:
    etcd = load_settings(None, env={"LBD_ETCD_ENDPOINTS": HTTPS}).etcd
    assert etcd.endpoints == [HTTPS] and etcd.ca_file is None
    assert "the system trust roots" in (EtcdSettings.model_fields["ca_file"].description or "")


def test_empty_values_mean_unset(files: dict[str, str]) -> None:
    env = {key: "" for key in full_env(files) if key != "LBD_ETCD_ENDPOINTS"}
    etcd = load_settings(None, env=env).etcd
    assert etcd.ca_file is etcd.cert_file is etcd.key_file is etcd.username is None
    assert etcd.password is None


def test_missing_and_unreadable_files_are_named(tmp_path: Path, files: dict[str, str]) -> None:
    locked = tmp_path / "locked.pem"
    locked.write_text("x")
    locked.chmod(0)
    env = {
        **full_env(files),
        "LBD_ETCD__CERT_FILE": "/x/y.pem",
        "LBD_ETCD__CA_FILE": str(locked),
    }
    found = problems(env)
    assert any("etcd.cert_file: /x/y.pem: no such file" in p for p in found)
    if os.geteuid() != 0:  # root reads any file
        assert any("etcd.ca_file:" in p and "not readable by this user" in p for p in found)


@pytest.mark.parametrize("key", ["ca_file", "cert_file"])
def test_tls_files_need_https_endpoints(files: dict[str, str], key: str) -> None:
    env = {f"LBD_ETCD__{key.upper()}": files["ca"]}
    if key == "cert_file":
        env["LBD_ETCD__KEY_FILE"] = files["key"]
    [problem] = problems(env)
    assert f"etcd.{key}: needs https:// endpoints, not 'http://127.0.0.1:2379'" in problem
    assert "TLS settings have no effect on a plaintext connection" in problem


def test_endpoints_must_not_mix_http_and_https() -> None:
    [problem] = problems({"LBD_ETCD_ENDPOINTS": f"http://a:2379,{HTTPS}"})
    assert "etcd.endpoints: must not mix http:// and https://" in problem


def test_certificate_and_key_go_together(files: dict[str, str]) -> None:
    env = {"LBD_ETCD_ENDPOINTS": HTTPS}
    [cert_only] = problems({**env, "LBD_ETCD__CERT_FILE": files["cert"]})
    assert "etcd.key_file: must be set too: cert_file is set" in cert_only
    [key_only] = problems({**env, "LBD_ETCD__KEY_FILE": files["key"]})
    assert "etcd.key_file: needs cert_file" in key_only


def test_username_and_password_go_together_without_showing_the_password() -> None:
    [user_only] = problems({"LBD_ETCD__USERNAME": "lbd"})
    assert "etcd.password: must be set too: username is set" in user_only
    [password_only] = problems({"LBD_ETCD__PASSWORD": PASSWORD})
    assert "etcd.password: needs username" in password_only
    assert "(value hidden)" in password_only
    assert PASSWORD not in password_only


def test_every_problem_is_reported_at_once(files: dict[str, str]) -> None:
    env = {
        "LBD_ETCD__CA_FILE": files["ca"],
        "LBD_ETCD__KEY_FILE": files["key"],
        "LBD_ETCD__PASSWORD": PASSWORD,
    }
    keys = {p.split(": ")[1] for p in problems(env)}
    assert keys == {"etcd.ca_file", "etcd.key_file", "etcd.password"}


def test_settings_built_in_code_are_checked_too(files: dict[str, str]) -> None:
    with pytest.raises(ValueError, match="needs https:// endpoints"):
        EtcdSettings(ca_file=files["ca"])
    with pytest.raises(ValueError, match="needs username"):
        EtcdSettings(password=PASSWORD)  # type: ignore[arg-type]


def test_config_validate_and_defaults_cover_the_keys(
    tmp_path: Path, files: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "lbd.toml"
    config.write_text(f'[etcd]\ncert_file = "{files["cert"]}"\nkey_file = "{files["key"]}"\n')
    assert main(["config", "validate", str(config)]) != 0
    assert "etcd.cert_file: needs https:// endpoints" in capsys.readouterr().err
    assert main(["config", "defaults"]) == 0
    defaults = capsys.readouterr().out
    etcd_section = defaults.split("\n[etcd]\n")[1].split("\n[")[0]
    for key in ("ca_file", "cert_file", "key_file", "username", "password"):
        assert f"\n{key} = " in etcd_section
    assert "LBD_ETCD__PASSWORD" in etcd_section


# --- the adapter's options ----------------------------------------------------------------------


def test_settings_become_the_adapter_security(files: dict[str, str]) -> None:
    options = EtcdOptions.from_settings(load_settings(None, env=full_env(files)))
    assert options.endpoints == (HTTPS, "https://etcd-2.example:2379")
    assert options.security == EtcdSecurity(
        ca_file=files["ca"],
        cert_file=files["cert"],
        key_file=files["key"],
        username="lbd",
        password=PASSWORD,
    )
    assert PASSWORD not in repr(options)


def test_default_settings_have_no_security() -> None:
    options = EtcdOptions.from_settings(load_settings(None, env={}))
    assert options.security == EtcdSecurity()


@pytest.mark.parametrize(
    ("endpoints", "security", "message"),
    [
        (("http://a:2379", HTTPS), EtcdSecurity(), "must not mix http:// and https://"),
        (("http://a:2379",), EtcdSecurity(ca_file="/ca.pem"), "need https:// endpoints"),
        (("ftp://a:2379",), EtcdSecurity(), "must start with http:// or https://"),
        ((), EtcdSecurity(), "at least one URL"),
    ],
)
def test_options_built_in_code_refuse_unusable_endpoints(
    endpoints: tuple[str, ...], security: EtcdSecurity, message: str
) -> None:
    with pytest.raises(InvalidInputError, match=message):
        EtcdOptions(
            endpoints=endpoints,
            prefix="/lbd/x",
            session=SessionPolicy(lease_ttl_s=10, keepalive_interval_s=2),
            security=security,
        )
    with pytest.raises(InvalidInputError, match=message):
        uses_tls(endpoints, security)


def test_security_refuses_half_pairs() -> None:
    with pytest.raises(InvalidInputError, match="cert_file and key_file go together"):
        EtcdSecurity(cert_file="/c.pem")
    with pytest.raises(InvalidInputError, match="username and password go together"):
        EtcdSecurity(username="lbd")


def test_credentials_are_read_from_the_files_as_they_are_now(tmp_path: Path) -> None:
    pki = DevPki(tmp_path)
    cert = pki.issue("client", "lbd")
    security = EtcdSecurity(
        ca_file=str(pki.ca_file), cert_file=str(cert.cert), key_file=str(cert.key)
    )
    assert security.channel_credentials() is not None
    cert.key.unlink()
    with pytest.raises(OSError):
        security.channel_credentials()


async def test_https_endpoints_make_a_tls_connection_and_plain_ones_do_not() -> None:
    assert uses_tls([HTTPS], EtcdSecurity()) is True
    assert uses_tls(["http://a:2379"], EtcdSecurity(username="u", password="p")) is False
    conn = EtcdConnection([HTTPS], 1.0)  # connects on first use only
    assert (conn.url, conn.endpoint) == (HTTPS, "etcd.example:2379")
    await conn.close()
