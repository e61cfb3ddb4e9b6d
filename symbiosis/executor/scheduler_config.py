"""``SchedulerConfig``: every knob of the batching scheduler, validated, with the help text the CLI shows.

The scheduler itself is in ``scheduler.py`` (which re-exports these names); this file only says
what each knob means and which values are allowed.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field, fields
from typing import Literal

from symbiosis.errors import ConfigurationError
from symbiosis.vocabulary import LatencyClass

Policy = Literal["immediate", "lockstep", "opportunistic"]
POLICIES: tuple[str, ...] = ("immediate", "lockstep", "opportunistic")
WaitRule = Literal["adaptive", "none", "predicted", "convoy", "budget"]
WAIT_RULES: tuple[str, ...] = ("adaptive", "none", "predicted", "convoy", "budget")
BulkLane = Literal["auto", "background", "shared"]
BULK_LANES: tuple[str, ...] = ("auto", "background", "shared")


def _help(text: str) -> dict[str, str]:
    return {"help": text}


@dataclass(frozen=True)
class SchedulerConfig:
    """How the base executor batches and shares its products. Each field's ``metadata["help"]`` is the CLI help text."""

    policy: Policy = field(
        default="opportunistic",
        metadata=_help(
            "Batching policy: 'immediate' (serve at once, no lockstep), 'lockstep' (wait for every "
            "joined client at each layer) or 'opportunistic' (wait only where waiting pays; see --wait-rule)."
        ),
    )
    max_wait_ms: float = field(
        default=5.0,
        metadata=_help(
            "Opportunistic: cap on how long a request may be held back to grow a batch (ms), except by the "
            "'convoy' rule (see --lockstep-timeout-ms)."
        ),
    )
    row_budget: int = field(
        default=4096,
        metadata=_help("Most rows in one batch; larger requests are split into row chunks across batches."),
    )
    lockstep_timeout_ms: float = field(
        default=50.0,
        metadata=_help(
            "Lockstep: serve a layer anyway once its oldest request waited this long (ms). Also the cap of "
            "the opportunistic 'convoy' trial (wait for every client on its way to the layer)."
        ),
    )
    aging_ms: float = field(
        default=20.0,
        metadata=_help(
            "Within one client's own queue, a request that waited this long goes before the client's "
            "more urgent classes (ms), so a client's fine-tuning is not starved by its own decode stream. "
            "Between clients, fair sharing decides (see --decode-share-rows)."
        ),
    )
    decode_base_wait_ms: float = field(
        default=3.0,
        metadata=_help("Opportunistic: wait budget of a decode request before its per-row growth (ms)."),
    )
    prefill_base_wait_ms: float = field(
        default=4.0,
        metadata=_help("Opportunistic: wait budget of a prefill request before its per-row growth (ms)."),
    )
    finetune_base_wait_ms: float = field(
        default=5.0,
        metadata=_help("Opportunistic: wait budget of a fine-tuning request before its per-row growth (ms)."),
    )
    wait_per_row_ms: float = field(
        default=0.002,
        metadata=_help(
            "Opportunistic: how much the wait budget grows per row of the request (ms/row); "
            "0.002 adds 0.5 ms for 256 rows, 4 ms for 2048 rows."
        ),
    )
    wait_rule: WaitRule = field(
        default="adaptive",
        metadata=_help(
            "Opportunistic: which waiting for other clients' rows pays. 'adaptive' (default) keeps trying "
            "'none', 'predicted' and 'convoy', measuring requests and rows served per second under each, and "
            "uses the best (re-tried periodically); or one of them fixed: 'none' (serve at once), 'predicted' "
            "(hold for clients predicted to arrive within the wait budget, learned from each client's order "
            "and pace), 'convoy' (hold for every client on its way to the layer, up to --lockstep-timeout-ms), "
            "'budget' (hold for the whole wait budget: the paper's rule)."
        ),
    )
    adapt_epoch_ms: float = field(
        default=200.0,
        metadata=_help(
            "Opportunistic with --wait-rule adaptive: how long one trial of a waiting rule lasts at least (ms)."
        ),
    )
    decode_slo_ms: float | None = field(
        default=None,
        metadata=_help(
            "Per-token latency target of decode clients (ms; aimed at p95), FlexLLM-style co-serving: bulk rows "
            "(fine-tuning, long prompts) are cut into chunks short enough, and bulk work is paced to the share of "
            "time the target leaves (learned from the decoders' token times; never below 5%). Unset: no target, "
            "bulk work gets its fair share (see --decode-slowdown, --decode-share-rows). With --bulk-lane "
            "background (serve's default on a CPU) bulk products run at the OS's background priority, which "
            "already gives decoders every core they want, and the target paces bulk work there too (its clients' "
            "own work and its rows' transfer still take CPU): the share is then of every bulk thread's time."
        ),
    )
    decode_slowdown: float = field(
        default=1.0,
        metadata=_help(
            "Without --decode-slo-ms: the longest one product may delay an active decode client's layer call, "
            "as a multiple of that client's own time per call (learned); bulk rows are cut into chunks that "
            "fit; and a client flooding the executor (several requests queued, or one larger than --row-budget) "
            "is paced so that a decode client's tokens stay within (1 + this) times its fastest token at p95 "
            "(a flood slows decoders outside the queue too: the server's socket thread, the host's cores). "
            "1.0 bounds a decode step at about twice its time alone."
        ),
    )
    decode_share_rows: int = field(
        default=256,
        metadata=_help(
            "A decode or prefill request of at most this many rows is latency work, served before bulk work "
            "(fine-tuning, and anything larger: a client that labels big work 'decode' gets no priority for it). "
            "Within each, clients share by rows (fair queueing: one client's backlog delays only itself); bulk "
            "work is still owed its fair share of time (bulk clients / active clients) and is served first "
            "while it is owed."
        ),
    )
    bulk_lane: BulkLane = field(
        default="auto",
        metadata=_help(
            "Who runs bulk products (fine-tuning, long prompts). 'background': a thread of their own at the "
            "OS's background CPU priority (SCHED_IDLE), beside the products of latency work, so a decode "
            "request never waits behind one: the OS stops it for latency work at once, and bulk work gets "
            "the CPU time latency work leaves (none while it takes every core); a flood is still paced "
            "(see --decode-slowdown). 'shared': the runners of "
            "latency work run bulk products too, one product at a time, bulk owed its fair share and paced "
            "and cut into chunks for the decoders as --decode-slo-ms and --decode-slowdown say. 'auto' "
            "(default): background for `symbiosis serve` on a CPU (not yet with --shards); shared on an "
            "accelerator (its products share one stream) and for an executor in its clients' process (the "
            "bulk threads' OpenMP teams would be more teams there, which slows every torch op of the clients)."
        ),
    )
    bulk_threads: int = field(
        default=0,
        metadata=_help(
            "With --bulk-lane background: how many bulk threads run bulk products side by side, each on one "
            "torch thread while other bulk work waits -- different jobs' batches at once, and a lone batch's "
            "rows split between the idle ones (parts of 128 rows or more); a lone job's batch gets the "
            "threads no bulk product uses. On a CPU this does more per core than one product on every "
            "core (whose threads wait for each other at every step of it). 0 (default): one per torch "
            "thread of the executor. 1: one bulk thread, each product on every torch thread."
        ),
    )
    min_chunk_rows: int = field(
        default=16,
        metadata=_help(
            "Smallest row chunk bulk work is cut to, however tight the decode latency target; it is how "
            "fine-tuning keeps progressing when the target leaves almost nothing (capped by --row-budget). "
            "With --decode-slo-ms, a chunk that bulk work leads (not a flood's) is also not cut below the rows "
            "whose time equals its product's fixed part (learned from the products' times), unless it is "
            "sized to the decoders' free time alone."
        ),
    )

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ConfigurationError(f"SchedulerConfig.policy must be one of {POLICIES}, got {self.policy!r}")
        for name, least in (("row_budget", 1), ("decode_share_rows", 0), ("bulk_threads", 0), ("min_chunk_rows", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ConfigurationError(f"SchedulerConfig.{name} must be an integer >= {least}, got {value!r}")
        if self.bulk_lane not in BULK_LANES:
            raise ConfigurationError(f"SchedulerConfig.bulk_lane must be one of {BULK_LANES}, got {self.bulk_lane!r}")
        if self.wait_rule not in WAIT_RULES:
            raise ConfigurationError(f"SchedulerConfig.wait_rule must be one of {WAIT_RULES}, got {self.wait_rule!r}")
        for name in (
            "max_wait_ms",
            "lockstep_timeout_ms",
            "aging_ms",
            "decode_base_wait_ms",
            "prefill_base_wait_ms",
            "finetune_base_wait_ms",
            "wait_per_row_ms",
            "decode_slowdown",
        ):
            _check_non_negative(name, getattr(self, name))
        _check_non_negative("adapt_epoch_ms", self.adapt_epoch_ms)
        if self.adapt_epoch_ms == 0:
            raise ConfigurationError("SchedulerConfig.adapt_epoch_ms must be > 0")
        if self.decode_slo_ms is not None:
            _check_non_negative("decode_slo_ms", self.decode_slo_ms)
            if self.decode_slo_ms == 0:
                raise ConfigurationError("SchedulerConfig.decode_slo_ms must be > 0 (or None for no target)")
        if not self.decode_base_wait_ms <= self.prefill_base_wait_ms <= self.finetune_base_wait_ms:
            raise ConfigurationError(
                "SchedulerConfig base waits must satisfy decode <= prefill <= finetune (a small, urgent "
                f"request should wait least), got decode={self.decode_base_wait_ms}, "
                f"prefill={self.prefill_base_wait_ms}, finetune={self.finetune_base_wait_ms}"
            )

    @classmethod
    def help_texts(cls) -> dict[str, str]:
        """Field name -> help text, for a CLI that exposes these options."""
        return {f.name: f.metadata["help"] for f in fields(cls)}

    def base_wait_ms(self, latency_class: LatencyClass) -> float:
        # Asked for every request the scheduler queues: no mapping made per call. ``==``, not
        # ``is``: a class's plain string value ("decode") is accepted, as the mapping did.
        if latency_class == LatencyClass.DECODE:
            return self.decode_base_wait_ms
        if latency_class == LatencyClass.PREFILL:
            return self.prefill_base_wait_ms
        if latency_class == LatencyClass.FINETUNE:
            return self.finetune_base_wait_ms
        raise KeyError(latency_class)

    def wait_budget_s(self, rows: int, latency_class: LatencyClass) -> float:
        """How long the opportunistic policy may hold a request back to grow its batch (seconds).

        ``wait_ms = min(max_wait_ms, base_wait_ms[class] + wait_per_row_ms * rows)``

        Why: a request's natural time in the system (client-side attention and adapters, the GEMM
        itself, the network) grows with its rows and is longer for prefill and fine-tuning steps
        than for one decode token. Waiting costs a small decode request a large fraction of its
        latency and a large prefill or fine-tuning request a small one (paper §3.7), so the budget
        grows with both; ``max_wait_ms`` is the provider's cap on the worst penalty per layer.
        """
        wait_ms = self.base_wait_ms(latency_class) + self.wait_per_row_ms * rows
        return min(self.max_wait_ms, wait_ms) / 1000.0


def resolve_bulk_lane(config: SchedulerConfig, device_type: str, own_process: bool) -> SchedulerConfig:
    """``config`` with ``bulk_lane="auto"`` made concrete (see its help): ``background`` for an
    executor on a CPU in a process of its own, else ``shared``."""
    if config.bulk_lane != "auto":
        return config
    lane = "background" if device_type == "cpu" and own_process else "shared"
    return dataclasses.replace(config, bulk_lane=lane)


def _check_non_negative(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ConfigurationError(f"SchedulerConfig.{name} must be a finite number >= 0, got {value!r}")
