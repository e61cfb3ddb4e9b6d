"""Per-call latency of one layer request: in-process vs the ZeroMQ transports (ipc, tcp, shm+ipc).

What a decode step feels: ~85 round trips per token, each a 1-row (or a few-row) request, so the
fixed cost per call, not bandwidth, sets the speed. This script times exactly that: a real
``BaseExecutor`` (policy ``immediate``, so no batching wait is added) with two random layers,
``h64`` (64 x 64) and ``h4096`` (4096 x 4096), serves ``ipc://`` and ``tcp://`` from a **child
process**; a client child process calls ``forward`` on 1 and 16 rows over ``inproc`` (its own
in-process ``BaseExecutor`` on the same weights: the floor), ``ipc``, ``tcp`` and ``shm+ipc``.

The measured client is its executor's only one: the client child keeps one remote transport open
at a time (closing it before opening another). Beside other clients a request is queued through
the scheduler whenever the rule in force would hold it for one of them (``Scheduler.serves_at_once``;
``immediate`` holds for no one, so it is served at once all the same, as long as nothing is
pending). Cases of their own measure both, none in the default list (ask with ``--transports``):
``ipc+joined`` and ``shm+ipc+joined`` open a second transport to the same executor and make one
call on it before every block (so it is active: it sent within the last second) while the first
one is timed; ``ipc+idle`` and ``shm+ipc+idle`` make that call once and wait until the second
client is idle (quiet for over a second: tenants between bursts). ``ipc+queued`` (and
``shm+ipc+queued``, ``tcp+queued``) are ``+joined`` on a second executor in the server child,
lockstep with a timeout of 0: a rule that holds every request for the other client, but never
waits, so each call pays the queued path (add, plan, fill, a result sink) and nothing else -- what
every request of a convoy or of a client beside a flood pays on top of its wait. ``inproc+queued``
is that rule on an in-process executor (two ``InProcTransport`` clients in the client child): the
executor's own share of the queued path, with no transport, against ``inproc``'s lone-client path.

Back-to-back calls keep both sides awake, which a real client does not: between its base-layer
calls a decode step computes attention and norms (a few hundred µs at hidden 512), long enough
for a peer waiting asleep to pay its wake-up (~50 µs on this project's VM; ``transport/spin.py``).
``--gap-us N`` makes the client busy for N µs before each timed call to measure that case.

A/B in one run: ``--baseline DIR`` names a folder holding another copy of the ``symbiosis``
package (e.g. the code before a change, copied with ``cp -r symbiosis DIR/``). Each variant gets
its own server and client processes, importing ``symbiosis`` from its own folder; the parent
alternates between the variants block by block (rotating which goes first), so both see the same
background load. Every block starts with a few untimed warm-up calls.

JSON on stdout (and ``roundtrip.json`` in the ``--output`` folder when given): ``config``, ``machine`` and
``results[case]`` with
``case = "<transport>/h<hidden>/r<rows>"`` and per variant ``median_us, p90_us, mean_us, n``, plus
``ratio_median`` (current / baseline) when a baseline ran.

Run: ``python -m benchmarks.roundtrip [--baseline /tmp/orig] [--calls 2000] [--blocks 10] [--output DIR]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.results import machine_info, result_file, write_json
from benchmarks.timing import percentile

NAME = "roundtrip"
REPO = Path(__file__).resolve().parent.parent
TRANSPORTS = ("inproc", "ipc", "tcp", "shm+ipc")
JOINED = "+joined"  # a transport name with this suffix: another client is joined, active (module doc)
IDLE = "+idle"  # ... another client is joined and idle (module doc)
QUEUED = "+queued"  # ... joined and active, on an executor whose rule queues every call (module doc)
PEER_SUFFIXES = (JOINED, IDLE, QUEUED)
IDLE_AFTER_S = 1.2  # quiet this long, a client is idle (``scheduler.ACTIVE_CLIENT_S``, with a margin)
HIDDENS = (64, 4096)
ROWS = (1, 16)
MARK = "@@ "  # protocol lines between parent and children; anything else on stdout is ignored


# ---- children -----------------------------------------------------------------------------------


def _make_executor(seed: int, queued: bool = False):
    import torch

    from symbiosis.executor.executor import BaseExecutor
    from symbiosis.executor.scheduler import SchedulerConfig
    from symbiosis.executor.weights import BaseModelWeights, LayerWeights

    LayerSpec, _, _ = _vocabulary()

    generator = torch.Generator().manual_seed(seed)
    specs = {f"h{h}": LayerSpec(f"h{h}", h, h, has_bias=False) for h in HIDDENS}
    layers = {
        name: LayerWeights(torch.randn(s.out_features, s.in_features, generator=generator) / s.in_features**0.5, None)
        for name, s in specs.items()
    }
    weights = BaseModelWeights(specs, layers, f"roundtrip-bench-{seed}", "bench")
    if queued:  # holds every request for the other joined clients, for 0 s: the queued path, no wait
        return BaseExecutor(weights, SchedulerConfig(policy="lockstep", lockstep_timeout_ms=0.0))
    return BaseExecutor(weights, SchedulerConfig(policy="immediate"))


def _vocabulary():
    """(LayerSpec, LatencyClass, Op) from this package or a baseline copy that predates vocabulary.py."""
    try:
        from symbiosis.vocabulary import LatencyClass, LayerSpec, Op
    except ImportError:
        from symbiosis.executor.requests import LatencyClass, LayerSpec, Op
    return LayerSpec, LatencyClass, Op


def _serve(folder: str) -> None:
    executor, queued = _make_executor(0), _make_executor(0, queued=True)
    servers = [executor.serve(f"ipc://{folder}/executor.sock"), executor.serve("tcp://127.0.0.1:0")]
    servers += [queued.serve(f"ipc://{folder}/queued.sock"), queued.serve("tcp://127.0.0.1:0")]
    print(MARK + json.dumps({"addresses": [s.address for s in servers]}), flush=True)
    sys.stdin.read()  # until the parent closes our stdin
    executor.close(drain=False)
    queued.close(drain=False)


def _client(addresses: list[str]) -> None:
    import torch

    from symbiosis.transport.inproc import InProcTransport

    try:
        from symbiosis.transport.schemes import open_transport
    except ImportError:  # a baseline from before the scheme table
        from symbiosis.transport.zmq import connect as open_transport
    _, LatencyClass, Op = _vocabulary()

    ipc, tcp, queued_ipc, queued_tcp = addresses
    remote = {"ipc": ipc, "tcp": tcp, "shm+ipc": "shm+" + ipc}
    queued = {"ipc": queued_ipc, "tcp": queued_tcp, "shm+ipc": "shm+" + queued_ipc}
    inproc = InProcTransport(_make_executor(0))
    # ``inproc+queued``: the queued path of the executor itself, without a transport (the caller's
    # thread queues its request and runs the batch; see the module doc).
    queued_executor = _make_executor(0, queued=True)
    inproc_queued = [InProcTransport(queued_executor), InProcTransport(queued_executor)]
    opened: dict[str, list[Any]] = {}  # one case's remote transports at a time: see the module doc
    print(MARK + json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        command = json.loads(line)
        name = command["transport"]
        rows = torch.randn(command["rows"], command["hidden"])
        layer = f"h{command['hidden']}"
        if name == "inproc":
            transport = inproc
        elif name == "inproc" + QUEUED:
            transport, peer = inproc_queued
            peer.call(layer, Op.FORWARD, rows, LatencyClass.DECODE)  # active: it sent just now
        else:
            for other in [n for n in opened if n != name]:
                for stale in opened.pop(other):
                    stale.close()  # its Goodbye ends its session: the next one is alone again
            suffix = next((s for s in PEER_SUFFIXES if name.endswith(s)), "")
            fresh = name not in opened
            if fresh:
                address = (queued if suffix == QUEUED else remote)[name.removesuffix(suffix)]
                opened[name] = [open_transport(address) for _ in range(2 if suffix else 1)]
            transport, *peers = opened[name]
            for peer in peers:
                if suffix != IDLE or fresh:  # active: it sent just now; idle: once, then quiet
                    peer.call(layer, Op.FORWARD, rows, LatencyClass.DECODE)
            if peers and suffix == IDLE and fresh:
                time.sleep(IDLE_AFTER_S)
        for _ in range(command["warmup"]):
            transport.call(layer, Op.FORWARD, rows, LatencyClass.DECODE)
        samples = []
        gap_ns = int(command.get("gap_us", 0) * 1e3)
        for _ in range(command["calls"]):
            if gap_ns:  # the client's own work between calls (a busy loop, as compute is)
                until = time.perf_counter_ns() + gap_ns
                while time.perf_counter_ns() < until:
                    pass
            start = time.perf_counter_ns()
            transport.call(layer, Op.FORWARD, rows, LatencyClass.DECODE)
            samples.append(time.perf_counter_ns() - start)
        print(MARK + json.dumps({"samples_ns": samples}), flush=True)
    for transports in opened.values():
        for transport in transports:
            transport.close()
    for transport in (inproc, *inproc_queued):
        transport.close()
    inproc.service.close()
    queued_executor.close()


def child_main() -> None:
    role, threads, arg = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    import torch

    torch.set_num_threads(threads)
    import symbiosis

    print(f"[{role}] symbiosis from {symbiosis.__file__}", file=sys.stderr, flush=True)
    if role == "server":
        _serve(arg)
    else:
        _client(json.loads(arg))


# ---- parent -------------------------------------------------------------------------------------


class _Child:
    """A server or client child importing ``symbiosis`` from ``package_root``, JSON lines after ``MARK``.

    Not ``ExecutorProcess`` (``symbiosis/executor/process.py``), the one way the project starts an
    executor process, nor ``benchmarks.workers.Worker``, on purpose: the server is a ``BaseExecutor``
    over two synthetic layers (no checkpoint for ``symbiosis serve`` to load), and with
    ``--baseline`` both children must import an older copy of the package, which may predate
    ``serve --ready-file``; so the child is started from ``/`` with that copy first on ``sys.path``
    (``python -m`` from here would import this checkout's ``symbiosis`` first).
    """

    def __init__(self, package_root: Path, role: str, threads: int, arg: str) -> None:
        bootstrap = (
            f"import sys; sys.path[:0] = [{str(package_root)!r}, {str(REPO)!r}]; "
            "from benchmarks.roundtrip import child_main; child_main()"
        )
        env = dict(os.environ, PYTHONPATH="")
        self.proc = subprocess.Popen(
            [sys.executable, "-c", bootstrap, role, str(threads), arg],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
            cwd="/",
        )

    def read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(MARK):
                return json.loads(line[len(MARK) :])
        raise RuntimeError(f"child exited with {self.proc.wait()}")

    def ask(self, command: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()
        return self.read()

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--baseline",
        type=Path,
        default=None,
        help="Folder holding a baseline copy of the symbiosis package (A/B in one run).",
    )
    parser.add_argument(
        "--calls",
        type=int,
        default=2000,
        help="Timed calls per case and variant, over all blocks (default: %(default)s).",
    )
    parser.add_argument(
        "--blocks",
        type=int,
        default=10,
        help="Blocks per case; variants alternate block by block (default: %(default)s).",
    )
    parser.add_argument(
        "--warmup", type=int, default=20, help="Untimed calls before every block (default: %(default)s)."
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads in every child (default: %(default)s).")
    parser.add_argument(
        "--gap-us",
        type=float,
        default=0.0,
        help="The client works this long between calls (default: %(default)s, back to back), as a decode step "
        "does between its base-layer calls: long enough, a peer that sleeps while it waits pays its wake-up.",
    )
    parser.add_argument(
        "--transports",
        default=",".join(TRANSPORTS),
        help=f"Comma-separated subset of %(default)s, and of those but inproc with {JOINED!r} (another client "
        f"joined and active), {IDLE!r} (another client joined and idle) or {QUEUED!r} (another client joined "
        f"and active, on an executor that queues every call; also inproc{QUEUED}: the executor's own queued path).",
    )
    parser.add_argument("--hiddens", default=",".join(map(str, HIDDENS)), help="Comma-separated subset of %(default)s.")
    parser.add_argument("--output", type=Path, default=None, help=f"Also write the JSON to {NAME}.json in this folder.")
    args = parser.parse_args(argv)

    variants = {"current": REPO}
    if args.baseline is not None:
        if not (args.baseline / "symbiosis" / "__init__.py").exists():
            raise SystemExit(f"{args.baseline} holds no symbiosis package")
        variants["baseline"] = args.baseline.resolve()
    transports = args.transports.split(",")
    known = {
        *TRANSPORTS,
        "inproc" + QUEUED,
        *(t + suffix for t in TRANSPORTS if t != "inproc" for suffix in PEER_SUFFIXES),
    }
    if unknown := [t for t in transports if t not in known]:
        parser.error(f"unknown transports {unknown}; choose from {sorted(known)}")
    cases = [(t, int(h), r) for t in transports for h in args.hiddens.split(",") for r in ROWS]
    per_block = max(1, args.calls // args.blocks)
    started = time.monotonic()
    children: list[_Child] = []
    samples: dict[str, dict[str, list[int]]] = {f"{t}/h{h}/r{r}": {v: [] for v in variants} for t, h, r in cases}
    with tempfile.TemporaryDirectory(prefix="symb-rt-") as tmp:
        try:
            clients: dict[str, _Child] = {}
            for name, root in variants.items():
                folder = Path(tmp) / name
                folder.mkdir()
                server = _Child(root, "server", args.threads, str(folder))
                children.append(server)
                addresses = server.read()["addresses"]
                clients[name] = _Child(root, "client", args.threads, json.dumps(addresses))
                children.append(clients[name])
                clients[name].read()
            order = list(variants)
            for block in range(args.blocks):
                for transport, hidden, rows in cases:
                    rotated = order[block % len(order) :] + order[: block % len(order)]
                    for name in rotated:
                        command = {
                            "transport": transport,
                            "hidden": hidden,
                            "rows": rows,
                            "calls": per_block,
                            "warmup": args.warmup,
                            "gap_us": args.gap_us,
                        }
                        samples[f"{transport}/h{hidden}/r{rows}"][name] += clients[name].ask(command)["samples_ns"]
        finally:
            for child in reversed(children):
                child.close()

    results: dict[str, Any] = {}
    for case, by_variant in samples.items():
        entry: dict[str, Any] = {}
        for name, values in by_variant.items():
            us = [v / 1e3 for v in values]
            entry[name] = {
                "median_us": round(statistics.median(us), 1),
                "p90_us": round(percentile(us, 90), 1),
                "mean_us": round(statistics.fmean(us), 1),
                "n": len(us),
            }
        if "baseline" in entry:
            entry["ratio_median"] = round(entry["current"]["median_us"] / entry["baseline"]["median_us"], 3)
            entry["ratio_p90"] = round(entry["current"]["p90_us"] / entry["baseline"]["p90_us"], 3)
        results[case] = entry
    report = {
        "benchmark": NAME,
        "command": " ".join(
            [Path(sys.executable).name, "-m", "benchmarks.roundtrip", *(argv if argv is not None else sys.argv[1:])]
        ),
        "config": {
            **{k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "variants": {k: str(v) for k, v in variants.items()},
            "policy": "immediate; +queued: lockstep, lockstep_timeout_ms=0",
        },
        "machine": machine_info(),
        "results": results,
        "wall_s": round(time.monotonic() - started, 1),
    }
    print(json.dumps(report, indent=2))
    if args.output is not None:
        write_json(result_file(args.output, NAME), report)
    return report


if __name__ == "__main__":
    main()
