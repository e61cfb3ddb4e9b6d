"""The smaller findings of issue 10 (finding 5): each fault, refused or bounded.

- the metrics server keeps a bounded number of handler threads, each with a timeout;
- a CURVE key file with 40 non-Z85 characters is a typed error, not a hang in ``ctx.term()``;
- ``serve --bind ipc://@NAME`` (an abstract socket: no file permissions) needs CURVE;
- JSONL lines are capped, and a huge record is cut before it is tokenized;
- tokenizers load from local folders only, and ``generate`` checks the folder first.
"""

from __future__ import annotations

import json
import os
import random
import re
import socket
import subprocess
import sys
import textwrap
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import zmq

from symbiosis.errors import CheckpointError, CurveKeyError, SymbiosisError, UnsafeBindError
from symbiosis.executor.metrics import MetricsServer
from symbiosis.jobs import data as data_module
from symbiosis.jobs.client import ClientOptions, load_tokenizer
from symbiosis.jobs.data import DataError, Record, read_jsonl, tokenize
from symbiosis.jobs.generate import GenerateOptions, generate, read_prompts
from symbiosis.transport.security import CurveClientKeys, check_abstract_ipc, generate_keypair
from tests.cli_helpers import run_cli

# ---- metrics server -----------------------------------------------------------------------------


class FakeExecutor:
    def stats(self) -> dict:
        return {
            "layers": {},
            "inflight_requests": 0,
            "weights_bytes": 0,
            "device": "cpu",
            "scheduler": {"joined_clients": 0},
        }

    def health(self) -> dict:
        return {"status": "ok", "inflight_requests": 0, "device": "cpu"}


def half_open(port: int, n: int) -> list[socket.socket]:
    """``n`` connections that each send part of a request line and then nothing more."""
    socks = []
    for _ in range(n):
        sock = socket.create_connection(("127.0.0.1", port), timeout=5)
        sock.sendall(b"GET /metr")
        socks.append(sock)
    return socks


def wait_for(condition, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


def test_metrics_server_threads_are_bounded():
    server = MetricsServer(FakeExecutor(), port=0)  # the defaults: what `serve --metrics-port` runs
    before = threading.active_count()
    socks = half_open(server.port, 40)
    try:
        time.sleep(0.5)  # let the server accept them all
        assert threading.active_count() - before <= 8, "one thread per half-open connection"
    finally:
        for sock in socks:
            sock.close()
        server.close()


def test_half_open_requests_time_out_and_the_server_answers_again():
    server = MetricsServer(FakeExecutor(), port=0, max_handlers=2, request_timeout_s=0.3)
    before = threading.active_count()
    socks = half_open(server.port, 10)
    try:
        time.sleep(0.1)
        assert threading.active_count() - before <= 2
        assert wait_for(lambda: threading.active_count() <= before, 5), "handler threads outlived their timeout"

        def answers() -> bool:  # (a slot may be freed a moment after its thread count drops: CI saw a refusal)
            try:
                reply = urllib.request.urlopen(f"http://127.0.0.1:{server.port}/health", timeout=5).read()
            except (ConnectionError, urllib.error.URLError):
                return False
            return json.loads(reply)["status"] == "ok"

        assert wait_for(answers, 5), "the server does not answer again"
    finally:
        for sock in socks:
            sock.close()
        server.close()


# ---- CURVE keys ---------------------------------------------------------------------------------

needs_curve = pytest.mark.skipif(not zmq.has("curve"), reason="libzmq without CURVE")


def corrupt_key(path: Path, which: str, value: str) -> Path:
    """A copy of the key file ``path`` whose ``which`` key is ``value`` (mode 0600 kept)."""
    text = path.read_text()
    text = re.sub(rf'({which}-key = ")[^"]*(")', lambda m: m.group(1) + value + m.group(2), text)
    bad = path.with_name("bad-" + path.name)
    bad.write_text(text)
    bad.chmod(0o600)
    return bad


@needs_curve
@pytest.mark.parametrize("which, value", [("public", "~" * 40), ("secret", "\\" * 40), ("public", "#" * 40)])
def test_non_z85_key_is_a_typed_error(tmp_path, which, value):
    server_public, _ = generate_keypair(tmp_path, "server")
    _, client_secret = generate_keypair(tmp_path, "client")
    bad = corrupt_key(client_secret, which, value)
    with pytest.raises(CurveKeyError, match="malformed key"):
        CurveClientKeys(server_public, bad)
    with pytest.raises(CurveKeyError, match="malformed key"):
        CurveClientKeys(corrupt_key(server_public, "public", value), client_secret)
    env = {"SYMBIOSIS_CURVE_SERVER_KEY": str(server_public), "SYMBIOSIS_CURVE_CLIENT_KEY": str(bad)}
    with pytest.raises(SymbiosisError):
        CurveClientKeys.from_env(env)


@needs_curve
@pytest.mark.slow
def test_a_key_libzmq_refuses_does_not_hang_the_client(tmp_path):
    """Should a bad key still reach the socket, the transport fails instead of hanging in ctx.term()."""
    generate_keypair(tmp_path, "server")
    generate_keypair(tmp_path, "client")
    script = textwrap.dedent(f"""
        from pathlib import Path
        from symbiosis.transport import zmq_client
        from symbiosis.transport.security import CurveClientKeys

        keys = CurveClientKeys(Path({str(tmp_path / "server.key")!r}), Path({str(tmp_path / "client.key_secret")!r}))
        zmq_client.configure_client_socket = lambda sock, keys: setattr(sock, "curve_secretkey", b"~" * 40)
        try:
            zmq_client.ZmqTransport("tcp://127.0.0.1:9", curve=keys, connect_timeout_s=1)
        except Exception as exc:
            print("raised", type(exc).__name__)
    """)
    try:
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False)
    except subprocess.TimeoutExpired:
        pytest.fail("the client hung after libzmq refused its key")
    assert "raised ZMQError" in done.stdout, done.stderr


# ---- abstract ipc binds -------------------------------------------------------------------------


def test_abstract_ipc_needs_curve():
    with pytest.raises(UnsafeBindError, match="abstract socket has no file permissions"):
        check_abstract_ipc("ipc://@symbiosis", curve=None)
    check_abstract_ipc("ipc://@symbiosis", curve=object())  # CURVE authenticates every peer
    check_abstract_ipc("ipc:///tmp/symbiosis.sock", curve=None)  # a socket file has permissions
    check_abstract_ipc("tcp://127.0.0.1:7000", curve=None)


@pytest.mark.timeout(60)  # the unfixed command serves forever
def test_serve_refuses_abstract_ipc_without_curve(tiny_checkpoint, capsys, monkeypatch):
    code, _, err = run_cli(
        ["serve", str(tiny_checkpoint("llama")), "--bind", "ipc://@symbiosis-test"], capsys, monkeypatch
    )
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and "without CURVE" in lines[0], err


# ---- addresses ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "address, message",
    [
        ("tcp://127.0.0.1", "names no port"),  # was: libzmq's "Invalid argument", or "not a loopback address"
        ("tcp://[::1]", "names no port"),
        ("tcp://:7000", "names no host"),
        ("tcp://127.0.0.1:99999", "must be a number from {lowest} to 65535"),  # was: served on port 34463
        ("tcp://127.0.0.1:x", "must be a number"),
        ("tcp://127.0.0.1:\u0665\u0665", "must be a number"),  # digits, but not ASCII ones
        ("tcp://::1:7000", "IPv6 address goes in brackets"),
        ("tcp://[::1:7000", "bracket is not closed"),
    ],
)
def test_a_bad_tcp_address_is_a_clear_error_on_both_sides(address, message):
    from symbiosis.errors import ConfigurationError
    from symbiosis.transport.schemes import open_transport
    from symbiosis.transport.zmq_server import check_bind_address

    with pytest.raises(ConfigurationError, match=re.escape(message.format(lowest=0))):
        check_bind_address(address, allow_non_loopback=False)
    for scheme in ("", "dist+"):  # every scheme over tcp reads its address the same way
        with pytest.raises(ConfigurationError, match=re.escape(message.format(lowest=1))):
            open_transport(scheme + address)


def _has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.skipif(not _has_ipv6_loopback(), reason="no IPv6 loopback on this host")
def test_ipv6_loopback_serves(tiny_checkpoint):
    import torch

    import symbiosis

    path = tiny_checkpoint("llama")
    with symbiosis.BaseExecutor.from_pretrained(path) as executor:  # was: bind failed, "No such device"
        server = executor.serve("tcp://[::1]:0")
        try:
            model = symbiosis.load_client_model(path, executor=server.address)
            assert model(input_ids=torch.tensor([[1, 2, 3]])).logits.shape[:2] == (1, 3)
            model.symbiosis_transport.close()
        finally:
            server.close()


@pytest.mark.skipif(not _has_ipv6_loopback(), reason="no IPv6 loopback on this host")
def test_shard_links_bind_an_ipv6_host():
    """``serve --shards`` ranks link to each other on ``--shard-host``: an IPv6 one went unbracketed
    into ``tcp://::1:0`` without ``zmq.IPV6`` (bind failed)."""
    from symbiosis.sharding.endpoints import rank_address
    from symbiosis.sharding.links import PeerLinks

    links = PeerLinks(0, 1, host="::1")
    try:
        assert links.address.startswith("tcp://[::1]:")
    finally:
        links.close()
    assert rank_address("tcp://[::1]:7000", 1) == "tcp://[::1]:0"
    assert rank_address("tcp://[::]:7000", 1) is None  # a wildcard: relayed through rank 0


def test_an_ipc_path_in_use_or_not_a_socket_is_refused(tiny_checkpoint, tmp_path):
    """libzmq unlinks what lies at an ipc path and binds anew: a second executor took a live one's
    address without a word, and a file named by mistake was deleted. A stale socket file is reused."""
    import symbiosis
    from symbiosis.errors import BindError

    with symbiosis.BaseExecutor.from_pretrained(tiny_checkpoint("llama")) as executor:
        live = executor.serve(f"ipc://{tmp_path}/live.sock")
        try:
            with pytest.raises(BindError, match="another server is listening there"):
                executor.serve(f"ipc://{tmp_path}/live.sock")
        finally:
            live.close()
        precious = tmp_path / "precious.txt"
        precious.write_text("keep")
        with pytest.raises(BindError, match="is not a socket"):
            executor.serve(f"ipc://{precious}")
        assert precious.read_text() == "keep"
        stale = socket.socket(socket.AF_UNIX)
        stale.bind(str(tmp_path / "stale.sock"))
        stale.close()  # a crashed server's file: nobody listens
        executor.serve(f"ipc://{tmp_path}/stale.sock").close()


def test_a_live_shared_memory_broker_is_not_replaced(tiny_checkpoint, tmp_path):
    """The broker (``<ipc path>.shm``) unlinked whatever socket lay at its path: an executor bound
    at a path whose socket file had gone took a live executor's broker. Now it serves without
    shared memory and the other broker keeps its file."""
    import symbiosis

    other_broker = socket.socket(socket.AF_UNIX)
    other_broker.bind(str(tmp_path / "x.sock.shm"))
    other_broker.listen(1)
    inode = (tmp_path / "x.sock.shm").lstat().st_ino
    try:
        with symbiosis.BaseExecutor.from_pretrained(tiny_checkpoint("llama")) as executor:
            server = executor.serve(f"ipc://{tmp_path}/x.sock")
            try:
                assert (tmp_path / "x.sock.shm").lstat().st_ino == inode
            finally:
                server.close()
        assert (tmp_path / "x.sock.shm").lstat().st_ino == inode  # close removes only its own file
        probe = socket.socket(socket.AF_UNIX)
        probe.connect(str(tmp_path / "x.sock.shm"))  # still listening
        probe.close()
    finally:
        other_broker.close()


def test_servers_starting_at_once_at_one_ipc_path_do_not_take_each_others_socket(tiny_checkpoint, tmp_path):
    """The path check and the bind were two steps: servers starting together could both find the
    path free, and libzmq's bind deleted the first one's socket. One wins; the others are refused."""
    import symbiosis
    from symbiosis.errors import BindError

    with symbiosis.BaseExecutor.from_pretrained(tiny_checkpoint("llama")) as executor:
        for attempt in range(5):
            address = f"ipc://{tmp_path}/race{attempt}.sock"
            barrier = threading.Barrier(4)
            servers, refusals = [], []

            def start(address=address, barrier=barrier, servers=servers, refusals=refusals):
                barrier.wait()
                try:
                    servers.append(executor.serve(address))
                except BindError as exc:
                    refusals.append(exc)

            threads = [threading.Thread(target=start) for _ in range(4)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            try:
                assert len(servers) == 1 and len(refusals) == 3
            finally:
                for server in servers:
                    server.close()


def test_listen_unix_replaces_only_a_stale_socket(tmp_path):
    from symbiosis.errors import BindError
    from symbiosis.transport.socket_paths import listen_unix

    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(tmp_path / "stale"))
    stale.close()
    listen_unix(str(tmp_path / "stale")).close()
    live = listen_unix(str(tmp_path / "live"))
    try:
        with pytest.raises(BindError, match="another server is listening there"):
            listen_unix(str(tmp_path / "live"))
    finally:
        live.close()
    (tmp_path / "file").write_text("keep")
    with pytest.raises(BindError, match="is not a socket"):
        listen_unix(str(tmp_path / "file"))
    assert (tmp_path / "file").read_text() == "keep"


def test_a_socket_whose_backlog_is_full_is_not_taken_for_a_stale_one(tmp_path):
    """A server that stopped accepting (frozen, its clients reconnecting) has a full backlog: a
    connect fails at once with EAGAIN, not "refused". That was taken for a stale file and replaced."""
    from symbiosis.errors import BindError
    from symbiosis.transport.socket_paths import listen_unix

    path = str(tmp_path / "frozen")
    frozen = socket.socket(socket.AF_UNIX)
    frozen.bind(path)
    frozen.listen(0)
    waiting = []
    try:
        for _ in range(64):  # fill the backlog: connects then fail with EAGAIN
            client = socket.socket(socket.AF_UNIX)
            client.setblocking(False)
            waiting.append(client)
            try:
                client.connect(path)
            except BlockingIOError:
                break
        else:
            pytest.skip("this kernel took 64 connections into a backlog of 0")
        inode = os.lstat(path).st_ino
        with pytest.raises(BindError, match="may be in use"):
            listen_unix(path)
        assert os.lstat(path).st_ino == inode
    finally:
        for client in waiting:
            client.close()
        frozen.close()


# ---- JSONL size ---------------------------------------------------------------------------------


def test_overlong_jsonl_line_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(data_module, "MAX_LINE_BYTES", 1000)
    path = tmp_path / "data.jsonl"
    fits = json.dumps({"text": "x" * (1000 - 13)})  # 999 bytes + newline
    path.write_text(fits + "\n" + json.dumps({"text": "x" * 5000}) + "\n")
    with pytest.raises(DataError, match=r"data.jsonl:2: line longer than 1,000 bytes"):
        read_jsonl(path)
    path.write_text(fits + "\n")
    assert len(read_jsonl(path)[0].completion) == 987
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("short\n" + "y" * 2000)
    with pytest.raises(DataError, match=r"prompts.txt:2: line longer"):
        read_prompts(prompts)


def test_lines_split_at_newlines_only_and_must_be_utf8(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps({"text": "a\u2028b"}, ensure_ascii=False) + "\r\n")  # U+2028 is valid inside JSON
    assert read_jsonl(path)[0].completion == "a\u2028b"
    path.write_bytes(b'{"text": "fine"}\n{"text": "\xff"}\n')
    with pytest.raises(DataError, match=r"data.jsonl:2: not UTF-8"):
        read_jsonl(path)


class SpyTokenizer:
    """Wraps a tokenizer and records the length of every text it is given."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.lengths: list[int] = []
        self.eos_token_id = tokenizer.eos_token_id

    def __call__(self, text, **kwargs):
        self.lengths.append(len(text))
        return self.tokenizer(text, **kwargs)


def test_huge_record_is_cut_before_tokenizing(tiny_checkpoint):
    spy = SpyTokenizer(load_tokenizer(tiny_checkpoint("llama")))
    huge = "the quick brown fox " * 500_000  # 10 MB
    started = time.perf_counter()
    example = tokenize(spy, Record("question: " * 1000, huge), seq_len=16)
    assert time.perf_counter() - started < 2
    assert len(example.input_ids) == 16 and max(spy.lengths) < 10_000, spy.lengths


@pytest.mark.parametrize("seed", range(4))
def test_cut_text_gives_the_same_tokens(tiny_checkpoint, seed):
    tokenizer = load_tokenizer(tiny_checkpoint("llama"))
    rng = random.Random(seed)
    alphabet = ["the", "quick", "ABC", "=", " ", "  ", "\n", "é", "日本", "🙂", "x" * 40, ",", "'s"]
    text = "".join(rng.choice(alphabet) for _ in range(4000))
    prompt = "".join(rng.choice(alphabet) for _ in range(rng.choice([0, 5, 300])))
    for seq_len in (1, 16, 100, 700):
        full_prompt = tokenizer(prompt, add_special_tokens=False)["input_ids"] if prompt else []
        full = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        example = tokenize(tokenizer, Record(prompt, text), seq_len)
        assert example.input_ids == (full_prompt + full)[:seq_len]


# ---- tokenizers stay local ----------------------------------------------------------------------


def test_tokenizer_loads_local_files_only(tiny_checkpoint, monkeypatch):
    from transformers import AutoTokenizer

    calls = []
    original = AutoTokenizer.from_pretrained.__func__

    def spy(cls, *args, **kwargs):
        calls.append(kwargs)
        return original(cls, *args, **kwargs)

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", classmethod(spy))
    load_tokenizer(tiny_checkpoint("llama"))
    assert calls and all(kwargs.get("local_files_only") is True for kwargs in calls)


def test_generate_checks_the_model_folder_before_any_tokenizer(tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    def no_network(*args, **kwargs):
        raise AssertionError(f"a tokenizer was loaded for {args[-1]!r} before the folder was checked")

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", no_network)
    monkeypatch.chdir(tmp_path)
    options = GenerateOptions(model=Path("gpt2"), client=ClientOptions(embedded=True), prompts=["hi"])
    with pytest.raises(CheckpointError, match="'gpt2' does not exist"):
        generate(options)
