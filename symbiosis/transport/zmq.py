"""ZeroMQ transport, one import away: ``ZmqServer`` (``zmq_server.py``) serves an
``ExecutorService``; ``ZmqTransport`` (``zmq_client.py``) is the client side; ``schemes.open_transport(address)``
opens the right client transport for any address.

Addresses: ``tcp://127.0.0.1:7000`` (port 0 picks a free one, see ``ZmqServer.address``) and
``ipc:///path/executor.sock``; ``open_transport()`` also takes ``shm+…`` (shared-memory payloads,
``shm_client.py``) and ``dist+…`` (torch.distributed payloads, ``dist_client.py``). The wire protocol is in
``symbiosis/protocol.py``; how payloads travel is in ``channels.py``.
"""

from symbiosis.transport.zmq_client import ZmqTransport
from symbiosis.transport.zmq_server import ZmqServer, check_bind_address

__all__ = ["ZmqServer", "ZmqTransport", "check_bind_address"]
