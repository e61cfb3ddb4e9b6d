"""``symbiosis serve --ready-file`` and ``ExecutorProcess``, the one way an executor process is started
(demo, benchmarks, tests): readiness from a JSON file, real addresses, stats over HTTP, clean exit."""

from __future__ import annotations

import json
import os
import signal

import pytest
import torch
from transformers import AutoModelForCausalLM

import symbiosis
from symbiosis.executor.process import ExecutorProcess, ExecutorProcessError
from symbiosis.executor.weights import BaseModelWeights


@pytest.mark.slow
def test_ready_file_names_the_real_addresses_and_the_checkpoint(tiny_checkpoint, tmp_path):
    path = tiny_checkpoint("llama")
    binds = ["tcp://127.0.0.1:0", f"ipc://{tmp_path}/executor.sock"]
    with ExecutorProcess(path, binds, metrics=True, threads=1) as executor:
        info = executor.info
        written = json.loads(executor.ready_file.read_text())
        assert written["addresses"] == info.addresses and written["pid"] == executor.pid == info.pid
        tcp, ipc = info.addresses
        assert tcp.startswith("tcp://127.0.0.1:") and not tcp.endswith(":0"), "the port the kernel chose, not 0"
        assert ipc == binds[1]
        expected = BaseModelWeights.load(path, device=torch.device("cpu"), dtype=torch.float32)
        assert info.fingerprint == expected.fingerprint and info.model_type == "llama"
        # The forms of decode-sized products were timed before it said ready (``BaseExecutor.warm_up``),
        # for the keys the server's thread looks up: decoding below adds none.
        forms = executor.stats()["matmul_forms"]
        assert sum(forms.values()) > 0 and "trials in" in executor.output()

        client = symbiosis.load_client_model(path, executor=tcp)
        ids = torch.tensor([[3, 4, 5, 6]])
        with torch.no_grad():
            torch.testing.assert_close(
                client(ids).logits, AutoModelForCausalLM.from_pretrained(path)(ids).logits, rtol=1e-4, atol=1e-5
            )
            client.generate(ids, max_new_tokens=3, do_sample=False)  # 1-row products
        client.symbiosis_transport.close()

        stats = executor.stats()
        assert stats["matmul_forms"] == forms
        assert sum(layer["requests"] for layer in stats["layers"].values()) > 0
        assert stats["weights_bytes"] == expected.nbytes() and stats["peak_rss_bytes"] > stats["weights_bytes"]
        # A CPU executor in its own process runs bulk products on a background thread by default.
        assert stats["scheduler"]["config"]["bulk_lane"] == "background" and "bulk_thread" in stats["batches_run_by"]
        ready_file = executor.ready_file
    assert executor.process.returncode == 0, executor.output()
    assert not ready_file.exists()


@pytest.mark.slow
def test_a_process_that_cannot_start_is_a_typed_error_quoting_its_output(tmp_path):
    with pytest.raises(ExecutorProcessError) as failed:
        ExecutorProcess(tmp_path / "no-such-model", ["tcp://127.0.0.1:0"], timeout_s=60)
    assert "exited with code 2" in str(failed.value) and "no-such-model" in str(failed.value)


@pytest.mark.slow
def test_stats_need_the_metrics_endpoint_and_sigkill_is_reported(tiny_checkpoint, tmp_path):
    with ExecutorProcess(tiny_checkpoint("llama"), [f"ipc://{tmp_path}/e.sock"]) as executor:
        with pytest.raises(ExecutorProcessError, match="metrics=True"):
            executor.stats()
        executor.signal(signal.SIGKILL)
        assert executor.wait(timeout_s=30) == -signal.SIGKILL


@pytest.mark.slow
def test_an_owner_that_dies_on_an_exception_leaves_no_executor_running(tiny_checkpoint, tmp_path):
    """A script that starts an executor process and then fails (an uncaught exception, no
    ``close``) used to leave ``symbiosis serve`` running with nobody to serve; now its exit stops it."""
    import subprocess
    import sys

    path = tiny_checkpoint("llama")
    pid_file = tmp_path / "pid"
    script = (
        "from symbiosis.executor.process import ExecutorProcess\n"
        f"executor = ExecutorProcess({str(path)!r}, [{f'ipc://{tmp_path}/executor.sock'!r}], threads=1)\n"
        f"open({str(pid_file)!r}, 'w').write(str(executor.pid))\n"
        "raise RuntimeError('the owner fails')\n"
    )
    completed = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=180)
    assert "the owner fails" in completed.stderr
    pid = int(pid_file.read_text())
    with pytest.raises(ProcessLookupError):  # reaped by the owner's exit, not merely signalled
        os.kill(pid, 0)
