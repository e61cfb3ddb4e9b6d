"""The client's end of a same-host lane receiving a result into memory it made
(``ClientLane.exchange(..., into=)``): the reply is scattered over the lane's header buffer, up
to where the last result's payload started, then ``into``; whatever does not fit that guess (a
longer header, an error reply, a payload of another size) is put back together and read as
``exchange`` reads any reply, and the guess follows the replies."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest
import torch

from symbiosis import protocol as P
from symbiosis.errors import ProtocolError
from symbiosis.transport import lane as L


@pytest.fixture
def pair() -> Iterator[tuple[L.ClientLane, socket.socket]]:
    executor_end, client_end, max_message_bytes = L.make_pair()
    executor_end.setblocking(True)
    lane = L.ClientLane(client_end, max_message_bytes)
    yield lane, executor_end
    lane.release()
    executor_end.close()


def call(lane: L.ClientLane, executor_end: socket.socket, request_id: int, reply: P.Reply, payload=None):
    """One exchange into a fresh [2, 8] float32 tensor, answered with ``reply`` and ``payload``."""
    result = torch.empty(2, 8)
    into = memoryview(result.numpy()).cast("B")
    # The answer is queued before exchange sends its request: no executor thread is needed.
    executor_end.sendmsg(L.frame(P.encode(reply), None if payload is None else P.tensor_payload(payload)))
    got_reply, got_payload = lane.exchange(b"request", None, request_id, into.nbytes, 5.0, into)
    assert executor_end.recv(1 << 20)  # the request did go out
    return result, got_reply, got_payload


def test_results_land_in_place_and_the_guess_follows_the_header_length(pair) -> None:
    lane, executor_end = pair
    expected = torch.randn(2, 8)
    short = P.Reply(1, True, "float32", [2, 8])
    # A client id does not belong in a reply; a long dtype string stands in for any longer header.
    long = P.Reply(2, True, "float32" + " " * 120, [2, 8])
    assert L.payload_start(len(P.encode(short))) != L.payload_start(len(P.encode(long)))

    lane._payload_start = L.payload_start(len(P.encode(short)))
    result, reply, payload = call(lane, executor_end, 1, short, expected)
    assert reply == short and payload is None and torch.equal(result, expected)  # landed where guessed

    result, reply, payload = call(lane, executor_end, 2, long, expected)
    assert reply == long and payload is not None  # put back together: the caller wraps the bytes
    assert torch.equal(P.tensor_from_payload(payload, "float32", [2, 8]), expected)
    assert lane._payload_start == L.payload_start(len(P.encode(long)))  # learned

    result, reply, payload = call(lane, executor_end, 3, P.Reply(3, True, "float32" + " " * 120, [2, 8]), expected)
    assert payload is None and torch.equal(result, expected)  # lands again, at the new place


@pytest.mark.parametrize("message_bytes", [10, 3000])
def test_an_error_reply_of_any_length_is_read_whole(pair, message_bytes: int) -> None:
    lane, executor_end = pair
    error = P.error_reply(7, ProtocolError.code, "x" * message_bytes)
    _, reply, payload = call(lane, executor_end, 7, error)
    assert reply == error and payload is not None and payload.nbytes == 0
    assert lane._payload_start == 2 * L.ALIGNMENT  # an answer without a result teaches nothing


def test_a_result_of_another_size_is_not_taken_for_the_expected_one(pair) -> None:
    lane, executor_end = pair
    other = torch.randn(3, 8)  # a reply to a bigger call: it must not be cut to fit
    _, reply, payload = call(lane, executor_end, 4, P.Reply(4, True, "float32", [3, 8]), other)
    assert payload is not None and torch.equal(P.tensor_from_payload(payload, "float32", [3, 8]), other)
    assert not payload.readonly  # a result wrapped from it may be added to in place (peft does)
