"""One structlog configuration: JSON lines off a TTY, stdlib logs through the same processors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from octopipe.execute import configure_logging

SCRIPT = """
import logging, structlog
from octopipe.execute import configure_logging
configure_logging(fmt={fmt!r})
structlog.get_logger("t").info("plan_pushed", rank=3, version=7)
logging.getLogger("stdlib").warning("plain %s", "record")
"""


def run(fmt: str) -> list[str]:
    result = subprocess.run([sys.executable, "-c", SCRIPT.format(fmt=fmt)], capture_output=True, text=True, check=True)
    return result.stderr.strip().splitlines()


def test_json_when_not_a_tty() -> None:
    first, second = (json.loads(line) for line in run("auto"))
    assert first["event"] == "plan_pushed"
    assert (first["rank"], first["version"], first["level"], first["logger"]) == (3, 7, "info", "t")
    assert "timestamp" in first
    assert second["event"] == "plain record"
    assert second["level"] == "warning"


def test_console_when_asked() -> None:
    lines = run("console")
    assert "plan_pushed" in lines[0]
    assert "rank=3" in lines[0]
    with pytest.raises(json.JSONDecodeError):
        json.loads(lines[0])


def test_rejects_unknown_format() -> None:
    with pytest.raises(ValueError, match="log format must be"):
        configure_logging(fmt="xml")  # type: ignore[arg-type]
