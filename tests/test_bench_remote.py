"""The self-timed peer protocol of the benchmarks (``sparsekv.bench.remote``): request and reply lines,
the server loop, the client against a small pure-Python server, and its turn in the interleaved rounds."""

from __future__ import annotations

import json
import os
import sys
import textwrap

import pytest

from script_support import alive
from sparsekv.bench.common import SelfTimedPeer, time_interleaved
from sparsekv.bench.remote import (RemotePeer, RemotePeerError, parse_reply, parse_request, reply_line,
                                   request_line, serve)

# A stand-in for ``max_peer.py --serve`` that needs nothing but the standard library: each call
# "takes" 0.5 ms; FAIL_AT_START makes it exit before its ready line, DIE_AT makes it exit at that request.
FAKE_SERVER = textwrap.dedent("""
    import json, os, sys
    if os.environ.get("FAIL_AT_START"):
        sys.exit("fake server: cannot build the case")
    print(json.dumps({"ready": True, "op": "fake"}), flush=True)
    for number, line in enumerate(sys.stdin):
        if number == int(os.environ.get("DIE_AT", "-1")):
            sys.exit(3)
        calls = json.loads(line)["calls"]
        print(json.dumps({"calls": calls, "seconds": 0.0005 * calls}), flush=True)
""")


def _fake_peer(**env: str) -> RemotePeer:
    return RemotePeer([sys.executable, "-c", FAKE_SERVER], env={**os.environ, **env}, start_timeout_s=60,
                      call_timeout_s=60, grace_s=5)


def test_request_round_trip_and_defaults():
    assert parse_request(request_line(7, warmup=1)) == (7, 1)
    assert parse_request('{"calls": 3}\n') == (3, 0)


@pytest.mark.parametrize(("line", "message"), [
    ("not json", "expected a JSON object"),
    ("[1, 2]", "expected a JSON object"),
    ('{"warmup": 1}', "missing 'calls'"),
    ('{"calls": 0}', "'calls' must be an integer >= 1, got 0"),
    ('{"calls": 2.5}', "'calls' must be an integer >= 1, got 2.5"),
    ('{"calls": true}', "'calls' must be an integer >= 1, got True"),
    ('{"calls": 1, "warmup": -1}', "'warmup' must be an integer >= 0, got -1"),
    ('{"calls": 1, "repeat": 2}', r"unknown field\(s\) \['repeat'\]"),
])
def test_bad_requests_are_named(line, message):
    with pytest.raises(ValueError, match=message):
        parse_request(line)


def test_replies():
    assert parse_reply(reply_line(4, 0.25), 4) == 0.25
    with pytest.raises(ValueError, match="expected 'calls' 4, got 5"):
        parse_reply(reply_line(5, 0.25), 4)
    with pytest.raises(ValueError, match="'seconds' must be a number >= 0, got -1"):
        parse_reply('{"calls": 1, "seconds": -1}', 1)
    with pytest.raises(RemotePeerError, match="peer: out of memory"):
        parse_reply('{"error": "out of memory"}', 1)


def test_serve_times_only_the_timed_calls_and_answers_bad_lines():
    ran, now = [], [0.0]

    def run():
        ran.append(now[0])
        now[0] += 1.0  # every call "takes" one second of the fake clock

    written: list[str] = []
    lines = [request_line(2, warmup=3), "\n", '{"calls": 0}\n', request_line(1)]
    assert serve(run, lines, written.append, ready={"op": "fake"}, clock=lambda: now[0]) == 2
    replies = [json.loads(line) for line in written]
    assert replies[0] == {"ready": True, "op": "fake"}
    assert replies[1] == {"calls": 2, "seconds": 2.0}  # the three warm-up calls are not in it
    assert "'calls' must be an integer >= 1" in replies[2]["error"]
    assert replies[3] == {"calls": 1, "seconds": 1.0}
    assert len(ran) == 6 and all(line.endswith("\n") for line in written)


def test_remote_peer_takes_its_turn_in_the_rounds_and_stops_after():
    with _fake_peer() as peer:
        pid = peer.process.pid
        assert peer.info == {"op": "fake"}
        assert peer.time_calls(4, warmup=1) == pytest.approx(0.002)
        times = time_interleaved({"local": lambda: None, "remote": peer}, rounds=3)
    assert times["remote"] == pytest.approx(0.5)  # ms per call, by the server's own clock
    assert not alive(pid)


def test_remote_peer_failures_name_the_cause_and_leave_no_process():
    with pytest.raises(RemotePeerError, match="exited \\(1\\) at start: fake server: cannot build the case"):
        _fake_peer(FAIL_AT_START="1")
    peer = _fake_peer(DIE_AT="1")
    try:
        peer.time_calls(1)
        with pytest.raises(RemotePeerError, match="exited \\(3\\)"):
            peer.time_calls(1)
    finally:
        peer.close()
    assert not alive(peer.process.pid)


def test_a_self_timed_peer_reports_its_own_time():
    class Fixed(SelfTimedPeer):
        def __init__(self):
            self.requests = []

        def time_calls(self, calls, warmup=0):
            self.requests.append((calls, warmup))
            return 0.001 * calls

    peer = Fixed()
    assert time_interleaved({"peer": peer}, rounds=2, round_ms=5.0) == {"peer": pytest.approx(1.0)}
    assert peer.requests == [(1, 1), (5, 1), (5, 1)]  # warm-up picks 5 calls a round, each after one untimed


def test_qsa_row_without_max_says_why_and_keeps_its_other_peers(capsys):
    import torch

    from sparsekv.bench.qsa import MAX_PEER_SCRIPT, bench_block_score

    if not MAX_PEER_SCRIPT.exists():
        pytest.skip("not a source checkout")
    # this Python has no MAX: the server exits before its ready line
    row = bench_block_score(2, 256, 4, torch.bfloat16, sys.executable)
    assert "max" not in row.peers_ms and {"1thread", "reference", "copy", "peak"} <= set(row.peers_ms)
    assert "no MAX column for block_score 256" in capsys.readouterr().err and row.note == ""


def test_a_max_peer_that_fails_mid_row_leaves_the_row_timed_without_it(capsys):
    from sparsekv.bench.qsa import _time_with_peers

    class Dies(SelfTimedPeer):
        def time_calls(self, calls, warmup=0):
            raise RemotePeerError("peer exited (3)")

    ours, peers, _ = _time_with_peers(lambda: None, Dies(), copy=lambda: None)
    assert ours > 0 and set(peers) == {"1thread", "reference", "copy"}
    assert "no MAX column for this row: peer exited (3)" in capsys.readouterr().err
