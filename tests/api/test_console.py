"""The console a person reads (issue 30 item 2): one format, no probe access lines, a "ready" line with the URLs."""

import json
import logging
import re
import time

from oai_gemma.logs import ACCESS_FIELDS, JsonFormatter, TextFormatter, access_message

TEXT_LINE = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3} (DEBUG|INFO|WARNING|ERROR|CRITICAL) [\w.]+: .+")


def start_up_lines(server) -> list[str]:
    lines = server.log_path.read_text().splitlines()
    ready = next(i for i, line in enumerate(lines) if " oai_gemma.server: ready: " in line)
    return lines[: ready + 1]


def test_a_real_start_reads_in_one_format_up_to_a_ready_line_with_the_urls(server):
    lines = start_up_lines(server)
    strays = [line for line in lines if not TEXT_LINE.fullmatch(line)]
    assert not strays, strays  # uvicorn's lines, Litestar's and progress bars included
    ready = lines[-1]
    assert " INFO oai_gemma.server: ready: " in ready
    assert f"playground {server.url}/, API base URL {server.url}/v1" in ready
    said = [line.split(": ", 1)[1] for line in lines]
    plan = next(i for i, text in enumerate(said) if text.startswith("start-up: "))
    warm_start = next(i for i, text in enumerate(said) if text.startswith("warm-up: "))
    assert plan < warm_start and re.search(r"warm-up done in [\d.]+ s", "\n".join(said[warm_start:]))


def test_probes_get_no_access_lines_by_default(server, http):
    assert http.get("/health").status_code == 200 and http.get("/metrics").status_code == 200
    request_id = http.get("/v1/models").headers["x-request-id"]
    deadline = time.monotonic() + 30
    while f"request_id={request_id}" not in server.log_path.read_text():  # written once the response is over
        assert time.monotonic() < deadline, "no access line for GET /v1/models"
        time.sleep(0.05)
    log = server.log_path.read_text()
    assert re.search(rf"oai_gemma\.access: GET /v1/models 200 .*request_id={request_id}", log)
    assert len(server.health_seen) > 1  # the fixture polled /health while the model loaded...
    assert not re.search(r"oai_gemma\.access: GET /(health|metrics) ", log)  # ...and none of it was logged


def access_record(entry: dict) -> logging.LogRecord:
    record = logging.LogRecord("oai_gemma.access", logging.INFO, __file__, 1, "%s", (access_message(entry),), None)
    setattr(record, ACCESS_FIELDS, entry)
    return record


ENTRY = {
    "time": "2026-12-05T07:00:13.759+00:00", "request_id": "4ca6", "method": "POST", "path": "/v1/chat/completions",
    "status": 200, "model": "gemma-3-270m", "prompt_tokens": 13, "completion_tokens": 8, "ttft_s": None,
    "duration_s": 0.33, "outcome": "length",
}


def test_an_access_line_reads_as_text_with_its_set_fields_as_key_value():
    line = TextFormatter().format(access_record(ENTRY))
    assert TEXT_LINE.fullmatch(line)
    assert line.endswith(
        "INFO oai_gemma.access: POST /v1/chat/completions 200 model=gemma-3-270m prompt_tokens=13 "
        "completion_tokens=8 duration_s=0.33 outcome=length request_id=4ca6"
    )


def test_json_lines_carry_level_logger_message_and_the_access_fields():
    line = json.loads(JsonFormatter().format(access_record(ENTRY)))
    assert (line["level"], line["logger"], line["status"], line["ttft_s"], line["time"]) == ("INFO", "oai_gemma.access", 200, None, ENTRY["time"])
    plain = json.loads(JsonFormatter().format(logging.LogRecord("oai_gemma.server", logging.INFO, __file__, 1, "ready: %s", ("x",), None)))
    assert set(plain) == {"time", "level", "logger", "message"} and plain["message"] == "ready: x"
