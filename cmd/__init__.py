"""Entry points: flag and config parsing, wiring a source, a backend and servers."""
