"""What the daemon is told to do: :class:`DaemonOptions`.

The binaries build theirs from upstream's flags and ``--config`` file
(:mod:`kubeproxy.cmd.commandline` subclasses it with the binary-only switches); an
out-of-tree proxy builds its own from a ``KubeProxyConfiguration``
(:meth:`DaemonOptions.from_configuration`, or :meth:`DaemonOptions.from_file` for a
config file), so both get upstream's validation, node name and per-mode settings.
"""

from __future__ import annotations

import dataclasses
import socket
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

from kubeproxy.config import ProxierConfig
from kubeproxy.configfile.codec import load_config_file
from kubeproxy.configfile.model import (
    ConfigError,
    KubeProxyConfiguration,
    KubeProxyConntrackConfiguration,
    LoggingConfiguration,
)
from kubeproxy.configfile.settings import apply_platform_defaults, to_proxier_config, validate
from kubeproxy.featuregates import FeatureGates
from kubeproxy.objects import IPNetwork

__all__ = ["DaemonOptions", "node_name_of"]


def node_name_of(
    configuration: KubeProxyConfiguration, get_hostname: Callable[[], str] = socket.gethostname
) -> str:
    """The node this proxy runs as: ``hostnameOverride``, else the host's name, lower-cased
    (upstream's rule); raises :class:`~kubeproxy.configfile.model.ConfigError` when empty."""
    name = (configuration.hostname_override or get_hostname()).strip().lower()
    if not name:
        raise ConfigError("hostnameOverride", "empty hostname is invalid")
    return name


@dataclass(frozen=True, slots=True)
class DaemonOptions:
    """The daemon's settings: the effective configuration and how to run.

    ``configuration`` is the KubeProxyConfiguration with upstream's start-up defaults
    applied (``mode`` is set); ``config`` is what a proxier of that mode takes from it;
    ``node_name`` the Node this proxy runs as. ``manifests`` reads objects from a
    directory instead of an API server; ``master`` overrides the API server's address;
    ``once`` syncs once and returns, ``dry_run`` too over the backend the caller gives
    (the binaries pass in-memory fakes), ``init_only`` does the privileged set-up only.
    ``flags`` are the command-line flags given (name -> value, for ``/flagz``).
    The properties read the configuration under upstream's flag names.
    """

    configuration: KubeProxyConfiguration
    config: ProxierConfig
    node_name: str
    manifests: Path | None = None
    master: str = ""
    once: bool = False
    dry_run: bool = False
    init_only: bool = False
    flags: Mapping[str, str] = dataclasses.field(default_factory=dict)

    @classmethod
    def from_configuration(
        cls,
        configuration: KubeProxyConfiguration,
        *,
        mode: str | None = None,
        service_cidrs: Sequence[IPNetwork] = (),
        get_hostname: Callable[[], str] = socket.gethostname,
        **fields: Any,
    ) -> Self:
        """Options for ``configuration`` as upstream settles it at start-up.

        ``mode`` (``nftables``, ``iptables``, ``ipvs``) replaces the configuration's;
        which one picks the section the sync periods and masquerade settings come from
        and the mode-specific metrics, so an out-of-tree renderer names the mode its
        rules resemble. Upstream's platform defaults are applied, then its validation;
        ``fields`` are the other attributes (``master``, ``manifests``, ``once``...).
        Raises :class:`~kubeproxy.configfile.model.ConfigError` naming the field at fault,
        or ``ValueError``.
        """
        if mode is not None:
            configuration = dataclasses.replace(configuration, mode=mode)
        configuration = apply_platform_defaults(configuration)
        validate(configuration)
        node_name = node_name_of(configuration, get_hostname)
        config = to_proxier_config(
            configuration, node_name, configuration.mode, service_cidrs=service_cidrs
        )
        return cls(configuration=configuration, config=config, node_name=node_name, **fields)

    @classmethod
    def from_file(cls, path: str | Path, *, mode: str | None = None, **fields: Any) -> Self:
        """Options from a KubeProxyConfiguration file (decoded strictly, as ``--config``);
        see :meth:`from_configuration`."""
        return cls.from_configuration(load_config_file(path), mode=mode, **fields)

    @property
    def kubeconfig(self) -> str:
        """``clientConnection.kubeconfig`` (``--kubeconfig``); empty: in-cluster or ``master``."""
        return self.configuration.client_connection.kubeconfig

    @property
    def qps(self) -> float:
        """``clientConnection.qps`` (``--kube-api-qps``)."""
        return self.configuration.client_connection.qps

    @property
    def burst(self) -> int:
        """``clientConnection.burst`` (``--kube-api-burst``)."""
        return self.configuration.client_connection.burst

    @property
    def content_type(self) -> str:
        """``clientConnection.contentType`` (``--kube-api-content-type``)."""
        return self.configuration.client_connection.content_type

    @property
    def accept_content_types(self) -> str:
        """``clientConnection.acceptContentTypes``."""
        return self.configuration.client_connection.accept_content_types

    @property
    def healthz_bind_address(self) -> str:
        """``IP:port`` of the health server; empty disables it."""
        return self.configuration.healthz_bind_address

    @property
    def metrics_bind_address(self) -> str:
        """``IP:port`` of the metrics server; empty disables it."""
        return self.configuration.metrics_bind_address

    @property
    def bind_address_hard_fail(self) -> bool:
        """Whether failing to bind the health or metrics server is fatal."""
        return self.configuration.bind_address_hard_fail

    @property
    def enable_profiling(self) -> bool:
        """``enableProfiling`` (``--profiling``)."""
        return self.configuration.enable_profiling

    @property
    def logging(self) -> LoggingConfiguration:
        """The logging settings (file, overridden by the logging flags)."""
        return self.configuration.logging

    @property
    def verbosity(self) -> int:
        """``-v``: 0-2 info, 4 and more debug."""
        return self.configuration.logging.verbosity

    @property
    def logging_format(self) -> str:
        """``text`` or ``json``."""
        return self.configuration.logging.format

    @property
    def conntrack(self) -> KubeProxyConntrackConfiguration:
        """The conntrack sysctls to set at start-up (0: leave the kernel's value)."""
        return self.configuration.conntrack

    @property
    def oom_score_adj(self) -> int:
        """The ``oom_score_adj`` to give this process."""
        return self.configuration.oom_score_adj

    @property
    def config_sync_period(self) -> float:
        """``configSyncPeriod`` in seconds (informer resync)."""
        return self.configuration.config_sync_period.seconds

    @property
    def feature_gates(self) -> Mapping[str, bool]:
        """``featureGates`` (``--feature-gates``) as given."""
        return self.configuration.feature_gates

    @property
    def gates(self) -> FeatureGates:
        """The effective feature gates (every known gate; see
        :mod:`kubeproxy.featuregates`)."""
        return self.config.feature_gates
