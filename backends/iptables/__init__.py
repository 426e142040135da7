"""The iptables backend (placeholder: H1b replaces this module with the renderer's API)."""
