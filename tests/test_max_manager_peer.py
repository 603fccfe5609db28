"""The MAX manager peer's line protocol (``benchmarks/max_manager_peer.py --serve``), without MAX.

Requests built by ``sparsekv.bench.manager`` must parse on the script's side
and its answers on ours; the serve loop answers every line, errors included.
"""

from __future__ import annotations

import importlib.util
import io
import json
import sys

import pytest

import script_support
from sparsekv.bench.manager import MaxManagerPeer, parse_peer_response, peer_request_line


def load_script():
    return script_support.load_script("max_manager_peer")


def test_requests_and_answers_round_trip():
    peer = load_script()
    request = peer.parse_request(peer_request_line("prefill_hit", 32, 2048, 3, capacity=9))
    assert request == peer.Request("prefill_hit", 32, 2048, 3, 9)
    answer = parse_peer_response(peer.response_line(request, [1.5, 2.0, 1.0], [0.1, 0.1, 0.1], 0.9))
    assert answer == {"case": "prefill_hit", "ms": [1.5, 2.0, 1.0], "context_ms": [0.1, 0.1, 0.1], "hit_rate": 0.9}
    assert peer.parse_request('{"case": "info"}') == peer.Request("info")
    with pytest.raises(RuntimeError, match="MAX manager peer failed: ValueError: boom"):
        parse_peer_response(peer.error_line("ValueError: boom"))
    with pytest.raises(RuntimeError, match="expected a JSON line"):
        parse_peer_response("Traceback (most recent call last):")


@pytest.mark.parametrize("line, message", [
    ("not json", "request: expected one JSON object per line"),
    ("[1, 2]", "request: expected a JSON object, got list"),
    ('{"case": "train"}', "case: expected one of"),
    ('{"case": "decode", "batch": 4}', "length: missing"),
    ('{"case": "decode", "batch": 0, "length": 8}', "batch: expected an int >= 1, got 0"),
    ('{"case": "decode", "batch": 4, "length": 8, "calls": true}', "calls: expected an int >= 1, got True"),
    ('{"case": "decode", "batch": 4, "length": 8, "repeat": 2}', r"request: unknown fields \['repeat'\]"),
])
def test_malformed_requests_name_the_field(line, message):
    with pytest.raises(ValueError, match=message):
        load_script().parse_request(line)


def test_serve_answers_every_line_and_goes_on_after_an_error():
    peer = load_script()

    class Fake:
        def answer(self, request):
            if request.case == "decode":
                raise RuntimeError("no pages")
            return peer.response_line(request, [1.0] * request.calls, [0.0] * request.calls, 0.0)

    out = io.StringIO()
    lines = [peer_request_line("decode", 2, 8, 1) + "\n", "\n", "oops\n", peer_request_line("prepare", 2, 8, 2) + "\n"]
    peer.serve(Fake(), lines, out)
    answers = [json.loads(line) for line in out.getvalue().splitlines()]
    assert answers[0] == {"error": "RuntimeError: no pages"}
    assert answers[1]["error"].startswith("ValueError: request: expected one JSON object")
    assert answers[2]["case"] == "prepare" and answers[2]["ms"] == [1.0, 1.0]


@pytest.mark.skipif(importlib.util.find_spec("max") is not None, reason="MAX is importable here")
def test_a_peer_without_max_fails_with_its_exit_status(capfd):
    with pytest.raises(RuntimeError, match="MAX manager peer exited with status 1"):
        MaxManagerPeer(sys.executable, script_support.BENCHMARKS / "max_manager_peer.py")
    assert "Modular MAX is not importable here" in capfd.readouterr().err
