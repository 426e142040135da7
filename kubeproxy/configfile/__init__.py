"""Upstream's configuration file: ``KubeProxyConfiguration``."""
