"""The console: one log format for every logger (ours, uvicorn's, Python warnings), set up once at start.

`text` (the default) is for a person: `2026-12-05 07:30:01.123 INFO oai_gemma.server: ready ...`, an access line
reading `POST /v1/chat/completions 200 model=... duration_s=0.331 outcome=length request_id=...`. `json` is for a
log shipper: one object per line, `time`, `level`, `logger`, `message`, and an access line's fields beside them.
Progress bars are off (they would cut through the lines); the steps they stood for are logged with their time.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from datetime import datetime, timezone

import msgspec

ACCESS_FIELDS = "access"
"""The `extra` key under which an access-log record carries its fields (`api/access_log.py`)."""


class TextFormatter(logging.Formatter):
    converter = time.gmtime  # UTC, as the JSON lines

    def __init__(self) -> None:
        super().__init__("%(asctime)s.%(msecs)03d %(levelname)s %(name)s: %(message)s", "%Y-%m-%d %H:%M:%S")


class JsonFormatter(logging.Formatter):
    """One JSON object per line; an access record's fields are keys of their own."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds"),
            "level": record.levelname, "logger": record.name, "message": record.getMessage(),
        }
        entry.update(getattr(record, ACCESS_FIELDS, None) or {})
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return msgspec.json.encode(entry).decode()


def configure_logging(level: str, fmt: str) -> None:
    """Every record to stderr in `fmt` (`text` or `json`) at `level`; before anything else logs."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # transformers' bars follow huggingface_hub's switch
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
    logging.captureWarnings(True)


_NOT_KEY_VALUE = ("time", "method", "path", "status", "request_body", "output")


def access_message(entry: dict) -> str:
    """An access line as a person reads it: method, path, status, then the fields that are set, as key=value."""
    shown = {key: value for key, value in entry.items() if key not in _NOT_KEY_VALUE and value is not None}
    shown["request_id"] = shown.pop("request_id")  # last: long, and wanted only when following one request
    text = " ".join([entry["method"], entry["path"], str(entry["status"]), *(f"{k}={v}" for k, v in shown.items())])
    if "request_body" in entry:  # server.log_request_text: debugging only
        text += f" request_body={msgspec.json.encode(entry['request_body']).decode()} output={msgspec.json.encode(entry['output']).decode()}"
    return text
