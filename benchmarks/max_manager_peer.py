"""Peer benchmark: Modular MAX's paged KV cache manager, driven on the CPU with the workload of ``bench_manager.py``.

Times MAX's ``max.pipelines.kv_cache.PagedKVCacheManager`` (the manager a MAX
text pipeline claims, allocates, steps and releases its requests' pages with,
prefix caching on, MAX's default ``ahash64`` page hashes) so that sparsekv's
manager can be read next to it. MAX is never a dependency of sparsekv: this
script runs only in the separate environment that
``benchmarks/setup_max_peer.sh`` builds (``.venv-max``)::

    .venv-max/bin/python benchmarks/max_manager_peer.py --case prefill_hit --batch 32 --length 2048 --calls 10

The cache is tiny (one layer, one head of width 1, float32, page size 16): a
manager call never touches the blocks, so their size changes only the memory
the run needs. Cases (``length`` is the prompt or cached context in tokens):

* ``decode``: ``batch`` requests hold ``length`` cached tokens; one call is
  ``alloc`` + ``runtime_inputs`` + ``step`` of every request for one new token.
* ``prepare``: ``runtime_inputs`` alone for the ``decode`` case's requests.
* ``prefill_miss`` / ``prefill_hit``: one call is a whole request life for
  ``batch`` prompts of ``length`` tokens: ``claim`` + ``alloc`` +
  ``runtime_inputs`` + ``step`` + ``release``; misses get new prompts every
  call, hits the same prompts every call (all but the last page shared).

The token ids are those of ``sparsekv.bench.manager``. ``TextContext`` objects
are built before the timer starts (a pipeline builds them when a request
arrives), and ``ctx.update(token)`` (the context taking its sampled token, which
``step`` then commits) runs between the two timed halves of a call: ``ms`` is
the manager's time alone, ``context_ms`` the untimed update for reference.

``--serve`` reads one JSON request per line on stdin and answers one JSON line
on stdout per request, so that ``bench_manager.py --max-python`` can time MAX
and sparsekv in alternating rounds of the same run::

    -> {"case": "decode", "batch": 256, "length": 1024, "calls": 1, "capacity": 22}
    <- {"case": "decode", "ms": [3.1], "context_ms": [0.2], "hit_rate": 0.0}
    -> {"case": "info"}
    <- {"case": "info", "max": "26.7.0", "hash": "ahash64", "page_size": 16}

State is kept per ``(case, batch, length)`` (``prepare`` shares ``decode``'s);
``capacity`` (calls the state must hold pages for, decode only) is read when
the state is first built. A request that fails is answered
``{"error": "..."}`` and the loop goes on; end of input ends the process.

MAX 26.7's ``max.pipelines`` package imports its model-loading code on import
(``huggingface_hub``, ``requests``, ...), none of which the manager needs: the
script registers the package without running that ``__init__`` and imports only
the context and KV cache modules, which need ``pydantic``, ``pillow``, ``av``
and ``pyyaml`` next to ``max``.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import itertools
import json
import sys
import time
import types
from dataclasses import dataclass

import numpy as np

PAGE_SIZE = 16
CASES = ("decode", "prepare", "prefill_miss", "prefill_hit")


@dataclass(frozen=True)
class Request:
    """One timing request: ``calls`` timed calls of ``case`` (or ``case == "info"``)."""

    case: str
    batch: int = 0
    length: int = 0
    calls: int = 1
    capacity: int = 64


def parse_request(line: str) -> Request:
    """A :class:`Request` from one JSON line; ``ValueError`` naming the field for anything malformed."""
    try:
        raw = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"request: expected one JSON object per line, got {line.strip()!r:.80} ({exc})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"request: expected a JSON object, got {type(raw).__name__}")
    unknown = set(raw) - {f.name for f in dataclasses.fields(Request)}
    if unknown:
        raise ValueError(f"request: unknown fields {sorted(unknown)}")
    case = raw.get("case")
    if case == "info":
        return Request("info")
    if case not in CASES:
        raise ValueError(f"case: expected one of {CASES + ('info',)}, got {case!r}")
    values = {}
    for name, minimum in (("batch", 1), ("length", 1), ("calls", 1), ("capacity", 1)):
        if name not in raw:
            if name in ("batch", "length"):
                raise ValueError(f"{name}: missing (case {case!r} needs batch and length)")
            continue
        value = raw[name]
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ValueError(f"{name}: expected an int >= {minimum}, got {value!r}")
        values[name] = value
    return Request(case, **values)


def response_line(request: Request, ms: list[float], context_ms: list[float], hit_rate: float) -> str:
    """The JSON answer to a timing request."""
    return json.dumps({"case": request.case, "ms": ms, "context_ms": context_ms, "hit_rate": hit_rate})


def error_line(message: str) -> str:
    return json.dumps({"error": message})


def shared_prompts(batch: int, length: int) -> list[np.ndarray]:
    """The prompts of the prefix-hit case (those of ``sparsekv.bench.manager``)."""
    t = np.arange(length, dtype=np.int64)
    return [(i * 104_729 + t) % 50_000 for i in range(batch)]


def _import_max() -> types.SimpleNamespace:
    """MAX's CPU device, session, cache params and manager, its context types, without ``max.pipelines``'s
    model-loading ``__init__``."""
    try:
        import max as max_pkg
        from max.driver import CPU
        from max.dtype import DType
        from max.engine import InferenceSession
        from max.graph import DeviceRef
        from max.nn.kv_cache import MHAKVCacheParams
    except ImportError as exc:  # pragma: no cover - depends on the environment
        sys.exit(f"max_manager_peer: Modular MAX is not importable here ({exc}); build the separate environment "
                 "with `bash benchmarks/setup_max_peer.sh` and run this script with `.venv-max/bin/python`.")
    if "max.pipelines" not in sys.modules:
        package = types.ModuleType("max.pipelines")
        package.__path__ = [f"{next(iter(max_pkg.__path__))}/pipelines"]
        sys.modules["max.pipelines"] = package
    try:
        from max.pipelines.context import TextContext, TokenBuffer
        from max.pipelines.kv_cache import PagedKVCacheManager
        from max.pipelines.modeling.types import RequestID
    except ImportError as exc:  # pragma: no cover - depends on the environment
        sys.exit(f"max_manager_peer: MAX's KV cache manager is not importable ({exc}); "
                 "`bash benchmarks/setup_max_peer.sh` installs what it needs.")
    return types.SimpleNamespace(CPU=CPU, DType=DType, InferenceSession=InferenceSession, DeviceRef=DeviceRef,
                                 MHAKVCacheParams=MHAKVCacheParams, TextContext=TextContext,
                                 TokenBuffer=TokenBuffer, PagedKVCacheManager=PagedKVCacheManager,
                                 RequestID=RequestID)


class Peer:
    """MAX managers and request contexts for every ``(case, batch, length)`` asked for so far."""

    def __init__(self) -> None:
        self.mx = _import_max()
        self.params = self.mx.MHAKVCacheParams(dtype=self.mx.DType.float32, n_kv_heads=1, head_dim=1, num_layers=1,
                                               page_size=PAGE_SIZE, devices=[self.mx.DeviceRef.CPU()],
                                               enable_prefix_caching=True)
        self.session = self.mx.InferenceSession(devices=[self.mx.CPU()])
        self.states: dict[tuple[str, int, int], dict] = {}
        self.fresh = itertools.count()

    def info(self) -> str:
        return json.dumps({"case": "info", "max": importlib.metadata.version("max"),
                           "hash": self.params.kv_hash_algo, "page_size": PAGE_SIZE})

    def _manager(self, num_pages: int, batch: int):
        return self.mx.PagedKVCacheManager(params=self.params, session=self.session, total_num_pages=num_pages,
                                           max_batch_size=batch)

    def _context(self, tokens: np.ndarray, max_length: int):
        return self.mx.TextContext(request_id=self.mx.RequestID(), max_length=max_length,
                                   tokens=self.mx.TokenBuffer(tokens))

    def _decode_state(self, request: Request) -> dict:
        key = ("decode", request.batch, request.length)
        if key not in self.states:
            batch, context = request.batch, request.length
            total = context + request.capacity + 1
            mgr = self._manager(batch * -(-total // PAGE_SIZE), batch)
            t = np.arange(context, dtype=np.int64)
            ctxs = [self._context((i * 7919 + t) % 50_000, total + 1) for i in range(batch)]
            for ctx in ctxs:  # prefill: the cache holds the context, the next token is pending
                mgr.claim(ctx)
                mgr.alloc(ctx)
            mgr.runtime_inputs([ctxs])
            for i, ctx in enumerate(ctxs):
                ctx.update(i % 50_000)
                mgr.step(ctx)
            self.states[key] = {"mgr": mgr, "ctxs": ctxs, "steps": 0}
        return self.states[key]

    def _decode(self, request: Request) -> tuple[list[float], list[float], float]:
        state = self._decode_state(request)
        mgr, ctxs = state["mgr"], state["ctxs"]
        ms, context_ms = [], []
        for _ in range(request.calls):
            token = state["steps"] % 50_000
            state["steps"] += 1
            t0 = time.perf_counter()
            for ctx in ctxs:
                mgr.alloc(ctx)
            mgr.runtime_inputs([ctxs])
            t1 = time.perf_counter()
            for ctx in ctxs:
                ctx.update(token)
            t2 = time.perf_counter()
            for ctx in ctxs:
                mgr.step(ctx)
            t3 = time.perf_counter()
            ms.append((t1 - t0 + t3 - t2) * 1e3)
            context_ms.append((t2 - t1) * 1e3)
        return ms, context_ms, 0.0

    def _prepare(self, request: Request) -> tuple[list[float], list[float], float]:
        state = self._decode_state(request)
        mgr, ctxs = state["mgr"], state["ctxs"]
        for ctx in ctxs:  # the pending token's page (a no-op once it is there)
            mgr.alloc(ctx)
        ms = []
        for _ in range(request.calls):
            t0 = time.perf_counter()
            mgr.runtime_inputs([ctxs])
            ms.append((time.perf_counter() - t0) * 1e3)
        return ms, [0.0] * len(ms), 0.0

    def _prefill(self, request: Request) -> tuple[list[float], list[float], float]:
        batch, length = request.batch, request.length
        key = (request.case, batch, length)
        if key not in self.states:
            self.states[key] = {"mgr": self._manager(2 * batch * -(-length // PAGE_SIZE), batch),
                                "shared": shared_prompts(batch, length), "prompts": 0, "hits": 0}
        state = self.states[key]
        mgr = state["mgr"]
        t = np.arange(length, dtype=np.int64)
        ms, context_ms = [], []
        for _ in range(request.calls):
            if request.case == "prefill_hit":
                prompts = state["shared"]
            else:
                prompts = [(next(self.fresh) * 31 + t) % 50_000 for _ in range(batch)]
            ctxs = [self._context(prompt.copy(), length + 2) for prompt in prompts]
            t0 = time.perf_counter()
            for ctx in ctxs:
                mgr.claim(ctx)
            for ctx in ctxs:
                mgr.alloc(ctx)
            mgr.runtime_inputs([ctxs])
            t1 = time.perf_counter()
            for ctx in ctxs:
                ctx.update(7)
            t2 = time.perf_counter()
            for ctx in ctxs:
                mgr.step(ctx)
            for ctx in ctxs:
                mgr.release(ctx)
            t3 = time.perf_counter()
            ms.append((t1 - t0 + t3 - t2) * 1e3)
            context_ms.append((t2 - t1) * 1e3)
            state["prompts"] += batch * length
            state["hits"] += sum(ctx.cached_prefix_length for ctx in ctxs)
        return ms, context_ms, state["hits"] / state["prompts"]

    def answer(self, request: Request) -> str:
        if request.case == "info":
            return self.info()
        run = {"decode": self._decode, "prepare": self._prepare,
               "prefill_miss": self._prefill, "prefill_hit": self._prefill}[request.case]
        return response_line(request, *run(request))


def serve(peer: Peer, lines, out) -> None:
    """Answer every request line of ``lines`` on ``out`` (one JSON line each, flushed)."""
    for line in lines:
        if not line.strip():
            continue
        try:
            answer = peer.answer(parse_request(line))
        except Exception as exc:  # noqa: BLE001 - reported to the client, which decides
            answer = error_line(f"{type(exc).__name__}: {exc}")
        out.write(answer + "\n")
        out.flush()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--serve", action="store_true", help="answer JSON requests on stdin, one per line")
    parser.add_argument("--case", choices=CASES, default="prefill_hit")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--length", type=int, default=2048, help="prompt (prefill) or context (decode) tokens")
    parser.add_argument("--calls", type=int, default=10, help="timed calls, after two untimed ones")
    args = parser.parse_args(argv)
    peer = Peer()
    if args.serve:
        print(peer.info(), flush=True)  # ready: MAX is imported
        serve(peer, sys.stdin, sys.stdout)
        return 0
    warmup = Request(args.case, args.batch, args.length, calls=2, capacity=args.calls + 2)
    peer.answer(warmup)
    print(peer.answer(dataclasses.replace(warmup, calls=args.calls)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
