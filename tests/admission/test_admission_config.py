from __future__ import annotations

import argparse

import pytest

from headroom.app.cli import build_config, main
from headroom.config import DEFAULT_TIERS, AdmissionConfig, Config, ConfigError, TenantConfig

TOML = """
[scheduler]
max_num_seqs = 32

[admission]
auth = true
default_tenant = "acme"
global_max_in_flight_seqs = 40
prompt_weight = 1.0
output_weight = 3.0

[admission.tiers]
gold = 5
standard = 1

[[admission.tenants]]
name = "acme"
tier = "gold"
api_keys = ["sk-acme-1", "sk-acme-2"]
rate_tokens_per_s = 500.5
burst_tokens = 8000
max_in_flight_tokens = 12000
max_queue = 8
max_wait_s = 2.5
max_tokens = 1024
max_model_len = 4096

[[admission.tenants]]
name = "hobby"
api_keys = ["sk-hobby"]
"""


def load(tmp_path, text: str, **flags) -> Config:
    path = tmp_path / "headroom.toml"
    path.write_text(text)
    return build_config(argparse.Namespace(config=str(path), **flags))


def test_toml_builds_tenants_and_tiers(tmp_path):
    config = load(tmp_path, TOML)
    adm = config.admission
    assert config.scheduler.max_num_seqs == 32
    assert adm.enabled and adm.auth and adm.default_tenant == "acme" and adm.global_max_in_flight_seqs == 40
    assert adm.tiers == (("gold", 5), ("standard", 1))
    assert adm.priority("gold") == 5 and adm.output_weight == 3.0
    assert adm.tenants == (
        TenantConfig("acme", "gold", ("sk-acme-1", "sk-acme-2"), 500.5, 8000, 12000, 8, 2.5, 1024, 4096),
        TenantConfig("hobby", "standard", ("sk-hobby",)),
    )
    assert adm.tenant("hobby").rate_tokens_per_s == 2000.0
    hash(config)  # still frozen and hashable


def test_defaults_and_the_admission_flag(tmp_path):
    config = load(tmp_path, "")
    assert config.admission == AdmissionConfig()
    assert config.admission.tiers == DEFAULT_TIERS == (("premium", 2), ("standard", 1), ("batch", 0))
    assert [t.name for t in config.admission.tenants] == ["default"]
    assert not load(tmp_path, "[admission]\nenabled = true\n", admission=False).admission.enabled
    assert load(tmp_path, "[admission]\nenabled = false\n", admission=True).admission.enabled
    assert not load(tmp_path, "[admission]\nenabled = false\n").admission.enabled


def test_admission_flag_takes_on_or_off(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["serve", "--admission", "maybe"])
    assert exc.value.code == 2
    assert "expected on or off" in capsys.readouterr().err


@pytest.mark.parametrize(
    "text, message",
    [
        ('[[admission.tenants]]\nname = "default"\ntier = "gold"\n', "tenant 'default': unknown tier 'gold'"),
        ('[[admission.tenants]]\nname = "default"\n[[admission.tenants]]\nname = "default"\n', "defined twice"),
        (
            (
                '[[admission.tenants]]\nname = "default"\napi_keys = ["k"]\n'
                '[[admission.tenants]]\nname = "b"\napi_keys = ["k"]\n'
            ),
            "tenant 'b': an api key is already used by tenant 'default'",
        ),
        ('[[admission.tenants]]\nname = "a"\n', "default_tenant 'default' is not one of the tenants"),
        ('[[admission.tenants]]\nname = "default"\nrate_tokens_per_s = 0\n', "rate_tokens_per_s must be > 0"),
        ('[[admission.tenants]]\nname = "default"\nburst_tokens = -1\n', "burst_tokens must be >= 1"),
        ('[[admission.tenants]]\nname = "default"\nmax_in_flight_tokens = 0\n', "max_in_flight_tokens must be >= 1"),
        ('[[admission.tenants]]\nname = "default"\nmax_queue = -1\n', "max_queue must be >= 0"),
        ('[[admission.tenants]]\nname = "default"\nmax_wait_s = -1.0\n', "max_wait_s must be >= 0"),
        ('[[admission.tenants]]\nname = "default"\napi_keys = "sk"\n', "a list of strings"),
        ('[[admission.tenants]]\nname = ""\n', "non-empty string"),
        ("[admission]\nauth = true\n", "no tenant has api_keys"),
        ("[admission]\nglobal_max_in_flight_seqs = 0\n", "global_max_in_flight_seqs must be >= 1"),
        ("[admission]\noutput_weight = -1.0\n", "output_weight must be >= 0"),
        ("[admission]\ntenants = []\n", "at least one tenant"),
        ("[admission.tiers]\n", "at least one tier"),
        ('[admission.tiers]\nstandard = "high"\n', "integer priority"),
        (
            '[admission]\nstore = "http://127.0.0.1:6379"\n',
            "admission.store must be a redis://, rediss:// or unix:// URL",
        ),
        ("[admission]\nfleet_size = 0\n", "fleet_size must be an integer >= 1"),
        ("[admission]\nlease_ttl_s = 0.5\n", "lease_ttl_s must be >= 1"),
    ],
)
def test_bad_admission_config_is_refused(tmp_path, text, message):
    with pytest.raises(ConfigError, match=message):
        load(tmp_path, text)


def test_the_old_max_wall_s_keys_load_under_their_new_names(tmp_path, caplog):
    config = load(tmp_path, "[admission]\nmax_wall_s = 60\n[admin]\nmax_wall_s = 30\n")
    assert (config.admission.deadline_s, config.admin.max_age_s) == (60, 30)
    assert [r.getMessage() for r in caplog.records if r.name == "headroom.app.flags"] == [
        "config: [admission] max_wall_s is deprecated; it is now deadline_s",
        "config: [admin] max_wall_s is deprecated; it is now max_age_s",
    ]
    with pytest.raises(ConfigError, match=r"\[admin\] sets both max_wall_s and max_age_s"):
        load(tmp_path, "[admin]\nmax_wall_s = 30\nmax_age_s = 30\n")


def test_the_old_inflight_keys_load_under_the_probe_names(tmp_path, caplog):
    text = '[admission]\ninflight = false\ninflight_probe_path = "/p"\ninflight_every = 8\n'
    config = load(tmp_path, text)
    assert (config.admission.probe, config.admission.probe_path, config.admission.probe_every) == (False, "/p", 8)
    assert [r.getMessage() for r in caplog.records if r.name == "headroom.app.flags"] == [
        "config: [admission] inflight is deprecated; it is now probe",
        "config: [admission] inflight_probe_path is deprecated; it is now probe_path",
        "config: [admission] inflight_every is deprecated; it is now probe_every",
    ]
    with pytest.raises(ConfigError, match=r"\[admission\] sets both inflight_every and probe_every"):
        load(tmp_path, "[admission]\ninflight_every = 8\nprobe_every = 8\n")


def test_unknown_tenant_key_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="unexpected keyword argument 'rate'"):
        load(tmp_path, '[[admission.tenants]]\nname = "default"\nrate = 5\n')


def test_error_messages_never_echo_api_keys(tmp_path):
    text = (
        '[[admission.tenants]]\nname = "default"\napi_keys = ["sk-secret"]\n'
        '[[admission.tenants]]\nname = "b"\napi_keys = ["sk-secret"]\n'
    )
    with pytest.raises(ConfigError) as exc:
        load(tmp_path, text)
    assert "sk-secret" not in str(exc.value)


def test_a_bad_store_url_is_refused_without_echoing_its_password(tmp_path):
    with pytest.raises(ConfigError) as exc:
        load(tmp_path, '[admission]\nstore = "redis:/:hunter2@cache:6379"\n')
    assert "hunter2" not in str(exc.value) and "starting 'redis'" in str(exc.value)


def test_gateway_objectives_and_request_metrics_from_toml(tmp_path):
    config = load(
        tmp_path,
        '[server]\nrequest_metrics = true\nunknown_fields = "accept"\n'
        '[admission.objectives]\ninteractive = "premium"\n'
        '"batch-sheddable" = "batch"\n'
        '[[admission.tenants]]\nname = "default"\nrequest_metrics = false\n',
    )
    assert config.admission.objectives == (("interactive", "premium"), ("batch-sheddable", "batch"))
    assert config.admission.objective_tier("batch-sheddable") == "batch"
    assert config.admission.objective_tier("other") is None
    assert (config.server.request_metrics, config.server.unknown_fields) == (True, "accept")
    assert config.admission.tenant("default").request_metrics is False
    hash(config)
    with pytest.raises(
        ConfigError,
        match=r"admission.objectives: \('chat', 'gold'\) must map "
        r"an objective's name to a tier \(premium, standard, "
        r"batch\)",
    ):
        load(tmp_path, '[admission.objectives]\nchat = "gold"\n')
    with pytest.raises(ConfigError, match="unknown_fields must be one of reject, accept, got 'ignore'"):
        load(tmp_path, '[server]\nunknown_fields = "ignore"\n')
