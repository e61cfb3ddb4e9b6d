"""Messages between the ranks of a sharded executor (``links.py``): msgspec Structs as msgpack.

Like the client protocol (``protocol.py``) nothing is pickled: a header is a tagged msgpack map of
known fields, and tensor bytes follow as raw frames whose size is checked against the header
before a tensor is made of them.
"""

from __future__ import annotations

import msgspec


class Ready(msgspec.Struct, tag="ready", frozen=True):
    """A rank's link is up; what the others report about it (health, error messages)."""

    rank: int
    pid: int
    host: str


class Ping(msgspec.Struct, tag="ping", frozen=True):
    pass


class Pong(msgspec.Struct, tag="pong", frozen=True):
    pass


class Forward(msgspec.Struct, tag="forward", frozen=True):
    """Run ``op`` of ``layer_id`` (owned by the receiver) on the rows in the payload frame, for a
    client of the sender (strategy ``layers``)."""

    seq: int
    client_id: str
    layer_id: str
    op: str
    latency_class: str
    dtype: str
    shape: list[int]


class Result(msgspec.Struct, tag="result", frozen=True):
    """The answer to ``Forward`` ``seq``: the result rows in the payload frame, or a typed error."""

    seq: int
    ok: bool
    dtype: str = ""
    shape: list[int] = []
    error_code: str = ""
    error_message: str = ""


class Member(msgspec.Struct, tag="member", frozen=True):
    """A client joined or left the sender's endpoint (owners batch and drop by client)."""

    client_id: str
    joined: bool


class Gather(msgspec.Struct, tag="gather", frozen=True):
    """Leader to followers: the next collective is the all-gather of unit ``unit`` (strategy
    ``fsdp``); every rank runs these in ``seq`` order, so the collectives match."""

    seq: int
    unit: int


class Want(msgspec.Struct, tag="want", frozen=True):
    """Follower to leader: a batch here needs unit ``unit``; any gather of it after ``after_seq``
    (the last one this rank had finished when it started waiting) serves it."""

    unit: int
    after_seq: int


class Endpoints(msgspec.Struct, tag="endpoints", frozen=True):
    """A rank to rank 0: the client addresses it serves, one per ``--bind`` address of rank 0 (""
    where it has none), then its ``--shard-bind`` ones (``endpoints.py``)."""

    rank: int
    addresses: list[str]


class StatsQuery(msgspec.Struct, tag="stats_query", frozen=True):
    seq: int


class StatsReply(msgspec.Struct, tag="stats_reply", frozen=True):
    seq: int
    stats_json: bytes  # msgspec JSON of the rank's ``local_stats()``


class Bye(msgspec.Struct, tag="bye", frozen=True):
    """The sender is stopping on purpose (its disconnect is not a failure)."""

    reason: str


LinkMessage = (
    Ready | Ping | Pong | Forward | Result | Member | Gather | Want | Endpoints | StatsQuery | StatsReply | Bye
)

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(LinkMessage)


def encode(message: LinkMessage) -> bytes:
    return _encoder.encode(message)


def decode(header: bytes | memoryview) -> LinkMessage:
    """Decode one header frame; raises ``msgspec.DecodeError`` / ``ValidationError`` on garbage."""
    return _decoder.decode(header)
