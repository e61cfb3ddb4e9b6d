"""Which adapters the server can serve, and which of them sit in memory (an LRU pool).

Names come from ``--adapter NAME=DIR``, from every sub-folder of ``--adapter-dir`` that holds an
``adapter_config.json`` (looked up when asked, so folders added later are servable), and from
``POST /v1/load_lora_adapter``. Every adapter is checked before it is served or listed, by the
pool's ``check`` (the server's reads the config and the safetensors header, no tensors: a LoRA
adapter without DoRA and the like, whose modules and shapes are this model's): an ``--adapter``
that fails it stops the server at startup, and ``/v1/models`` leaves out the ``--adapter-dir``
folders that fail it (a request naming one gets the reason in a 400). At most ``max_loaded``
adapters are held in memory; the least recently used one that no running sequence holds is
dropped to make room, and is read again from its folder on next use.

Errors that reach HTTP clients name an adapter by its served name, never by its folder (the
server's log has the folder).

Replacing a name makes a new :class:`LoraAdapter`; a sequence keeps the object it started with,
so a replacement never changes an adapter mid-sequence.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

from symbiosis.errors import ERRORS_BY_CODE, ConfigurationError, SymbiosisError
from symbiosis.serving.lora import CONFIG_FILE, WEIGHTS_FILE, AdapterFormatError, LoraAdapter, check_lora_files

log = logging.getLogger("symbiosis.api")

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:\-]{0,127}$")


RECENT_WRITE_NS = 2_000_000_000  # a folder whose files were written this recently is checked again on the next listing


class UnknownAdapterError(SymbiosisError):
    """No adapter of that name is servable."""

    code = "unknown_adapter"


class AdapterPoolFullError(SymbiosisError):
    """Every loaded adapter is in use by a running sequence; the caller should wait."""

    code = "adapter_pool_full"


# They cross from the API server's engine process (``engine_process.py``) to its HTTP side.
ERRORS_BY_CODE.update({cls.code: cls for cls in (UnknownAdapterError, AdapterPoolFullError)})


def check_adapter_name(name: str) -> str:
    if not isinstance(name, str) or not _NAME.match(name):
        raise ConfigurationError(f"adapter name {name!r}: use 1-128 letters, digits, '.', '_', ':' or '-'")
    return name


class AdapterPool:
    """Servable adapter names → folders, and an LRU of loaded adapters with use counts."""

    def __init__(
        self,
        load: Callable[[str, Path], LoraAdapter],
        *,
        check: Callable[[str, Path], None] = check_lora_files,
        adapters: dict[str, Path] | None = None,
        adapter_dir: Path | None = None,
        max_loaded: int = 64,
        reserved_names: tuple[str, ...] = (),
    ) -> None:
        if max_loaded < 1:
            raise ConfigurationError("max_loaded_adapters must be at least 1")
        self._load = load
        self._check = check  # (name, folder): raises a SymbiosisError saying why it is not servable
        self._adapter_dir = Path(adapter_dir) if adapter_dir is not None else None
        self._explicit: dict[str, Path] = {}
        self._forgotten: set[str] = set()  # names under adapter_dir that were unloaded
        self._servable: dict[Path, tuple[tuple, bool]] = {}  # folder -> (its files' stat stamps, servable)
        self._loaded: OrderedDict[str, LoraAdapter] = OrderedDict()  # oldest use first
        self._users: dict[int, int] = {}  # id(adapter) -> running sequences holding it
        self._reserved = set(reserved_names)
        self.max_loaded = max_loaded
        self.loads = 0  # reads from disk (cold loads), for metrics and the benchmark
        self.load_seconds = 0.0  # time spent in those reads
        self._lock = threading.RLock()
        if self._adapter_dir is not None and not self._adapter_dir.is_dir():
            raise UnknownAdapterError(f"--adapter-dir {str(self._adapter_dir)!r} is not a folder")
        for name, path in (adapters or {}).items():
            self._register(name, Path(path))

    # ---- names ----------------------------------------------------------------------------------

    def _register(self, name: str, path: Path) -> None:
        check_adapter_name(name)
        if name in self._reserved:
            raise ConfigurationError(f"adapter name {name!r} is the base model's served name")
        try:  # fail now, not on a user's first request
            self._check(name, path)
        except SymbiosisError as exc:
            raise AdapterFormatError(f"--adapter {name}={path}: {exc}") from None
        self._explicit[name] = path
        self._forgotten.discard(name)

    def path_of(self, name: str) -> Path:
        """The folder of servable adapter ``name``; ``UnknownAdapterError`` if there is none."""
        with self._lock:
            if name in self._explicit:
                return self._explicit[name]
            if self._adapter_dir is not None and name not in self._forgotten and _NAME.match(name or ""):
                folder = self._adapter_dir / name
                if (folder / CONFIG_FILE).is_file():
                    return folder
        raise UnknownAdapterError(f"the model {name!r} does not exist")

    def names(self) -> list[str]:
        with self._lock:
            names = set(self._explicit)
            if self._adapter_dir is not None:
                listed = [f for f in self._adapter_dir.iterdir() if _NAME.match(f.name)]
                names.update(f.name for f in listed if self._folder_is_servable(f))
                folders = set(listed)
                self._servable = {k: v for k, v in self._servable.items() if k in folders}  # folders removed
            return sorted(names - self._forgotten - self._reserved)

    def _folder_is_servable(self, folder: Path) -> bool:
        """Whether ``folder`` holds an adapter that passes ``check``; checked again only when its
        config or weights file changes (a folder of thousands of adapters is listed on every
        ``/v1/models``: two ``stat`` calls an adapter, ~15 ms for 1,000; the first check ~150 ms)."""
        stamps = []
        for file in (CONFIG_FILE, WEIGHTS_FILE):
            try:
                status = (folder / file).stat()
            except OSError:
                if file == CONFIG_FILE:
                    return False  # not an adapter folder
                stamps.append(None)  # no weights yet (a job may be writing them): judged again once they come
                continue
            stamps.append((status.st_mtime_ns, status.st_ctime_ns, status.st_size, status.st_ino))
        stamp = tuple(stamps)
        known = self._servable.get(folder)
        if known is None or known[0] != stamp:
            try:
                self._check(folder.name, folder)
                servable = True
            except SymbiosisError:
                servable = False
            known = (stamp, servable)
            # A file written within the clock's granularity of now may change again under the
            # same stamp (a copy that truncated first): judge it again next time (git's "racily clean").
            newest = max(s[0] for s in stamps if s is not None)
            if time.time_ns() - newest > RECENT_WRITE_NS:
                self._servable[folder] = known
        return known[1]

    # ---- loading ----------------------------------------------------------------------------------

    def acquire(self, name: str) -> LoraAdapter:
        """The current adapter ``name``, loaded if needed, held until :meth:`release`.

        ``AdapterPoolFullError`` when the pool is full of adapters in use (try again later).
        """
        with self._lock:
            adapter = self._loaded.get(name)
            if adapter is None:
                path = self.path_of(name)
                self._make_room()
                started = time.perf_counter()
                adapter = self._load_logged(name, path)
                self.load_seconds += time.perf_counter() - started
                self.loads += 1
                self._loaded[name] = adapter
            self._loaded.move_to_end(name)
            self._users[id(adapter)] = self._users.get(id(adapter), 0) + 1
            return adapter

    def can_acquire(self, name: str) -> bool:
        with self._lock:
            return name in self._loaded or len(self._loaded) < self.max_loaded or self._evictable() is not None

    def release(self, adapter: LoraAdapter) -> None:
        with self._lock:
            left = self._users.get(id(adapter), 0) - 1
            if left > 0:
                self._users[id(adapter)] = left
            else:
                self._users.pop(id(adapter), None)
            self._trim()

    def load(self, name: str, path: Path) -> LoraAdapter:
        """Load (or replace) ``name`` from ``path`` now; new requests use it, running ones keep theirs."""
        check_adapter_name(name)
        if name in self._reserved:
            raise ConfigurationError(f"adapter name {name!r} is the base model's served name")
        adapter = self._load_logged(name, Path(path))  # outside the lock: reading may take a while
        with self._lock:
            self._explicit[name] = Path(path)
            self._forgotten.discard(name)
            self._loaded[name] = adapter
            self._loaded.move_to_end(name)
            self.loads += 1
            self._trim()
        return adapter

    def unload(self, name: str) -> None:
        """Forget ``name``: new requests get 404; running sequences finish with what they hold."""
        with self._lock:
            self.path_of(name)  # UnknownAdapterError if not servable
            self._explicit.pop(name, None)
            self._loaded.pop(name, None)
            if self._adapter_dir is not None:
                self._forgotten.add(name)

    def _load_logged(self, name: str, path: Path) -> LoraAdapter:
        """``load``; a refusal is logged with the folder (the client's error names only ``name``)."""
        try:
            return self._load(name, path)
        except AdapterFormatError as exc:
            log.warning("%s [folder %s]", exc, path)
            raise

    @property
    def loaded_count(self) -> int:
        with self._lock:
            return len(self._loaded)

    def _evictable(self) -> str | None:
        for name, adapter in self._loaded.items():  # oldest first
            if id(adapter) not in self._users:
                return name
        return None

    def _make_room(self) -> None:
        while len(self._loaded) >= self.max_loaded:
            victim = self._evictable()
            if victim is None:
                raise AdapterPoolFullError(f"all {self.max_loaded} loaded adapters are in use")
            del self._loaded[victim]

    def _trim(self) -> None:
        while len(self._loaded) > self.max_loaded and (victim := self._evictable()) is not None:
            del self._loaded[victim]
