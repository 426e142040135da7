"""Renderers that turn the core's view into kernel state: nftables, iptables, ipvs."""
