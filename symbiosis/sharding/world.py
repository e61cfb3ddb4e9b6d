"""The ranks of a sharded executor as ``torchrun`` (or ``elastic_launch``) starts them.

``torchrun`` gives every worker ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` /
``MASTER_PORT`` (a c10d TCPStore the elastic agent hosts) and, being elastic,
``TORCHELASTIC_RESTART_COUNT`` / ``TORCHELASTIC_MAX_RESTARTS``. That store is all the ranks need to
find each other (``connect_store``); the process group of the ``fsdp`` strategy is built on it
(``make_group``), and so are the ZeroMQ links between ranks (``links.py``).
"""

from __future__ import annotations

import datetime
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from symbiosis.errors import ConfigurationError
from symbiosis.executor.executor import parse_device


@dataclass(frozen=True)
class RankInfo:
    """Who this process is in the launch."""

    rank: int
    world_size: int
    local_rank: int
    restart_count: int = 0
    max_restarts: int = 0
    run_id: str = "none"

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> RankInfo | None:
        """This process's place in a ``torchrun`` launch; None when it was not started as a rank
        of a world larger than one."""
        env = os.environ if env is None else env
        if "RANK" not in env or int(env.get("WORLD_SIZE", "1")) < 2:
            return None
        return cls(
            rank=int(env["RANK"]),
            world_size=int(env["WORLD_SIZE"]),
            local_rank=int(env.get("LOCAL_RANK", env["RANK"])),
            restart_count=int(env.get("TORCHELASTIC_RESTART_COUNT", "0")),
            max_restarts=int(env.get("TORCHELASTIC_MAX_RESTARTS", "0")),
            run_id=env.get("TORCHELASTIC_RUN_ID", "none"),
        )

    @property
    def restarts_left(self) -> int:
        return max(0, self.max_restarts - self.restart_count)

    @property
    def is_entry(self) -> bool:
        """Rank 0 serves the address the user gave (``--bind``) and leads the ``fsdp`` gathers."""
        return self.rank == 0


def connect_store(info: RankInfo, timeout_s: float, env: Mapping[str, str] | None = None) -> dist.Store:
    """A client of the launch's c10d store, under a prefix of this launch and restart (the agent
    keeps its store across restarts, so a restarted group must not read the old group's keys)."""
    env = os.environ if env is None else env
    host, port = env["MASTER_ADDR"], int(env["MASTER_PORT"])
    # torchrun's agent hosts the store; a hand-made launch (RANK/WORLD_SIZE/MASTER_* set by the
    # user) has none, and then rank 0 hosts it, as init_process_group("env://") would.
    hosted_by_agent = env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    store = dist.TCPStore(
        host,
        port,
        info.world_size,
        is_master=info.is_entry and not hosted_by_agent,
        timeout=datetime.timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )
    return dist.PrefixStore(f"symbiosis/{info.run_id}/{info.restart_count}/", store)


def backend_for(device: torch.device) -> str:
    """NCCL between GPUs, gloo on CPU: the same code path, the collective library differs."""
    return "nccl" if device.type == "cuda" else "gloo"


def rank_device(device: str, info: RankInfo) -> torch.device:
    """Each rank's device: ``cuda`` means ``cuda:LOCAL_RANK`` (one GPU per rank on a host)."""
    parsed = parse_device(device)
    if device == "cuda":
        return torch.device("cuda", info.local_rank)
    if device.startswith("cuda:"):
        raise ConfigurationError(
            f"--device {device} names one GPU for every rank; pass --device cuda (rank r takes cuda:LOCAL_RANK)"
        )
    return parsed


def make_group(
    store: dist.Store, rank: int, world_size: int, device: torch.device, timeout_s: float, host: str = "127.0.0.1"
) -> Any:
    """A process group of the ranks over ``store`` (blocks until all joined): gloo for CPU tensors,
    NCCL for CUDA ones. Built directly rather than with ``init_process_group``, so one process
    may hold the groups of several ranks (the tests run ranks as threads) and the group's timeout
    bounds every collective."""
    timeout = datetime.timedelta(seconds=timeout_s)
    group_store = dist.PrefixStore("group/", store)
    if backend_for(device) == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        torch.cuda.set_device(device)
        return dist.ProcessGroupNCCL(group_store, rank, world_size, options)
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    return dist.ProcessGroupGloo(group_store, rank, world_size, options)


def this_host() -> str:
    return socket.gethostname()
