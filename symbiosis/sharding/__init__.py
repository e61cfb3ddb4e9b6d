"""A base executor spread over several processes (paper §3.3, "sharded local/remote").

``torchrun --nproc-per-node N -m symbiosis serve MODEL --bind ADDRESS`` or ``symbiosis serve MODEL
--shards N --bind ADDRESS``; clients connect to ADDRESS exactly as to one executor. See
``serve.py`` (launch and life of a rank), ``executor.py`` (routing), ``placement.py`` (where the
layers live), ``gather.py`` (the FSDP-style strategy), ``links.py`` (rank-to-rank messages) and
docs/scaling.md.
"""

from symbiosis.sharding.placement import DEFAULT_STRATEGY, STRATEGIES

__all__ = ["DEFAULT_STRATEGY", "STRATEGIES"]
