"""A disk store: arrays made from a checkpoint (converted experts), kept as safetensors files in one folder per
(checkpoint, key), under a manifest that records the checkpoint's fingerprint.

Files are written under a temporary name and renamed, so a crash never leaves a half-written entry; entries are
read back as memory maps. A checkpoint whose files changed (another fingerprint), or a store of another version,
reads as empty, and its entries are made again.
"""

import hashlib
import json
import os
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from .checkpoint import fingerprint, memory_map


class DiskStore:
    def __init__(self, root: Path, source: Path, key: dict, version: int):
        """root: the folder of stores; source: the checkpoint directory; key: what else tells entries apart (a
        format, a group size); version: of the entries' layout."""
        self.root, self.source, self.key, self.version = root, source, key, version
        ident = json.dumps([str(source.resolve()), *key.values(), version])
        self.folder = root / hashlib.sha256(ident.encode()).hexdigest()[:16]

    def manifest(self) -> dict:
        try:
            manifest = json.loads((self.folder / "manifest.json").read_text())
        except (OSError, json.JSONDecodeError, UnicodeDecodeError):
            return {}
        same = (isinstance(manifest, dict) and manifest.get("fingerprint") == fingerprint(self.source)
                and manifest.get("version") == self.version and isinstance(manifest.get("files"), dict))
        return manifest if same else {}

    def load(self, name: str) -> dict[str, np.ndarray] | None:
        """The entry's arrays, memory-mapped, or None if the store lacks it."""
        file = self.manifest().get("files", {}).get(name)
        if not isinstance(file, str) or not (self.folder / file).is_file():
            return None
        return memory_map(self.folder / file)

    def store(self, name: str, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Write an entry (atomically) and return it memory-mapped."""
        self.folder.mkdir(parents=True, exist_ok=True)
        file = f"{name}.safetensors"
        tmp = self.folder / f".{file}.tmp"
        save_file(arrays, str(tmp))
        os.replace(tmp, self.folder / file)
        manifest = self.manifest() or {"source": str(self.source.resolve()), "fingerprint": fingerprint(self.source),
                                       "version": self.version, "key": self.key, "files": {}}
        manifest["files"][name] = file
        tmp = self.folder / ".manifest.json.tmp"
        tmp.write_text(json.dumps(manifest, indent=2))
        os.replace(tmp, self.folder / "manifest.json")
        return memory_map(self.folder / file)
