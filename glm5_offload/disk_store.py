"""A disk store: arrays made from a checkpoint (converted experts), kept as safetensors files in one folder per
(checkpoint, key), under a manifest that records the checkpoint's fingerprint.

Files are written under a temporary name and renamed, so a crash never leaves a half-written entry; entries are
read back as memory maps, or into memory of their own (checkpoint.read_into_memory). A checkpoint whose files
changed (another fingerprint), or a store of another version, reads as empty, and its entries are made again. So
does an entry whose file is not as it was written (its size, modification time and header, recorded in the
manifest): truncated, emptied, written over or retyped, it is reported once and made again rather than read.
"""

import hashlib
import json
import logging
import os
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from .checkpoint import check_shard, fingerprint, memory_map, read_into_memory
from .errors import Glm5Error

log = logging.getLogger("glm5_offload")


def _stamp(path: Path) -> dict:
    """What identifies a written file: size, modification time and its safetensors header's digest."""
    n, _ = check_shard(path)
    with open(path, "rb") as f:
        header = f.read(8 + n)
    st = path.stat()
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "header_sha256": hashlib.sha256(header).hexdigest()}


class DiskStore:
    def __init__(self, root: Path, source: Path, key: dict, version: int):
        """root: the folder of stores; source: the checkpoint directory; key: what else tells entries apart (a
        format, a group size); version: of the entries' layout."""
        self.source, self.key, self.version = source, key, version
        ident = json.dumps([str(source.resolve()), *key.values(), version])
        self.folder = root / hashlib.sha256(ident.encode()).hexdigest()[:16]

    def manifest(self) -> dict:
        try:
            manifest = json.loads((self.folder / "manifest.json").read_text())
        except (OSError, json.JSONDecodeError, UnicodeDecodeError, RecursionError):
            return {}
        same = (isinstance(manifest, dict) and manifest.get("fingerprint") == fingerprint(self.source)
                and manifest.get("version") == self.version and isinstance(manifest.get("files"), dict))
        return manifest if same else {}

    def load(self, name: str, in_memory: bool = False) -> dict[str, np.ndarray] | None:
        """The entry's arrays, memory-mapped (or read into memory), or None if the store lacks it or its file is not
        as written."""
        entry = self.manifest().get("files", {}).get(name)
        if not isinstance(entry, dict) or not isinstance(entry.get("file"), str):
            return None
        path = self.folder / entry["file"]
        try:
            if _stamp(path) != {k: entry.get(k) for k in ("size", "mtime_ns", "header_sha256")}:
                raise Glm5Error(f"{path}: its size, time or header changed since it was written")
            return (read_into_memory if in_memory else memory_map)(path)
        except OSError as e:
            log.warning("%s: stored %s cannot be read (%s): making it again", path, name, e.strerror)
        except Glm5Error as e:
            log.warning("%s: making it again", e)
        return None

    def store(self, name: str, arrays: dict[str, np.ndarray], in_memory: bool = False) -> dict[str, np.ndarray]:
        """Write an entry (atomically) and return it memory-mapped (or read into memory)."""
        self.folder.mkdir(parents=True, exist_ok=True)
        tmp = self.folder / f".{name}.safetensors.tmp"
        save_file(arrays, str(tmp))
        return (read_into_memory if in_memory else memory_map)(self._enter(name, tmp))

    def link(self, name: str, other: "DiskStore") -> None:
        """Enter other's entry `name` here as a hard link to its file (if other has it): for a checkpoint that holds
        the same tensors (a cut of another, bench/bench_e2e.py), the arrays without converting them again."""
        entry = other.manifest().get("files", {}).get(name)
        if isinstance(entry, dict) and isinstance(entry.get("file"), str):
            self.folder.mkdir(parents=True, exist_ok=True)
            tmp = self.folder / f".{name}.safetensors.tmp"
            tmp.unlink(missing_ok=True)
            os.link(other.folder / entry["file"], tmp)
            self._enter(name, tmp)

    def _enter(self, name: str, tmp: Path) -> Path:
        """Rename tmp to entry `name`'s file and record it in the manifest; the file's path."""
        path = self.folder / f"{name}.safetensors"
        os.replace(tmp, path)
        manifest = self.manifest() or {"source": str(self.source.resolve()), "fingerprint": fingerprint(self.source),
                                       "version": self.version, "key": self.key, "files": {}}
        manifest["files"][name] = {"file": path.name, **_stamp(path)}
        tmp = self.folder / ".manifest.json.tmp"
        tmp.write_text(json.dumps(manifest, indent=2))
        os.replace(tmp, self.folder / "manifest.json")
        return path
