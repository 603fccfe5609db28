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
from sparsekv.bench import manager
from sparsekv.bench.manager import MaxManagerPeer, parse_peer_response, peer_request_line
from sparsekv.bench.remote import RemotePeerError


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
def test_a_peer_without_max_fails_with_its_exit_status_and_stderr():
    message = r"MAX manager peer exited \(1\) at start: .*Modular MAX is not importable"
    with pytest.raises(RemotePeerError, match=message):
        MaxManagerPeer(sys.executable, script_support.BENCHMARKS / "max_manager_peer.py")


# Stand-ins for ``max_manager_peer.py --serve`` that fail in each way the client must report in bounded time.
INFO = 'print(json.dumps({"case": "info", "max": "0"}), flush=True)'
FAILING_PEERS = {
    "exits": ("sys.exit('fake peer: no MAX here')", r"exited \(1\) at start: fake peer: no MAX here"),
    "garbage": ("sys.stderr.write('boom\\n'); sys.stderr.flush(); "
                "print('Traceback (most recent call last):', flush=True); time.sleep(60)",
                r"expected a JSON line, got 'Traceback.*\(stderr: boom\)"),
    "silent": ("sys.stderr.write('still importing\\n'); sys.stderr.flush(); time.sleep(60)",
               r"no answer to start within 2 s: still importing"),
    "dies_at_request": (f"{INFO}; sys.stdin.readline(); sys.exit('fake peer: out of pages')",
                        r"exited \(1\) at a decode request: fake peer: out of pages"),
}


@pytest.mark.parametrize("name", FAILING_PEERS)
def test_a_failing_peer_is_reported_with_its_stderr_and_ended(tmp_path, monkeypatch, name):
    started = []

    class Recorded(manager.PeerProcess):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            started.append(self)

    monkeypatch.setattr(manager, "PeerProcess", Recorded)
    body, message = FAILING_PEERS[name]
    script = tmp_path / "peer.py"
    script.write_text(f"import json, sys, time\n{body}\n")
    with pytest.raises(RemotePeerError, match=message):
        with MaxManagerPeer(sys.executable, script, start_timeout_s=2, call_timeout_s=2, grace_s=0.5) as peer:
            peer.time("decode", 2, 8, 1)
    assert len(started) == 1 and not script_support.alive(started[0].pid)
