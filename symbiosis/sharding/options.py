"""The flags of a sharded ``symbiosis serve`` (no torch here: the CLI imports it to build its help)."""

from __future__ import annotations

from dataclasses import dataclass

from symbiosis.errors import ConfigurationError
from symbiosis.sharding.placement import DEFAULT_STRATEGY, STRATEGIES

#: Help texts of the ``symbiosis serve`` flags for sharding (the CLI reuses them).
SHARD_HELP = {
    "shards": "Spread the base weights over N processes on this host, started through torch.distributed's "
    "elastic launcher (under torchrun, leave it out: the world size is the number of shards). Clients connect "
    "to --bind as to one executor.",
    "shard_strategy": "How weights are spread: 'layers' (each rank owns whole layers, rows travel to the owner) "
    "or 'fsdp' (each layer is row-sharded over all ranks and gathered to run a batch, as FSDP does).",
    "shard_bind": "Also serve clients at this address on every rank ('{rank}' and '{local_rank}' are replaced), "
    "e.g. ipc:///tmp/executor-{rank}.sock, so a client can talk to the shard on its own host or device. "
    "Repeatable. (Every rank already serves a counterpart of each --bind address, which clients are routed to.)",
    "max_restarts": "With --shards: how many times the launcher restarts the whole group when a rank dies "
    "(torchrun takes its own --max-restarts).",
    "shard_host": "Address the ranks' links to each other listen on (loopback; ranks on other hosts need a "
    "reachable one, and those links are not encrypted).",
    "failure_linger_s": "When a rank dies and no restart is left, rank 0 keeps answering clients this long, with "
    "an error naming the failed shard, before it exits.",
}


@dataclass(frozen=True)
class ShardOptions:
    """How the ranks are spread and how long they wait for each other."""

    strategy: str = DEFAULT_STRATEGY
    link_host: str = "127.0.0.1"
    collective_timeout_s: float = 120.0
    peer_timeout_s: float = 60.0  # a hung or cut-off peer; a dead process is noticed at once (links.py)
    heartbeat_s: float = 1.0
    start_timeout_s: float = 600.0
    failure_linger_s: float = 12.0
    stop_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ConfigurationError(f"unknown sharding strategy {self.strategy!r}; use one of {list(STRATEGIES)}")
