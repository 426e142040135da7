"""Logging set-up: JSON lines that parse, klog-like text, -v levels, vmodule, split streams."""

from __future__ import annotations

import io
import json
import logging
import re
import uuid
from collections.abc import Iterator

import pytest

from kubeproxy.configfile.model import (
    FormatOptions,
    LoggingConfiguration,
    OutputRoutingOptions,
    VModuleItem,
)
from kubeproxy.logs import (
    configure_logging,
    level_for_verbosity,
    verbosity_level,
    verbosity_of,
)


@pytest.fixture
def root() -> Iterator[logging.Logger]:
    """A private logger tree, so the tests never touch the real root logger."""
    logger = logging.getLogger(f"kpxlogtest{uuid.uuid4().hex[:8]}")
    logger.propagate = False
    try:
        yield logger
    finally:
        for handler in list(logger.handlers):
            logger.removeHandler(handler)


def _lines(stream: io.StringIO) -> list[str]:
    return stream.getvalue().splitlines()


def test_json_lines_parse_as_json(root: logging.Logger) -> None:
    out = io.StringIO()
    configure_logging(LoggingConfiguration(format="json", verbosity=2), stream=out, root=root)
    log = root.getChild("proxier")
    log.info("Syncing %d services", 3)
    log.warning('quote " and\nnewline')
    log.log(verbosity_level(2), "verbose detail")
    log.log(verbosity_level(3), "too verbose")
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        log.exception("sync failed")
    entries = [json.loads(line) for line in _lines(out)]
    assert [e["msg"] for e in entries] == [
        "Syncing 3 services",
        'quote " and\nnewline',
        "verbose detail",
        "sync failed",
    ]
    assert [e["level"] for e in entries] == ["info", "warning", "info", "error"]
    assert {e["logger"] for e in entries} == {f"{root.name}.proxier"}
    assert all(isinstance(e["ts"], float) for e in entries)
    assert entries[0]["v"] == 0
    assert entries[2]["v"] == 2
    assert entries[0]["caller"].startswith("test_logs.py:")
    assert "RuntimeError: boom" in entries[3]["err"]
    assert "v" not in entries[3]


def test_text_lines_look_like_klog(root: logging.Logger) -> None:
    out = io.StringIO()
    configure_logging(LoggingConfiguration(), stream=out, root=root)
    root.getChild("sources").warning("Skipping %s", "ns/name")
    root.getChild("sources").error("bad")
    lines = _lines(out)
    header = r"\d{4} \d\d:\d\d:\d\d\.\d{6} +\d+ " + re.escape(root.name) + r"\.sources\] "
    assert re.fullmatch("W" + header + "Skipping ns/name", lines[0]), lines[0]
    assert re.fullmatch("E" + header + "bad", lines[1]), lines[1]


@pytest.mark.parametrize(
    ("verbosity", "shown"),
    [
        (0, ["info", "warning"]),
        (2, ["info", "warning", "v1", "v2"]),
        (3, ["info", "warning", "v1", "v2", "v3"]),
        (4, ["info", "warning", "v1", "v2", "v3", "debug"]),
        (6, ["info", "warning", "v1", "v2", "v3", "debug", "v5", "v6"]),
    ],
)
def test_verbosity_thresholds(root: logging.Logger, verbosity: int, shown: list[str]) -> None:
    out = io.StringIO()
    configure_logging(
        LoggingConfiguration(format="json", verbosity=verbosity), stream=out, root=root
    )
    log = root.getChild("x")
    log.info("info")
    log.warning("warning")
    for n in (1, 2, 3):
        log.log(verbosity_level(n), f"v{n}")
    log.debug("debug")
    for n in (5, 6, 7):
        log.log(verbosity_level(n), f"v{n}")
    assert [json.loads(line)["msg"] for line in _lines(out)] == shown


def test_levels_and_verbosity_agree() -> None:
    assert level_for_verbosity(0) == logging.INFO
    assert level_for_verbosity(4) == logging.DEBUG
    for n in range(12):
        assert verbosity_of(verbosity_level(n)) == n
        assert level_for_verbosity(n + 1) < level_for_verbosity(n)


def test_vmodule_raises_one_module(root: logging.Logger) -> None:
    out = io.StringIO()
    config = LoggingConfiguration(vmodule=(VModuleItem(f"{root.name}.chatty*", 4),))
    configure_logging(config, stream=out, root=root)
    root.getChild("chatty.sub").debug("shown")
    root.getChild("quiet").debug("hidden")
    root.getChild("quiet").info("shown too")
    assert [line.rsplit("] ", 1)[1] for line in _lines(out)] == ["shown", "shown too"]


def test_split_stream_sends_errors_apart(root: logging.Logger) -> None:
    info, errors = io.StringIO(), io.StringIO()
    split = OutputRoutingOptions(split_stream=True)
    config = LoggingConfiguration(format="json", options=FormatOptions(json=split))
    configure_logging(config, stream=errors, info_stream=info, root=root)
    root.info("fine")
    root.error("broken")
    assert [json.loads(line)["msg"] for line in _lines(info)] == ["fine"]
    assert [json.loads(line)["msg"] for line in _lines(errors)] == ["broken"]


def test_configuring_again_replaces_the_handlers(root: logging.Logger) -> None:
    first, second = io.StringIO(), io.StringIO()
    configure_logging(LoggingConfiguration(), stream=first, root=root)
    configure_logging(LoggingConfiguration(format="json"), stream=second, root=root)
    root.info("once")
    assert first.getvalue() == ""
    assert [json.loads(line)["msg"] for line in _lines(second)] == ["once"]


def test_other_libraries_are_capped_at_info_unless_vmodule_names_them(
    root: logging.Logger,
) -> None:
    ours, library = root.getChild("kubeproxy"), root.getChild("pyroute2").getChild("ndb")
    out = io.StringIO()
    configure_logging(LoggingConfiguration(verbosity=6), stream=out, root=root, ours=(ours.name,))
    ours.debug("our debug")
    library.debug("netlink dump")
    library.log(verbosity_level(2), "library v2")
    library.info("library info")
    library.warning("library warning")
    assert [line.rsplit("] ", 1)[1] for line in _lines(out)] == [
        "our debug",
        "library info",
        "library warning",
    ]
    out = io.StringIO()
    vmodule = (VModuleItem(f"{root.name}.pyroute2*", 4),)
    configure_logging(
        LoggingConfiguration(verbosity=0, vmodule=vmodule),
        stream=out,
        root=root,
        ours=(ours.name,),
    )
    ours.debug("hidden at -v 0")
    library.debug("asked for")
    assert [line.rsplit("] ", 1)[1] for line in _lines(out)] == ["asked for"]


def test_noisy_libraries_do_not_even_make_debug_records(root: logging.Logger) -> None:
    pyroute2 = logging.getLogger("pyroute2")
    level = pyroute2.level
    try:
        configure_logging(LoggingConfiguration(verbosity=6), stream=io.StringIO(), root=root)
        assert not pyroute2.isEnabledFor(logging.DEBUG)
        config = LoggingConfiguration(verbosity=6, vmodule=(VModuleItem("pyroute2*", 4),))
        configure_logging(config, stream=io.StringIO(), root=root)
        assert pyroute2.level == logging.NOTSET
    finally:
        pyroute2.setLevel(level)
