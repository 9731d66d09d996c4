"""Database passwords never reach a log line or an error: URLs and libpq DSNs are masked."""

from __future__ import annotations

import io
import logging
import subprocess
import sys
from collections.abc import Iterator

import pytest
from typer.testing import CliRunner

from protocol.logsafety import MaskingFilter, install_log_masking, mask_text

SECRET = "hunter2-s3cret"
URL = f"postgresql+psycopg://ledger:{SECRET}@db.example:5432/ledger"


@pytest.mark.parametrize(
    "text",
    [
        URL,
        f"connecting to {URL} now",
        f"postgresql://writer:{SECRET}@dbhost/ledger?sslmode=require",
        f"postgres://u:{SECRET}@h",
        f"host=db port=5432 user=ledger password={SECRET} dbname=ledger",
        f"host=db password='{SECRET} with space' dbname=ledger",
        f"?user=ledger&password={SECRET}&sslmode=require",
        f"two: {URL} and sqlite:///x.db and {URL}",
    ],
)
def test_mask_text_hides_every_password(text: str) -> None:
    masked = mask_text(text)
    assert SECRET not in masked
    assert "***" in masked


def test_mask_text_leaves_other_text_alone() -> None:
    for text in ("sqlite:///ledger.db", "http://127.0.0.1:8000/run", "no url here", "postgresql://u@h/db"):
        assert mask_text(text) == text


@pytest.fixture
def captured() -> Iterator[io.StringIO]:
    """The process-wide masking (as the CLI and agents install it) and a plain handler on the root."""
    install_log_masking()
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    old_level = root.level
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)
    try:
        yield stream
    finally:
        root.removeHandler(handler)
        root.setLevel(old_level)


def test_every_log_record_is_masked(captured: io.StringIO) -> None:
    for name in ("ledger", "sqlalchemy.engine", "uvicorn.error", "gym_agent", "trainer"):
        log = logging.getLogger(name)
        log.info("opening %s", URL)  # in the arguments
        log.warning(f"opening {URL}")  # in the message itself
        log.error("store error: %(url)s", {"url": URL})  # mapping arguments
        try:
            raise ConnectionError(f"could not connect to {URL}")
        except ConnectionError:
            log.exception("failed")  # in the traceback
        log.info(ValueError(URL))  # a non-string message
    text = captured.getvalue()
    assert text.count("***") >= 15
    assert SECRET not in text


def test_masking_filter_for_a_handler_of_its_own() -> None:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.addFilter(MaskingFilter())
    record = logging.LogRecord("x", logging.INFO, __file__, 1, "url %s", (URL,), None)
    handler.handle(record)
    assert SECRET not in stream.getvalue() and "ledger:***@db.example" in stream.getvalue()


def test_the_ledger_cli_installs_the_masking() -> None:
    """A fresh interpreter that imports the `ledger` app logs no password, from any logger."""
    code = (
        "import logging, sys\n"
        "from cli.main import app\n"
        "logging.basicConfig(stream=sys.stdout, level=logging.INFO)\n"
        f"logging.getLogger('eventstore').info('connect %s', {URL!r})\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "ledger:***@db.example" in out.stdout and SECRET not in out.stdout + out.stderr


def test_cli_errors_mask_the_url() -> None:
    from cli.main import app

    bad = f"postgresql+psycopg://ledger:{SECRET}@127.0.0.1:1/ledger"
    result = CliRunner().invoke(app, ["audit", "--db", bad])
    assert result.exit_code != 0
    assert SECRET not in result.output
    assert SECRET not in str(result.exception or "")
