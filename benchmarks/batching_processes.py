"""``benchmarks.batching --clients-as processes``: the executor and every client in its own process.

In thread mode every client and the executor share one interpreter, so the GIL serializes their
Python and a policy's waits are stretched by GIL hand-offs (``sys.getswitchinterval()``, 5 ms). Here
each client is a process with its own interpreter (one torch thread each), talking to an executor
process over ``ipc://`` (``shm+ipc://`` with ``--scheme shm+ipc``: large payloads in shared
memory; or ``tcp://`` loopback with ``--scheme tcp``, the nearest this one host
comes to remote clients) through the ZeroMQ transport, as ``symbiosis serve`` clients do, with
``OMP_WAIT_POLICY=PASSIVE`` as ``serve`` sets it (unless the environment sets another).

Every run gets a fresh executor: ``symbiosis serve`` with the run's ``SchedulerConfig`` as flags
(``serve_flags``), started with ``ExecutorProcess`` (the one way an executor process is started),
its scheduler counters read from its ``/stats`` endpoint at the window's start and end. Client
processes are started once (spawn) and reused, in two pools: fine-tuning clients run in processes
at the OS's background CPU class (``--finetune-cpu-priority background``, the default: what
``symbiosis finetune --executor`` gives a job on an executor's host), every other client at normal
priority. Each each builds a fresh client model and adapter per
run, warms up, reports ready, and then runs from a common start time (``time.perf_counter`` is
CLOCK_MONOTONIC, shared by processes on Linux) until the window's end, counting the steps that
finish inside the window. It returns the same per-run summary as thread mode
(``batching_clients.summarize_run``).
"""

from __future__ import annotations

import argparse
import dataclasses
import multiprocessing as mp
import os
import time
from collections.abc import Sequence
from pathlib import Path

from benchmarks.batching_clients import ClientRecord, ClientSpec, counters_from_stats, remote_counters, summarize_run
from benchmarks.window_profile import WindowProfile
from symbiosis.executor.process import ExecutorProcess
from symbiosis.executor.scheduler import SchedulerConfig
from symbiosis.threads import SHARED_HOST_POLICY, WAIT_POLICY_VARIABLE, enter_background_priority

# Clients start this long after the last one reported ready, so all of them see the same start.
_START_DELAY_S = 0.2
_REPLY_TIMEOUT_S = 300.0


def serve_flags(config: SchedulerConfig) -> list[str]:
    """The ``symbiosis serve`` flags that make ``config`` (every field that differs from its default;
    ``serve`` has one option per ``SchedulerConfig`` field, see ``symbiosis/cli_scheduler.py``)."""
    flags: list[str] = []
    for field in dataclasses.fields(SchedulerConfig):
        value = getattr(config, field.name)
        if value == field.default:
            continue
        option = "--" + field.name.replace("_", "-")
        if isinstance(value, bool):
            flags.append(option if value else "--no-" + option.removeprefix("--"))
        elif value is None:
            raise ValueError(f"{field.name}=None (default {field.default!r}) has no serve flag")
        else:
            flags += [option, str(value)]
    return flags


def executor_flags(config: SchedulerConfig, device: str) -> list[str]:
    """All the ``symbiosis serve`` flags of a run's executor process: ``config``'s and its device."""
    return [*serve_flags(config), "--device", device]


def _client_main(conn, path: str, background: bool) -> None:
    if background:
        enter_background_priority()  # before torch starts its threads, which inherit it
    import torch

    from benchmarks import batching_clients as clients
    from benchmarks.options import quiet_libraries
    from symbiosis.heap import skip_exit_collection

    torch.set_num_threads(1)  # one core's worth per client; the executor process takes its own
    quiet_libraries()
    while True:
        command, payload = conn.recv()
        if command == "exit":
            skip_exit_collection()  # ~1 s of every client's exit otherwise (symbiosis/heap.py)
            return
        spec, address, seed, prompt_len, segment_tokens, warmup_s = payload
        try:
            client, close = clients.make_client(path, address, spec, seed, prompt_len, segment_tokens)
            clients.warm_up(client, spec, warmup_s)
            conn.send(("ready", None))
            _, (start_s, end_s) = conn.recv()
            time.sleep(max(0.0, start_s - time.perf_counter()))
            record = clients.ClientRecord(spec)
            clients.run_measured(client, record, end_s, lambda end_s=end_s: time.perf_counter() > end_s)
            close()  # unregister at once, so that lockstep stops waiting
            del client
            conn.send(("done", (record.step_s, record.tokens)))
        except Exception as exc:  # reported by the parent
            conn.send(("error", repr(exc)))


def runs_in_background(spec: ClientSpec, args: argparse.Namespace) -> bool:
    """Whether ``spec``'s client process runs at the background CPU class."""
    return spec.kind == "finetune" and args.finetune_cpu_priority == "background"


class ProcessPool:
    """Client processes enough for every scenario in ``scenario_specs`` (normal and background
    ones, see ``runs_in_background``), and per run a fresh executor process (unless
    ``--executor`` names a running one)."""

    def __init__(self, path: Path, scenario_specs: Sequence[Sequence[ClientSpec]], args: argparse.Namespace):
        self.args = args
        self.path = str(path)
        # As `symbiosis serve` does for itself and the README asks of same-host clients (see
        # symbiosis/threads.py): idle OpenMP workers sleep, so whichever process has work gets the cores.
        os.environ.setdefault(WAIT_POLICY_VARIABLE, SHARED_HOST_POLICY)
        context = mp.get_context("spawn")
        self._runs = 0
        self._pools: dict[bool, list] = {False: [], True: []}  # background? -> (process, conn)
        for background, pool in self._pools.items():
            needed = max(sum(runs_in_background(s, args) == background for s in specs) for specs in scenario_specs)
            for _ in range(needed):
                parent, child = context.Pipe()
                process = context.Process(target=_client_main, args=(child, self.path, background), daemon=True)
                process.start()
                pool.append((process, parent))

    def _processes_for(self, specs: Sequence[ClientSpec]) -> list:
        """One pooled process per spec, of the spec's priority, in the specs' order."""
        free = {background: iter(pool) for background, pool in self._pools.items()}
        return [next(free[runs_in_background(spec, self.args)]) for spec in specs]

    @staticmethod
    def _reply(process, conn, what: str):
        if not conn.poll(_REPLY_TIMEOUT_S):
            raise RuntimeError(f"{what} (pid {process.pid}) did not answer within {_REPLY_TIMEOUT_S:.0f} s")
        status, payload = conn.recv()
        if status == "error":
            raise RuntimeError(f"{what} failed: {payload}")
        return payload

    def run_once(self, config: SchedulerConfig | None, specs: Sequence, seed: int, label: str = "") -> dict:
        """One measured window of ``specs``; ``config`` None means the running executor at ``--executor``.
        With ``--profile``, every process of the run is sampled over the window (``window_profile``),
        into files named after ``label``."""
        self._runs += 1
        executor = None
        if config is not None:
            if self.args.scheme == "tcp":
                bind = "tcp://127.0.0.1:0"
            else:
                bind = f"ipc:///tmp/symbiosis-batching-{os.getpid()}-{self._runs}.sock"
            executor = ExecutorProcess(
                self.path,
                [bind],
                extra_args=executor_flags(config, self.args.executor_device),
                threads=self.args.threads,
                metrics=True,
            )
            address = executor.address  # a tcp port 0 resolved
            if self.args.scheme == "shm+ipc":
                address = f"shm+{address}"  # the same ipc:// bind, payloads in shared memory
        else:
            address = self.args.executor

        def counters() -> dict:
            if executor is None:
                return remote_counters()
            return counters_from_stats(executor.stats()["scheduler"])

        # Where its products run, as the executor itself reports it (its device, the bulk lane
        # "auto" became there), not as asked: a run's JSON says what was measured.
        served_by = None
        if executor is not None:
            stats = executor.stats()
            served_by = {"device": stats["device"], "bulk_lane": stats["config"]["bulk_lane"]}
        used = self._processes_for(specs)
        try:
            for index, ((_, conn), spec) in enumerate(zip(used, specs)):
                conn.send(
                    (
                        "run",
                        (
                            spec,
                            address,
                            seed + index,
                            self.args.prompt_len,
                            self.args.segment_tokens,
                            self.args.warmup_s,
                        ),
                    )
                )
            for index, (process, conn) in enumerate(used):
                self._reply(process, conn, f"client process {index}")
            window = {}
            start_s = time.perf_counter() + _START_DELAY_S
            end_s = start_s + self.args.window_s
            for _, conn in used:
                conn.send(("go", (start_s, end_s)))
            time.sleep(max(0.0, start_s - time.perf_counter()))
            window["start"] = counters()
            profile = None
            if self.args.profile is not None:
                pids = {f"client{i}-{spec.kind}": used[i][0].pid for i, spec in enumerate(specs)}
                if executor is not None:
                    pids = {"executor": executor.process.pid, **pids}
                seconds = end_s - time.perf_counter()
                profile = WindowProfile.start(self.args.profile, label or f"run{self._runs}", pids, seconds)
            time.sleep(max(0.0, end_s - time.perf_counter()))
            window["end"] = counters()
            if profile is not None:
                profile.wait()
            records = []
            for index, ((process, conn), spec) in enumerate(zip(used, specs)):
                step_s, tokens = self._reply(process, conn, f"client process {index}")
                records.append(ClientRecord(spec, step_s=step_s, tokens=tokens))
        finally:
            if executor is not None:
                executor.close()
                if executor.address.startswith("ipc://"):
                    Path(executor.address.removeprefix("ipc://")).unlink(missing_ok=True)
        result = summarize_run(records, window, self.args.window_s, config is not None)
        result["executor"] = served_by
        return result

    def close(self) -> None:
        every = [client for pool in self._pools.values() for client in pool]
        for _, conn in every:
            try:
                conn.send(("exit", None))
            except (BrokenPipeError, OSError):
                pass
        for process, _ in every:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
                process.join()
