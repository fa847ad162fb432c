"""The salt of the feedback store's visitor keys (``finetune.feedback.visitor_key``): 32 random
bytes in a file beside the store, mode 0600, created once whatever the concurrency, never sent anywhere."""

from __future__ import annotations

import os
import secrets
from pathlib import Path

_SALTS: dict[Path, bytes] = {}  # a salt never changes once written: read each file once per process


def read_salt(path: Path) -> bytes:
    """The salt at ``path``: 32 random bytes, mode 0600, created once whatever the concurrency."""
    path = path.resolve()
    if path not in _SALTS:
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
            try:
                with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as fh:
                    fh.write(secrets.token_bytes(32))
                    os.fsync(fh.fileno())
                try:
                    os.link(tmp, path)  # create-once: a salt another process wrote first is never replaced
                except FileExistsError:
                    pass
                except OSError:  # a filesystem without hard links: a rename (a race costs one key change)
                    os.replace(tmp, path)
            finally:
                tmp.unlink(missing_ok=True)
        salt = path.read_bytes()
        if len(salt) < 16:
            raise ValueError(f"the visitor salt {path} is damaged; remove it to start a new one")
        _SALTS[path] = salt
    return _SALTS[path]
