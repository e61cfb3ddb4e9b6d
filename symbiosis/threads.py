"""Thread settings for processes that share a host's cores with an executor in another process.

The problem. torch's CPU kernels run on OpenMP (libgomp). By default an OpenMP worker that
finishes its share of a parallel region *spins* for a while (up to ~300,000 iterations) waiting
for the next region, instead of sleeping. In one process that is what makes back-to-back ops
fast. But a split client and its executor alternate: while the executor multiplies, the client
waits, and vice versa. With both processes spinning, each one's idle workers burn the cores the
other one needs at that moment, on a host with few cores (this one has two) the product runs on
fewer cores than it could.

The setting. Every process the command line starts for a split deployment on one host —
``symbiosis serve``, the jobs and the API server connecting to an executor address
(``finetune``/``generate``/``api --executor``), the API server sharing its embedded executor
(``api --executor-bind``) and ``demo`` (whose executor runs in its own
process) — gets
``OMP_WAIT_POLICY=PASSIVE``: idle workers sleep at once, so whichever process has work gets
the cores. torch's intra-op thread count is left at its default (one per core) in each process:
the two sides rarely compute at the same time, so each can use every core when it does -- except
a client's small forward passes (decode steps), which run on one thread (``one_thread_for_small_forwards``
below: too small to pay for waking a second worker).
In-process clients (``--embedded``, ``executor=BaseExecutor``) keep libgomp's default: the
engine runs products in the callers' own threads (``executor/engine.py``), so one process has
one OpenMP team and nothing to fight over.

An explicit ``OMP_WAIT_POLICY`` in the environment always wins. The setting must be made before
torch is imported (libgomp reads it once), which is why ``symbiosis/__init__.py`` imports lazily
and ``cli.main`` calls ``configure_for_command`` first. Library users who split across processes
set it themselves (``OMP_WAIT_POLICY=PASSIVE python my_client.py``); the README says so.

Measured (2026-11-23, this 2-core machine): a split llama (hidden 512, 6 layers) decoding 16
sequences over ipc from a ``symbiosis serve`` process made 399 and 372 tokens/s with PASSIVE in
both processes, 59 and 63 with libgomp's default (two runs each, alternated). The benchmarks
(``benchmarks/split_overhead.py``, the suite's client processes) run clients of a separate
executor with this setting; an ``OMP_WAIT_POLICY`` in their environment overrides it (an empty
value gives libgomp's default), which is how to compare the two.

Measured again once calls took lanes (issue 15; h512 llama, decode steps of 1 and 16 sequences,
one client process and one ``serve`` process, this 2-core machine under other jobs' load, our
processes' autogroup at nice -19): a spin before sleeping (``GOMP_SPINCOUNT`` 3,000-50,000,
~0.1-2 ms here) in the executor, the client or both never beat PASSIVE beyond the noise (±10%);
one intra-op thread in the executor or the client was within the noise for one sequence, and for
16 sequences one thread on *both* sides did best (decode x1.8-1.9 of monolithic against x2.2-2.3
with two each: waking a sleeping worker costs more here than half of a 16-row product saves).
Products alone (no other process computing) still gain from the second thread from 16 x 512 x
4096 up (x0.86 of one thread, x0.53 at 1024 rows), and training steps need it, so torch's default
stays; a client that only decodes small batches on a small host may set
``torch.set_num_threads(1)`` itself.
"""

from __future__ import annotations

import enum
import functools
import os
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar

T = TypeVar("T")

WAIT_POLICY_VARIABLE = "OMP_WAIT_POLICY"
SHARED_HOST_POLICY = "PASSIVE"

# ---- a short spin in clients ----------------------------------------------------------------------
#
# The problem. Under PASSIVE an idle OpenMP worker sleeps at once, so every parallel region of a
# client's own ops (a training step's attention, norms, adapters, their backward: ~1,500 regions
# a step at hidden 512) first wakes a sleeping worker, whose core may have halted: in-process
# (libgomp's default, workers spin) the client's ops of one h512 training step took ~160 ms,
# across processes ~220. The executor's products, between those ops, last milliseconds.
#
# The setting. A client of an executor in another process (``finetune``/``generate``/``api`` with
# ``--executor``; the benchmarks' client processes) lets its idle workers spin for
# ``CLIENT_SPIN_COUNT`` iterations (libgomp's ``GOMP_SPINCOUNT``, ~0.1-0.5 ms by the CPU) before
# sleeping: long enough to bridge the microseconds between its own ops, short against a call to
# the executor, so they sleep while it computes. The executor keeps sleeping at once (its
# workers' idle time is the clients' compute time). An explicit ``GOMP_SPINCOUNT`` wins.
#
# Measured (2026-11-29, this 2-core host, one ``serve`` process of the hidden-512 llama, 2
# threads, a client process of 2 threads over shm+ipc, training steps of 8 x 128 tokens, runs
# alternated): 714-776 ms a step with 10,000 spins against 753-787 PASSIVE (6 pairs: 5 faster by
# 3-7%, one 2% slower); 3,000 spins about half that; 30,000 slower (+2-5%: the spinning worker
# takes a core from the executor's products). Decode steps (1 and 16 sequences, small forwards on
# one thread, ``one_thread_for_small_forwards``) were the same within the noise (3 pairs). Both
# sides spinning (earlier, decode and training) never beat PASSIVE beyond the noise. In
# ``benchmarks.split_overhead`` (the same model and threads, the client setting alone switched;
# two runs each, alternated, each timing two copies of the model): training step over shm+ipc
# x1.04-1.09 of monolithic with the spin, x1.13-1.14 without; over ipc x1.12-1.22 either way;
# 16-sequence decode within the noise.

SPIN_COUNT_VARIABLE = "GOMP_SPINCOUNT"
CLIENT_SPIN_COUNT = "10000"


def client_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """OpenMP variables for a client process of an executor in another process on this host:
    ``OMP_WAIT_POLICY=PASSIVE`` and, with it, ``GOMP_SPINCOUNT=CLIENT_SPIN_COUNT`` (see above);
    values already in ``environ`` (default: this process's) win."""
    environ = os.environ if environ is None else environ
    env = {WAIT_POLICY_VARIABLE: environ.get(WAIT_POLICY_VARIABLE, SHARED_HOST_POLICY)}
    if SPIN_COUNT_VARIABLE in environ:
        env[SPIN_COUNT_VARIABLE] = environ[SPIN_COUNT_VARIABLE]
    elif env[WAIT_POLICY_VARIABLE] == SHARED_HOST_POLICY:
        env[SPIN_COUNT_VARIABLE] = CLIENT_SPIN_COUNT
    return env


def _verb(argv: Sequence[str]) -> str | None:
    """The command's verb: its first word that is not an option."""
    return next((arg for arg in argv if not arg.startswith("-")), None)


def _has_option(argv: Sequence[str], name: str) -> bool:
    """Whether ``argv`` gives option ``name`` (``--name VALUE`` or ``--name=VALUE``)."""
    return any(arg == name or arg.startswith(name + "=") for arg in argv)


def is_client_of_another_process(argv: Sequence[str]) -> bool:
    """Whether the command in ``argv`` is a client of an executor in another process: the jobs
    and ``api`` given ``--executor ADDRESS``."""
    return _verb(argv) in ("finetune", "generate", "api") and _has_option(argv, "--executor")


def shares_host_with_executor(argv: Sequence[str]) -> bool:
    """Whether the command in ``argv`` (without the program name) runs next to an executor in
    another process, or serves one to other processes: ``serve``, ``demo``, the jobs and ``api``
    given ``--executor ADDRESS``, and ``api --embedded --executor-bind ADDRESS``."""
    verb = _verb(argv)
    # api --embedded --executor-bind ADDRESS serves clients in other processes too.
    return (
        verb in ("serve", "demo")
        or is_client_of_another_process(argv)
        or (verb in ("finetune", "generate", "api") and _has_option(argv, "--executor-bind"))
    )


def configure_for_command(argv: Sequence[str]) -> str | None:
    """Set the OpenMP wait policy for the command in ``argv`` unless the user set one (for a client
    of an executor in another process, with a short spin: ``client_env``), and the CPU priority its
    ``--cpu-priority`` asks for (see ``cpu_priority_for_command``); returns the
    wait policy now in force for it (None: libgomp's default)."""
    if is_client_of_another_process(argv):
        os.environ.update(client_env())
    elif shares_host_with_executor(argv):
        os.environ.setdefault(WAIT_POLICY_VARIABLE, SHARED_HOST_POLICY)
    if cpu_priority_for_command(argv) == CpuPriority.BACKGROUND:
        enter_background_priority()
    return os.environ.get(WAIT_POLICY_VARIABLE)


# ---- CPU priority of fine-tuning jobs -------------------------------------------------------------
#
# Fine-tuning is throughput work; serving is latency work. When a fine-tuning client runs on the
# host of an executor that also serves inference, its own share of every step (attention,
# norms, the adapters' backward) competes for the cores the executor and the serving client need
# at that moment. Linux's SCHED_IDLE class gives those cores to any normal thread the moment it
# wakes, and leaves the job every cycle nobody else wants; ``nice 19`` is the weaker fallback
# where SCHED_IDLE is missing. Measured (2026-11-25, this 2-core machine, one torch thread per
# process, ``benchmarks/serving.py``'s co-serving phase: Poisson requests to ``symbiosis api``
# over shm beside 2 LoRA jobs of 4 x 64 tokens, the same code, runs interleaved): p95 inter-token
# latency x3.3-4.0 of serving alone with the jobs at normal priority (4 runs), x2.9-3.4 with them
# at SCHED_IDLE (2 runs), the jobs keeping 61-66% of their solo rate instead of 71-82%.
# What is left is the executor's own time: without ``--decode-slo-ms`` fine-tuning clients are
# owed their fair share of its products.

CPU_PRIORITY_OPTION = "--cpu-priority"


class CpuPriority(enum.StrEnum):
    """``finetune --cpu-priority``: what it accepts and what ``cpu_priority_for_command`` returns."""

    AUTO = "auto"
    BACKGROUND = "background"
    NORMAL = "normal"


def cpu_priority_for_command(argv: Sequence[str]) -> CpuPriority:
    """``background`` or ``normal`` for the command in ``argv``: for ``finetune``, what its
    ``--cpu-priority`` says, and for ``auto`` (the default) background when it reaches an executor
    in another process (``--executor``); normal for every other command."""
    if _verb(argv) != "finetune":  # the only command with the option
        return CpuPriority.NORMAL
    asked = CpuPriority.AUTO
    for index, arg in enumerate(argv):
        if arg == CPU_PRIORITY_OPTION and index + 1 < len(argv):
            asked = argv[index + 1]
        elif arg.startswith(CPU_PRIORITY_OPTION + "="):
            asked = arg.split("=", 1)[1]
    if asked in (CpuPriority.BACKGROUND, CpuPriority.NORMAL):
        return CpuPriority(asked)
    if asked == CpuPriority.AUTO and shares_host_with_executor(argv):
        return CpuPriority.BACKGROUND
    return CpuPriority.NORMAL  # an unknown value: the command's own option parsing rejects it


def enter_background_priority() -> str:
    """Give the calling thread, and every thread it starts from now on, the OS's background CPU
    class (SCHED_IDLE on Linux, else nice 19); call it before torch and pyzmq start their threads.
    Returns what was set ("SCHED_IDLE", "nice 19" or "unchanged"). An unprivileged process cannot
    undo it."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        return "SCHED_IDLE"
    except (AttributeError, OSError):
        pass
    try:
        os.nice(19 - os.nice(0))
        return "nice 19"
    except OSError:
        return "unchanged"


# ---- small forward passes of a client of an executor in another process -------------------------
#
# The problem. A decode step's own ops in the client (norms, attention over the KV cache, the
# adapters) are tiny: for 16 sequences at hidden 512 each runs in tens of µs. With two intra-op
# threads, every parallel region first wakes the second OpenMP worker, which slept while the
# executor process computed (``OMP_WAIT_POLICY=PASSIVE`` above) and whose core may have halted:
# ~50-100 µs here, more than the op saves. The executor's products, which are what is big in a
# decode step, run in the executor's process with its own threads either way.
#
# The setting. A client of an executor in another process runs every forward pass of at most
# ``SMALL_FORWARD_TOKENS`` tokens (a decode step of up to that many sequences) on one intra-op
# thread, and everything else (prefill, training) on the threads it has. In-process clients keep
# theirs: one process, one OpenMP team, nothing asleep between ops. ``SYMBIOSIS_SMALL_FORWARD_TOKENS``
# (read when a client model is loaded) sets the bound; 0 turns it off.
#
# Measured (2026-11-27, this 2-core host, busy: monolithic step 22-27 ms; a throwaway driver with
# one ``serve`` process and one client process per variant, 16 interleaved rounds of 8 steps, two
# runs per transport): a 16-sequence decode step of the hidden-512 llama, client with 2 threads,
# x1.94-2.17 of monolithic as before and x1.77-1.94 with this (shm+ipc x1.94/2.04 -> x1.77/1.80,
# ipc x2.17/2.05 -> x1.94/1.77). A client limited to one thread for good did as well on decode but
# would lose its training steps' second thread. The rule as built, against it turned off, 10
# interleaved rounds per transport: 16-sequence decode shm+ipc x2.22 -> x1.98, ipc x2.05 -> x1.80,
# tcp x2.00 -> x1.81; one sequence x1.19/1.39/1.26 -> x1.18/1.26/1.18; training steps unchanged
# (x1.41/1.41/1.22 -> x1.38/1.39/1.22).
#
# The catch: ``torch.set_num_threads`` is process-wide for MKL. Another thread of the same process
# running large ops during a client's small forward pass gets one MKL thread meanwhile.

SMALL_FORWARD_TOKENS = 32
SMALL_FORWARD_TOKENS_VARIABLE = "SYMBIOSIS_SMALL_FORWARD_TOKENS"


class SpinningClientWarning(RuntimeWarning):
    """A client of an executor on this host runs with libgomp's default OpenMP wait policy."""


_warned_spinning = False


def warn_if_client_spins(address: str | None) -> bool:
    """Warn once per process when this process is a client of an executor on the same host
    (``address``: any ipc scheme, or tcp to loopback) and ``OMP_WAIT_POLICY`` is not set: its
    idle OpenMP workers then spin on the cores the executor's products need. Returns whether it
    warned. Measured (2026-11-27, h512 llama, one training step over ipc, ``serve`` process
    PASSIVE): the executor's products took 917 ms with the client at libgomp's default, 636-701 ms
    with the client PASSIVE. The command line sets it for its own commands
    (``configure_for_command``); a script cannot once torch is imported, hence a warning."""
    global _warned_spinning
    if _warned_spinning or address is None or WAIT_POLICY_VARIABLE in os.environ:
        return False
    from symbiosis.transport.schemes import on_this_host

    if not on_this_host(address):
        return False
    _warned_spinning = True
    warnings.warn(
        f"this process is a client of the executor at {address} on the same host, with OpenMP's default "
        f"wait policy: its idle threads spin on the cores the executor needs (a training step's products "
        f"took ~1.4x as long in our measurement). Start it with {WAIT_POLICY_VARIABLE}={SHARED_HOST_POLICY} "
        f"{SPIN_COUNT_VARIABLE}={CLIENT_SPIN_COUNT} (before torch is imported), as `symbiosis` commands do.",
        SpinningClientWarning,
        stacklevel=3,
    )
    return True


def small_forward_tokens() -> int:
    """The bound on a small forward pass (tokens), from the environment or the default; 0: off."""
    value = os.environ.get(SMALL_FORWARD_TOKENS_VARIABLE, "").strip()
    try:
        return max(int(value), 0) if value else SMALL_FORWARD_TOKENS
    except ValueError:
        return SMALL_FORWARD_TOKENS


def one_thread_for_small_forwards(model, max_tokens: int) -> None:
    """Make ``model`` (a ``torch.nn.Module`` taking ``input_ids`` or ``inputs_embeds``) run each
    forward pass of at most ``max_tokens`` tokens on one intra-op thread, restoring the thread
    count afterwards (also when the pass raises). No-op for ``max_tokens`` 0."""
    if max_tokens <= 0:
        return
    import torch

    def tokens_of(args: tuple, kwargs: dict) -> int | None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        if isinstance(ids, torch.Tensor):
            return ids.numel()
        embeds = kwargs.get("inputs_embeds")
        if isinstance(embeds, torch.Tensor) and embeds.dim() >= 2:
            return embeds.shape[0] * embeds.shape[1]
        return None

    def before(module, args, kwargs) -> None:
        tokens = tokens_of(args, kwargs)
        if tokens is None or tokens > max_tokens or "_symbiosis_threads" in module.__dict__:
            return  # a large pass, or a nested one inside a small pass already on one thread
        threads = torch.get_num_threads()
        if threads > 1:
            module.__dict__["_symbiosis_threads"] = threads
            torch.set_num_threads(1)

    def after(module, args, kwargs, output) -> None:
        threads = module.__dict__.pop("_symbiosis_threads", None)
        if threads is not None:
            torch.set_num_threads(threads)

    model.register_forward_pre_hook(before, with_kwargs=True)
    model.register_forward_hook(after, with_kwargs=True, always_call=True)


def with_torch_threads(target: Callable[..., T]) -> Callable[..., T]:
    """``target``, to run in a new thread with the torch intra-op thread count of the thread that
    calls this (give it to ``threading.Thread``).

    Why. OpenMP keeps its thread count per thread. A thread torch did not start -- the server's
    socket thread, which runs a lone client's products, the engine's compute thread, the API
    server's model thread -- begins with OpenMP's default (one thread per core), not what
    ``torch.set_num_threads`` set, and MKL's matrix products do not correct it (torch's own
    parallel loops do, at their first use in the thread). So in a process limited to one thread,
    a 2-row product in such a thread still ran on a team of two; measured on this 2-core host
    with one other busy process: 20 ms instead of 4 µs (the team waits for a core), and 16 ms a
    call on the tcp lane of ``benchmarks/roundtrip.py`` at 16 rows."""
    import torch

    count = torch.get_num_threads()

    @functools.wraps(target)
    def run(*args: object, **kwargs: object) -> T:
        torch.set_num_threads(count)
        return target(*args, **kwargs)

    return run
