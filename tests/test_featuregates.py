"""Feature gates as upstream 1.37's kube-proxy takes them, from the table to the binaries.

The table (stages, defaults, locks), upstream's refusals and warnings word for word,
AllAlpha/AllBeta, the help list, the ``kubernetes_feature_enabled`` metric; then what the
gates do: ``KubeProxyIPVS=false`` stops ipvs mode before anything happens, the logging
gates refuse the options they guard, ``/configz`` and ``--write-config-to`` show the gates,
and a backend gets the effective gates.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from kubeproxy.cmd import ipvs as ipvs_binary
from kubeproxy.cmd import multimode
from kubeproxy.cmd import nftables as nftables_binary
from kubeproxy.cmd.binary import run
from kubeproxy.cmd.commandline import OptionsError, parse_options
from kubeproxy.cmd.flags import usage
from kubeproxy.configfile.codec import parse_config
from kubeproxy.configfile.model import ConfigError, defaults
from kubeproxy.configfile.settings import to_proxier_config, validate
from kubeproxy.featuregates import (
    ALL_ALPHA,
    ALL_BETA,
    FEATURES,
    KUBE_PROXY_GATES,
    FeatureEnabledCollector,
    FeatureGateError,
    Stage,
    known_features,
    resolve,
)
from kubeproxy.featurelist import GATES_137, OWN_GATES
from kubeproxy.metrics import expose

HEADER = "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n"


# --- the table ----------------------------------------------------------------------------


def test_the_table_names_each_gate_once() -> None:
    names = [line.split()[0] for line in (GATES_137 + OWN_GATES).splitlines() if line.strip()]
    assert len(names) == len(set(names))
    assert len(FEATURES) == len(names) + 2  # AllAlpha and AllBeta


@pytest.mark.parametrize(
    ("name", "stage", "default", "locked"),
    [
        # The gates kube-proxy itself reads, as upstream 1.37 defines them.
        ("KubeProxyIPVS", Stage.DEPRECATED, True, False),
        ("KubeProxyNFTablesLocalhostNodePorts", Stage.ALPHA, False, False),
        ("NFTablesOwnedTable", Stage.BETA, True, False),
        ("NFTablesNetlink", Stage.BETA, True, False),
        ("PreferSameTrafficDistribution", Stage.GA, True, True),
        ("MultiCIDRServiceAllocator", Stage.GA, True, True),
        ("NFTablesProxyMode", Stage.GA, True, True),
        ("TopologyAwareHints", Stage.GA, True, True),
        ("ServiceTrafficDistribution", Stage.GA, True, True),
        ("LoggingAlphaOptions", Stage.ALPHA, False, False),
        ("LoggingBetaOptions", Stage.BETA, True, False),
        ("ContextualLogging", Stage.BETA, True, False),
        ("ComponentFlagz", Stage.BETA, True, False),
        ("ComponentStatusz", Stage.BETA, True, False),
        # Others the binary accepts: a kubelet gate, an unlocked GA one, a client-go one.
        ("SELinuxMount", Stage.GA, True, False),
        ("WatchListClient", Stage.BETA, True, False),
        ("DisableNodeKubeProxyVersion", Stage.DEPRECATED, True, False),
        (ALL_ALPHA, Stage.ALPHA, False, False),
        (ALL_BETA, Stage.BETA, False, False),
    ],
)
def test_stages_defaults_and_locks(name: str, stage: Stage, default: bool, locked: bool) -> None:
    spec = FEATURES[name]
    assert (spec.stage, spec.default, spec.locked) == (stage, default, locked)


def test_every_gate_kube_proxy_uses_is_known() -> None:
    assert set(KUBE_PROXY_GATES) <= set(FEATURES)


# --- upstream's SetFromMap ----------------------------------------------------------------


def test_an_unknown_gate_is_refused_with_upstreams_message() -> None:
    with pytest.raises(FeatureGateError) as caught:
        resolve({"KubeProxyIPVS": True, "NoSuchGate": True})
    assert str(caught.value) == "unrecognized feature gate: NoSuchGate"


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        (
            "PreferSameTrafficDistribution",
            False,
            "cannot set feature gate PreferSameTrafficDistribution to false, "
            "feature is locked to true",
        ),
        (
            "AggregatedDiscoveryRemoveBetaType",
            False,
            "cannot set feature gate AggregatedDiscoveryRemoveBetaType to false, "
            "feature is locked to true",
        ),
    ],
)
def test_a_locked_gate_set_against_its_lock_is_refused(
    name: str, value: bool, message: str
) -> None:
    with pytest.raises(FeatureGateError) as caught:
        resolve({name: value})
    assert str(caught.value) == message


def test_a_locked_gate_set_to_its_lock_is_accepted_with_upstreams_warning() -> None:
    gates = resolve({"MultiCIDRServiceAllocator": True, "KubeProxyIPVS": True})
    assert gates.enabled("MultiCIDRServiceAllocator")
    assert gates.warnings == (
        "Setting GA feature gate MultiCIDRServiceAllocator=true. "
        "It will be removed in a future release.",
        "Setting deprecated feature gate KubeProxyIPVS=true. "
        "It will be removed in a future release.",
    )


def test_alpha_and_beta_gates_are_set_without_a_warning() -> None:
    gates = resolve({"KubeProxyNFTablesLocalhostNodePorts": True, "NFTablesNetlink": False})
    assert gates.enabled("KubeProxyNFTablesLocalhostNodePorts")
    assert not gates.enabled("NFTablesNetlink")
    assert gates.warnings == ()
    assert gates.given == (
        ("KubeProxyNFTablesLocalhostNodePorts", True),
        ("NFTablesNetlink", False),
    )


def test_all_alpha_and_all_beta_set_what_is_not_named() -> None:
    gates = resolve({"LoggingAlphaOptions": False, ALL_ALPHA: True, ALL_BETA: False})
    alpha = [n for n, s in FEATURES.items() if s.stage is Stage.ALPHA and n != ALL_ALPHA]
    beta = [n for n, s in FEATURES.items() if s.stage is Stage.BETA and n != ALL_BETA]
    assert not gates.enabled("LoggingAlphaOptions"), "named explicitly: kept"
    assert all(gates.enabled(n) for n in alpha if n != "LoggingAlphaOptions")
    assert not any(gates.enabled(n) for n in beta)
    assert gates.enabled("PreferSameTrafficDistribution"), "GA gates are untouched"


@given(
    st.dictionaries(
        st.sampled_from(sorted(n for n, s in FEATURES.items() if not s.locked)), st.booleans()
    )
)
def test_every_unlocked_gate_takes_what_it_is_given(given_gates: dict[str, bool]) -> None:
    gates = resolve(given_gates)
    for name, value in given_gates.items():
        if name not in (ALL_ALPHA, ALL_BETA):
            assert gates.enabled(name) is value
    untouched = set(FEATURES) - set(given_gates)
    if not {ALL_ALPHA, ALL_BETA} & set(given_gates):
        assert all(gates.enabled(n) is FEATURES[n].default for n in untouched)


def test_an_unregistered_name_is_a_programming_error() -> None:
    with pytest.raises(KeyError, match="not registered"):
        resolve({}).enabled("NoSuchGate")


def test_help_lists_alpha_and_beta_gates_as_upstream() -> None:
    listed = known_features()
    assert listed == sorted(listed)
    assert "KubeProxyNFTablesLocalhostNodePorts=true|false (ALPHA - default=false)" in listed
    assert "NFTablesNetlink=true|false (BETA - default=true)" in listed
    assert "AllAlpha=true|false (ALPHA - default=false)" in listed
    assert not any(line.startswith("KubeProxyIPVS=") for line in listed), "deprecated: hidden"
    assert not any(line.startswith("NFTablesProxyMode=") for line in listed), "GA: hidden"
    text = usage("kube-proxy-nftables", "nftables")
    assert "\n" + " " * 24 + "KubeProxyNFTablesLocalhostNodePorts=true|false (ALPHA" in text


def test_the_feature_enabled_metric() -> None:
    registry = CollectorRegistry()
    registry.register(FeatureEnabledCollector(resolve({"NFTablesNetlink": False})))
    text = expose(registry).decode()
    assert 'kubernetes_feature_enabled{name="NFTablesNetlink",stage="BETA"} 0' in text
    assert 'kubernetes_feature_enabled{name="KubeProxyIPVS",stage="DEPRECATED"} 1' in text
    assert 'kubernetes_feature_enabled{name="NFTablesProxyMode",stage=""} 1' in text
    assert 'kubernetes_feature_enabled{name="AllAlpha",stage="ALPHA"} 0' in text
    assert text.count("kubernetes_feature_enabled{") == len(FEATURES)


# --- the configuration --------------------------------------------------------------------


def test_validation_refuses_unknown_and_locked_gates_in_the_file() -> None:
    cfg = parse_config(HEADER + "mode: nftables\nfeatureGates: {NoSuchGate: true}\n")
    with pytest.raises(ConfigError, match=r"^featureGates: unrecognized feature gate: NoSuchGate$"):
        validate(cfg)
    cfg = parse_config(HEADER + "featureGates: {NFTablesProxyMode: false}\n")
    with pytest.raises(ConfigError, match=r"feature is locked to true$"):
        validate(cfg)


def test_a_proxier_gets_the_effective_gates() -> None:
    cfg = parse_config(HEADER + "mode: nftables\nfeatureGates: {NFTablesNetlink: false}\n")
    config = to_proxier_config(cfg, "n")
    assert not config.feature_gates.enabled("NFTablesNetlink")
    assert config.feature_gates.enabled("KubeProxyIPVS")
    assert to_proxier_config(defaults(), "n").feature_gates.enabled("NFTablesNetlink")


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ("logging: {options: {text: {splitStream: true}}}", "logging.options.text.splitStream"),
        (
            "logging: {options: {json: {infoBufferSize: 1Ki}}}",
            "logging.options.json.infoBufferSize",
        ),
    ],
)
def test_logging_alpha_options_need_their_gate(text: str, field: str) -> None:
    with pytest.raises(
        ConfigError, match=rf"^{field}\w*: Feature LoggingAlphaOptions is disabled$"
    ):
        validate(parse_config(HEADER + text + "\n"))
    validate(parse_config(HEADER + text + "\nfeatureGates: {LoggingAlphaOptions: true}\n"))
    # A zero buffer is no option set.
    validate(parse_config(HEADER + "logging: {options: {json: {infoBufferSize: 0Ki}}}\n"))


def test_the_json_format_needs_logging_beta_options() -> None:
    validate(parse_config(HEADER + "logging: {format: json}\n"))
    cfg = parse_config(
        HEADER + "logging: {format: json}\nfeatureGates: {LoggingBetaOptions: false}\n"
    )
    with pytest.raises(
        ConfigError, match=r"^logging.format: Log format json is disabled, see LoggingBetaOptions"
    ):
        validate(cfg)


# --- the binaries -------------------------------------------------------------------------


def test_an_unknown_gate_on_the_command_line_is_one_line_and_exit_2(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert run(nftables_binary.BINARY, ["--feature-gates", "NoSuchGate=true", "--once"]) == 2
    err = capsys.readouterr().err
    assert err == (
        "kube-proxy-nftables: --feature-gates: featureGates: "
        "unrecognized feature gate: NoSuchGate\n"
    )


def test_ipvs_mode_refuses_to_start_with_kube_proxy_ipvs_off(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    touched: list[str] = []

    def recorder(what: str, result: object = None) -> Any:
        def record(*args: object, **kwargs: object) -> object:
            touched.append(what)
            return result

        return record

    # Anything the start would do on the node goes through these: none may run.
    monkeypatch.setattr("kubeproxy.cmd.binary.missing_capabilities", recorder("caps", []))
    monkeypatch.setattr("kubeproxy.cmd.binary.run_daemon", recorder("run", 0))
    monkeypatch.setattr("kubeproxy.cmd.binary.cleanup_all", recorder("cleanup", 0))
    for binary, argv in (
        (ipvs_binary.BINARY, ["--feature-gates=KubeProxyIPVS=false"]),
        (multimode.BINARY, ["--proxy-mode=ipvs", "--feature-gates=KubeProxyIPVS=false"]),
        (ipvs_binary.BINARY, ["--feature-gates=KubeProxyIPVS=false", "--cleanup"]),
    ):
        assert run(binary, argv) == 2
        lines = capsys.readouterr().err.splitlines()
        assert len(lines) == 1
        assert "KubeProxyIPVS=false" in lines[0] and "ipvs" in lines[0]
    assert touched == []


def test_ipvs_mode_refuses_a_config_file_with_kube_proxy_ipvs_off(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(HEADER + "mode: ipvs\nfeatureGates: {KubeProxyIPVS: false}\n")
    with pytest.raises(OptionsError, match=r"^--config .*featureGates.KubeProxyIPVS: the ipvs"):
        parse_options(["--config", str(path)], "kube-proxy")
    # The other modes do not care.
    path.write_text(HEADER + "mode: nftables\nfeatureGates: {KubeProxyIPVS: false}\n")
    assert parse_options(["--config", str(path)], "kube-proxy").mode == "nftables"


def test_ga_and_deprecated_gates_warn_as_upstream(caplog: pytest.LogCaptureFixture) -> None:
    options = parse_options(
        ["--feature-gates=NFTablesProxyMode=true,KubeProxyIPVS=true"],
        "kube-proxy-nftables",
        "nftables",
        get_hostname=lambda: "n",
    )
    assert (
        "Setting GA feature gate NFTablesProxyMode=true. It will be removed in a future release."
        in options.warnings
    )
    assert any("deprecated feature gate KubeProxyIPVS=true" in w for w in options.warnings)


def test_write_config_to_shows_the_gates(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    target = tmp_path / "out.yaml"
    argv = [
        "--feature-gates=KubeProxyNFTablesLocalhostNodePorts=true",
        "--feature-gates=NFTablesNetlink=false",
        f"--write-config-to={target}",
    ]
    assert run(nftables_binary.BINARY, argv) == 0
    written = parse_config(target.read_text())
    assert written.feature_gates == {
        "KubeProxyNFTablesLocalhostNodePorts": True,
        "NFTablesNetlink": False,
    }


def test_configz_shows_the_gates() -> None:
    from kubeproxy.daemon.serving import servers
    from kubeproxy.objects import NodeInfo

    options = parse_options(
        [
            "--feature-gates=KubeProxyNFTablesLocalhostNodePorts=true",
            "--metrics-bind-address=127.0.0.1:10249",
        ],
        "kube-proxy-nftables",
        "nftables",
        get_hostname=lambda: "n",
    )
    parts = servers(options, "nftables", 30.0, NodeInfo("n"))
    status, _headers, body = parts.metrics_server._config()
    document = json.loads(body)
    assert status == 200
    assert document["kubeproxy.config.k8s.io"]["featureGates"] == {
        "KubeProxyNFTablesLocalhostNodePorts": True
    }
    metrics = expose(parts.metrics.registry).decode()
    assert (
        'kubernetes_feature_enabled{name="KubeProxyNFTablesLocalhostNodePorts",stage="ALPHA"} 1'
        in metrics
    )
