"""Benchmarks of kubeproxy's backends and of upstream's rule structures (pytest-benchmark)."""
