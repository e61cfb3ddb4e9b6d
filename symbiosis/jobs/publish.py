"""Publishing a fine-tuning job's adapter to a running ``symbiosis api`` server while it trains.

Every ``every`` optimizer steps (and after the last) the job saves its LoRA adapter into a
folder of its own (``OUTPUT.run/published/step-N``) and asks the server to load it under
``name`` (``POST /v1/load_lora_adapter``, the server needs ``--allow-adapter-updates``). New
requests for ``name`` then use the newest weights; sequences already running keep theirs. The
server reads the folder on the same host, so it must see the job's file system.

A server that cannot be reached does not stop training: the failure is reported once on stderr
and the next publication tries again.
"""

from __future__ import annotations

import json
import shutil
import sys
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from symbiosis.jobs.base import JobError

KEEP_PUBLISHED = 2  # older published folders are removed (the server holds what it loaded)


@dataclass(frozen=True)
class PublishOptions:
    url: str  # the server's base URL, e.g. http://127.0.0.1:8000
    name: str  # the adapter name requests will use
    every: int = 50
    api_key: str | None = None


class AdapterPublisher:
    """An ``on_step`` callback of ``FinetuneRun.train`` that publishes the adapter as it trains."""

    def __init__(self, options: PublishOptions, model, folder: Path) -> None:
        if options.every < 1:
            raise JobError("--publish-every must be at least 1")
        from symbiosis.serving.lora import unservable

        config = getattr(model, "peft_config", {}).get("default")
        # What the server would refuse at every publication, refused before training: LoRA on MoE
        # experts (finetune's all-linear on an MoE model), DoRA, another method.
        reason = unservable(config.to_dict()) if config is not None else "is not a peft adapter"
        if reason is not None:
            raise JobError(f"--publish-to needs an adapter the api server serves; this job's adapter {reason}")
        self.options = options
        self.model = model
        self.folder = Path(folder)
        self.published: list[int] = []  # steps whose adapter the server accepted
        self._reported_failure = False

    def __call__(self, record) -> None:
        if record.step % self.options.every == 0 or record.step == record.total_steps:
            self.publish(record.step)

    def publish(self, step: int) -> bool:
        target = self.folder / f"step-{step}"
        self.model.save_pretrained(str(target))
        try:
            self._post({"lora_name": self.options.name, "lora_path": str(target.resolve())})
        except (OSError, urllib.error.URLError) as exc:
            shutil.rmtree(target, ignore_errors=True)
            if not self._reported_failure:
                print(
                    f"warning: could not publish adapter {self.options.name!r} to {self.options.url}: {exc}",
                    file=sys.stderr,
                )
                self._reported_failure = True
            return False
        self.published.append(step)
        self._prune()
        return True

    def _post(self, body: dict) -> None:
        headers = {"Content-Type": "application/json"}
        if self.options.api_key:
            headers["Authorization"] = f"Bearer {self.options.api_key}"
        url = self.options.url.rstrip("/") + "/v1/load_lora_adapter"
        request = urllib.request.Request(url, json.dumps(body).encode(), headers=headers, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=30):
                pass
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")[:300]
            raise OSError(f"HTTP {exc.code}: {detail}") from None

    def _prune(self) -> None:
        for step in self.published[:-KEEP_PUBLISHED]:
            shutil.rmtree(self.folder / f"step-{step}", ignore_errors=True)
