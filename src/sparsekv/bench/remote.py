"""A benchmark peer that runs and times itself in another process (a peer that needs its own Python).

The peer's process (the server) sets up its case once, then answers timing
requests on its stdin and stdout, one JSON object per line:

* on start, server to client: ``{"ready": true, ...}`` (any other keys describe the case), or
  ``{"error": "why"}`` before it exits;
* client to server: ``{"calls": n, "warmup": w}``: run ``w`` untimed calls, then ``n`` timed calls
  back to back (``n >= 1``, ``w >= 0``, ``warmup`` defaults to 0);
* server to client: ``{"calls": n, "seconds": s}``, the wall time of the ``n`` timed calls measured in
  the server, or ``{"error": "why"}`` for a request it cannot read (it then reads the next one);
* the server exits at the end of its stdin.

:class:`RemotePeer` is the client: a :class:`.common.SelfTimedPeer`, so
:func:`.common.time_interleaved` times it in the same rounds as the calls of
this process, by its own clock and without the pipe's round trip. While one
side runs, the other waits on the pipe. :func:`serve` is the server loop.
:class:`PeerProcess` is the process under any such client, whatever its lines
say: start, line reads with a timeout, stderr tail in errors, kill on close.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TypeVar

from .common import SelfTimedPeer


_T = TypeVar("_T")


class RemotePeerError(RuntimeError):
    """The peer's process failed, stopped answering, or answered something unreadable."""


def _object(line: str, what: str) -> dict:
    try:
        value = json.loads(line)
    except ValueError as exc:
        raise ValueError(f"{what}: expected a JSON object, got {line.strip()[:200]!r} ({exc})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{what}: expected a JSON object, got {line.strip()[:200]!r}")
    return value


def _count(value: object, name: str, minimum: int) -> int:
    # bool is an int in Python; a request of {"calls": true} is a mistake, not one call
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"request: {name!r} must be an integer >= {minimum}, got {value!r}")
    return value


def request_line(calls: int, warmup: int = 0) -> str:
    """The request for ``warmup`` untimed then ``calls`` timed calls, as one line (with its newline)."""
    _count(calls, "calls", 1)
    _count(warmup, "warmup", 0)
    return json.dumps({"calls": calls, "warmup": warmup}) + "\n"


def parse_request(line: str) -> tuple[int, int]:
    """``(calls, warmup)`` from a request line; ``ValueError`` naming the field for a bad one."""
    request = _object(line, "request")
    if "calls" not in request:
        raise ValueError(f"request: missing 'calls' in {line.strip()[:200]!r}")
    unknown = set(request) - {"calls", "warmup"}
    if unknown:
        raise ValueError(f"request: unknown field(s) {sorted(unknown)} in {line.strip()[:200]!r}")
    return _count(request["calls"], "calls", 1), _count(request.get("warmup", 0), "warmup", 0)


def reply_line(calls: int, seconds: float) -> str:
    """The reply for ``calls`` timed calls that took ``seconds`` in all, as one line."""
    return json.dumps({"calls": calls, "seconds": seconds}) + "\n"


def parse_reply(line: str, calls: int) -> float:
    """The seconds in a reply to a request for ``calls`` calls.

    Raises :class:`RemotePeerError` for an ``{"error": ...}`` reply, ``ValueError`` for an unreadable
    one (not JSON, missing or wrong fields, a call count that is not the one asked for).
    """
    reply = _object(line, "reply")
    if "error" in reply:
        raise RemotePeerError(f"peer: {reply['error']}")
    if reply.get("calls") != calls:
        raise ValueError(f"reply: expected 'calls' {calls}, got {reply.get('calls')!r}")
    seconds = reply.get("seconds")
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not seconds >= 0:
        raise ValueError(f"reply: 'seconds' must be a number >= 0, got {seconds!r}")
    return float(seconds)


def serve(run: Callable[[], object], lines: Iterable[str], write: Callable[[str], object], *,
          ready: Mapping[str, object] | None = None, clock: Callable[[], float] = time.perf_counter) -> int:
    """The server loop: announce ``ready``, then answer each request line by timing ``run()``.

    ``write`` gets whole lines and must deliver each at once (flush it). Blank lines are skipped; a bad
    request gets an ``{"error": ...}`` reply. Returns the number of requests answered with a time.
    """
    write(json.dumps({"ready": True, **(ready or {})}) + "\n")
    answered = 0
    for line in lines:
        if not line.strip():
            continue
        try:
            calls, warmup = parse_request(line)
        except ValueError as exc:
            write(json.dumps({"error": str(exc)}) + "\n")
            continue
        for _ in range(warmup):
            run()
        started = clock()
        for _ in range(calls):
            run()
        write(reply_line(calls, clock() - started))
        answered += 1
    return answered


class PeerProcess:
    """A server process driven one line at a time: ``command`` started with pipes on its stdin and stdout.

    Its stderr goes to a temporary file; every :class:`RemotePeerError` raised here quotes its last lines.
    ``name`` begins those errors' messages. :meth:`close` (or leaving the ``with`` block) ends the process:
    it closes its stdin, waits ``grace_s`` for it to exit, then kills it; it is reaped either way, and a
    process still running when this object is garbage-collected is killed.
    """

    def __init__(self, command: Sequence[str], *, env: Mapping[str, str] | None = None, name: str = "peer",
                 grace_s: float = 5.0) -> None:
        self.command = list(command)
        self.name = name
        self.grace_s = grace_s
        self._stderr = tempfile.TemporaryFile(mode="w+b")
        try:
            self._popen = subprocess.Popen(self.command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                           stderr=self._stderr, env=None if env is None else dict(env),
                                           text=True, bufsize=1)
        except OSError as exc:
            self._stderr.close()
            raise RemotePeerError(f"cannot start {self.command[0]}: {exc}") from exc

    @property
    def pid(self) -> int:
        return self._popen.pid

    def stderr_tail(self, lines: int = 3) -> str:
        """The last ``lines`` lines of the process's stderr, joined by `` | ``."""
        if self._stderr.closed:
            return "its stderr is closed"
        self._stderr.seek(0)
        tail = self._stderr.read().decode(errors="replace").strip().splitlines()[-lines:]
        return " | ".join(tail) if tail else "nothing on stderr"

    def read_line(self, timeout_s: float, what: str) -> str:
        """The next line of the process's stdout (with its newline), waiting at most ``timeout_s``."""
        stdout = self._popen.stdout
        ready, _, _ = select.select([stdout], [], [], timeout_s)
        if not ready:
            raise RemotePeerError(f"{self.name}: no answer to {what} within {timeout_s:g} s: {self.stderr_tail()}")
        line = stdout.readline()
        if not line:
            try:
                code = self._popen.wait(timeout=self.grace_s)
            except subprocess.TimeoutExpired:
                raise RemotePeerError(f"{self.name} closed its stdout at {what}: {self.stderr_tail()}") from None
            raise RemotePeerError(f"{self.name} exited ({code}) at {what}: {self.stderr_tail()}")
        return line

    def write_line(self, line: str) -> None:
        """Send ``line`` (ending in a newline) to the process's stdin at once."""
        if self._popen.poll() is not None:
            raise RemotePeerError(f"{self.name} exited ({self._popen.returncode}): {self.stderr_tail()}")
        try:
            self._popen.stdin.write(line)
            self._popen.stdin.flush()
        except OSError as exc:
            raise RemotePeerError(f"{self.name}: cannot send a request ({exc}): {self.stderr_tail()}") from exc

    def _parsed(self, line: str, parse: Callable[[str], _T]) -> _T:
        try:
            return parse(line)
        except (ValueError, RuntimeError) as exc:
            raise RemotePeerError(f"{exc} (stderr: {self.stderr_tail()})") from exc

    def handshake(self, parse: Callable[[str], _T], timeout_s: float) -> _T:
        """``parse`` of the process's first line, read within ``timeout_s``; closes the process on any failure.

        A ``ValueError`` or ``RuntimeError`` from ``parse`` becomes a :class:`RemotePeerError` with the
        stderr tail.
        """
        try:
            return self._parsed(self.read_line(timeout_s, "start"), parse)
        except BaseException:
            self.close()
            raise

    def exchange(self, line: str, parse: Callable[[str], _T], timeout_s: float, what: str) -> _T:
        """Send ``line``, then ``parse`` of the answer read within ``timeout_s``; ``what`` names the request
        in errors. A ``ValueError`` or ``RuntimeError`` from ``parse`` becomes a :class:`RemotePeerError`
        with the stderr tail."""
        self.write_line(line)
        return self._parsed(self.read_line(timeout_s, what), parse)

    def close(self) -> None:
        """End the process (idempotent)."""
        process = self._popen
        if process.poll() is None:
            try:
                process.stdin.close()
            except OSError:
                pass
            try:
                process.wait(timeout=self.grace_s)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        for stream in (process.stdin, process.stdout):
            if stream is not None and not stream.closed:
                try:
                    stream.close()
                except OSError:
                    pass
        if not self._stderr.closed:
            self._stderr.close()

    def __enter__(self) -> PeerProcess:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def __del__(self) -> None:
        if getattr(self, "_popen", None) is not None and self._popen.poll() is None:
            self._popen.kill()
            self._popen.wait()


def _ready(line: str) -> dict:
    ready = _object(line, "ready line")
    if "error" in ready:
        raise RemotePeerError(f"peer did not start: {ready['error']}")
    if ready.get("ready") is not True:
        raise RemotePeerError(f"peer did not start: unexpected first line {ready}")
    return ready


class RemotePeer(SelfTimedPeer):
    """The client of a peer's process: starts ``command``, waits for its ready line, times calls there.

    ``info`` holds the ready line's other keys; ``process`` is the :class:`PeerProcess`, which
    :meth:`close` (or leaving the ``with`` block) ends. Its errors are :class:`RemotePeerError` quoting
    the end of the process's stderr.
    """

    def __init__(self, command: Sequence[str], *, env: Mapping[str, str] | None = None,
                 start_timeout_s: float = 900.0, call_timeout_s: float = 300.0, grace_s: float = 5.0) -> None:
        self.command = list(command)
        self.call_timeout_s = call_timeout_s
        self.process = PeerProcess(self.command, env=env, grace_s=grace_s)
        ready = self.process.handshake(_ready, start_timeout_s)
        self.info = {key: value for key, value in ready.items() if key != "ready"}

    def time_calls(self, calls: int, warmup: int = 0) -> float:
        return self.process.exchange(request_line(calls, warmup), lambda line: parse_reply(line, calls),
                                     self.call_timeout_s, f"a request for {calls} calls")

    def close(self) -> None:
        """End the process (idempotent)."""
        self.process.close()

    def __enter__(self) -> RemotePeer:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def python_env(extra_path: str | os.PathLike | None) -> dict[str, str]:
    """This process's environment with ``extra_path`` first on ``PYTHONPATH`` (unchanged when ``None``)."""
    env = dict(os.environ)
    if extra_path is not None:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (os.fspath(extra_path), env.get("PYTHONPATH")) if p)
    return env
