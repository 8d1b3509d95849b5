"""A context saved to disk: an engine's cached tokens with every layer's rows, so a later process resumes it in
the time it takes to read them instead of prefilling again.

One safetensors file (never pickle), written under a temporary name and renamed (a crash leaves no half file):
    token_ids        [n] int32, the tokens whose rows the cache holds
    latent.L         [n, width] layer L's latent rows as stored (uint8 FP8 rows, or the model dtype's bits as uint16)
    keys.L           [n, index_head_dim] a full layer's indexer keys as stored (e4m3 bytes, or uint16 bits); with
                     GLM-5.3-Flash's pooled indexer one key per group of index_kpool tokens
    key_scales.L     [n] fp32, with FP8 keys
    kda.L.state, kda.L.conv, tail_keys.L, tail_gates.L
                     the fixed-size states (GLM-5.3-Flash): a KDA layer's recurrent state and last conv inputs, a
                     pooled indexer's current group (KVCache.states)
and in its metadata the format and version, the model's identity (config.json's sha256, the weights' fingerprint:
file names, sizes and times), the cache's form (each layer's row form), the placement that computed the rows (a
digest of each slot's operator, device and kwargs, and the dtype) and a CRC-32 of every 64 MiB of every tensor.
The arrays are written straight from the cache's memory (no copy) while a pool of threads computes the CRCs.

Loading checks the header, the identity, the form and every tensor's name, dtype, shape and CRC before the engine's
cache takes any of it: a truncated, foreign or corrupt file is refused in one line and the engine keeps what it had.
Rows computed under another placement of the same weights (other formats, operators or dtype) are resumed with a
warning: they are the same context, but not the bits a fresh prefill under this one would give.
Rows are read from a memory map straight into their place (pinned host memory for tiered layers, the GPU otherwise).
"""

import hashlib
import json
import logging
import os
import struct
import warnings
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from ..checkpoint import MAPPED_DTYPES, check_shard, fingerprint, memory_map
from ..errors import Glm5Error
from .engine import Engine
from .kv_cache import new_cache

FORMAT, VERSION = "glm5-offload context", 1
_BITS = {1: np.uint8, 2: np.uint16, 4: np.float32}  # element size -> how the bytes are stored
_HEADER_DTYPES = {np.dtype(v): k for k, v in MAPPED_DTYPES.items()}  # what memory_map reads back
CHUNK = 64 << 20  # bytes under one CRC-32
_pool = ThreadPoolExecutor(min(16, os.cpu_count() or 1), thread_name_prefix="context-crc")  # zlib frees the GIL
log = logging.getLogger("glm5_offload")


def _chunks(a: np.ndarray) -> list[memoryview]:
    flat = memoryview(np.ascontiguousarray(a).reshape(-1).view(np.uint8))
    return [flat[i : i + CHUNK] for i in range(0, len(flat), CHUNK)]


def _write_safetensors(path: Path, arrays: dict[str, np.ndarray], metadata: dict[str, str]):
    """A safetensors file written straight from the arrays' memory (safetensors.numpy.save_file copies each), the
    CRCs computed by the pool while the data is written: the header goes first with room for them, then again."""
    crcs = {name: [_pool.submit(zlib.crc32, chunk) for chunk in _chunks(a)] for name, a in arrays.items()}

    def header(crc: dict) -> bytes:
        head, offset = {"__metadata__": {**metadata, "crc32": json.dumps(crc)}}, 0
        for name, a in arrays.items():
            head[name] = {"dtype": _HEADER_DTYPES[a.dtype], "shape": list(a.shape),
                          "data_offsets": [offset, offset + a.nbytes]}
            offset += a.nbytes
        text = json.dumps(head, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
        return struct.pack("<Q", len(text)) + text

    room = header({name: ["0" * 8] * len(futures) for name, futures in crcs.items()})
    with open(path, "wb") as f:
        f.write(room)
        for a in arrays.values():
            for chunk in _chunks(a):
                f.write(chunk)
        final = header({name: [f"{future.result():08x}" for future in futures] for name, futures in crcs.items()})
        assert len(final) == len(room)  # fixed-width CRCs: the header keeps its size
        f.seek(0)
        f.write(final)
        f.flush()
        os.fsync(f.fileno())


def identity(engine: Engine) -> dict:
    """What a saved context must match: the model's config and weights, and the cache's form."""
    model = engine.model
    config_path = Path(model.config.path)
    form = [{"kda": True} if layout is None else {"rows": "fp8" if layout.fp8 else str(model.dtype),
                                                  "keys": layout.index_device is not None}
            for layout in (getattr(layer.self_attn, "latent_layout", None) for layer in model.model.layers)]
    return {"config_sha256": hashlib.sha256(config_path.read_bytes()).hexdigest(),
            "weights": fingerprint(config_path.parent), "form": form}


# kwargs that say where and when an operator works, not what it computes: left out of the placement's digest
SCHEDULING_KWARGS = {"threads", "cache_dir", "gpu_ring", "pin_experts", "in_memory", "hot_budget", "window"}


def placement_digest(engine: Engine) -> str:
    """What computed the rows: every slot's operator, device and kwargs (but SCHEDULING_KWARGS), and the model's
    dtype, as a sha256."""
    model = engine.model
    placed = getattr(model, "placement", None)  # (a model the loader did not build has none)
    slots = [] if placed is None else [
        (name, slot.op.name, slot.device, {k: v for k, v in slot.kwargs.items() if k not in SCHEDULING_KWARGS})
        for name, slot in sorted(placed.slots.items())]
    text = json.dumps([str(model.dtype), slots], sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def _as_bytes(t: torch.Tensor) -> np.ndarray:
    """A CPU tensor's bits as a numpy array of a plain dtype (uint8, uint16 or float32)."""
    t = t.detach().cpu().contiguous()
    if t.dtype == torch.float32:
        return t.numpy()
    return t.view({1: torch.uint8, 2: torch.int16}[t.element_size()]).numpy().view(_BITS[t.element_size()])


def save_context(engine: Engine, path: str | Path) -> int:
    """Write the engine's cached context to path (atomically); the number of tokens saved."""
    path = Path(path)
    cache = engine.cache
    n = 0 if cache is None else cache.length
    arrays = {"token_ids": np.asarray(engine.cache_ids[:n], dtype=np.int32)}
    if cache is not None:
        arrays.update({name: _as_bytes(t) for name, t in cache.saved_tensors(n).items()})
    metadata = {"format": FORMAT, "version": str(VERSION), "tokens": str(n), "identity": json.dumps(identity(engine)),
                "placement": placement_digest(engine)}
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        _write_safetensors(tmp, arrays, metadata)
        os.replace(tmp, path)
    except BaseException as e:  # a disk error, Ctrl-C or SIGTERM mid-write: no partial file is left (up to 54 GB)
        tmp.unlink(missing_ok=True)
        if isinstance(e, OSError):
            raise Glm5Error(f"{path}: cannot write the context ({e.strerror})") from None
        raise
    return n


def load_context(engine: Engine, path: str | Path) -> int:
    """Restore a context saved by save_context into the engine (its cache replaced); the number of tokens. The next
    generate() reuses the longest prefix its prompt shares with them."""
    path = Path(path)
    try:
        _, header = check_shard(path)
    except OSError as e:
        raise Glm5Error(f"{path}: cannot read the context ({e.strerror})") from None
    meta = header.get("__metadata__") or {}
    if meta.get("format") != FORMAT:
        raise Glm5Error(f"{path}: not a saved glm5-offload context")
    if meta.get("version") != str(VERSION):
        raise Glm5Error(f"{path}: a context of format version {meta.get('version')}, this engine reads {VERSION}")
    try:
        saved, crc, n = json.loads(meta["identity"]), json.loads(meta["crc32"]), int(meta["tokens"])
    except (KeyError, ValueError, TypeError, RecursionError):
        raise Glm5Error(f"{path}: corrupt context metadata") from None
    mine = identity(engine)
    for key, what in (("config_sha256", "another model's config.json"), ("weights", "other weights"),
                      ("form", "another cache form (--kv-dtype, the rules' kv_dtype, or the dtype)")):
        if saved.get(key) != mine[key]:
            raise Glm5Error(f"{path}: saved with {what}: this engine cannot resume it")
    if n > engine.max_seq_len:
        raise Glm5Error(f"{path}: {n} tokens do not fit max_seq_len {engine.max_seq_len}")
    if n == 0 and sorted(crc) == ["token_ids"]:  # saved before any run (a cache not yet made): an empty context
        engine.reset()
        return 0
    arrays = memory_map(path)
    if engine.cache is None:
        engine.cache = new_cache(engine.model, engine.max_seq_len)
    cache = engine.cache
    targets = {"token_ids": None, **cache.saved_tensors(n)}
    if sorted(arrays) != sorted(targets) or sorted(crc) != sorted(targets):
        raise Glm5Error(f"{path}: its tensors are not this model's cache")
    for name, target in targets.items():
        want = (n,) if target is None else tuple(target.shape)
        if arrays[name].shape != want or (target is not None and arrays[name].itemsize != target.element_size()):
            raise Glm5Error(f"{path}: tensor {name} has shape {arrays[name].shape}, expected {want}")
    chunks = [(name, chunk) for name in targets for chunk in _chunks(arrays[name])]  # every tensor's, checked at once
    found: dict[str, list[str]] = {name: [] for name in targets}
    for (name, _), c in zip(chunks, _pool.map(zlib.crc32, [chunk for _, chunk in chunks])):
        found[name].append(f"{c:08x}")
    corrupt = [name for name in targets if found[name] != crc[name]]
    if corrupt:
        raise Glm5Error(f"{path}: tensor {corrupt[0]} is corrupt (its CRC-32 differs from the one saved)")
    ids = arrays["token_ids"]
    if n and (ids.min() < 0 or ids.max() >= engine.model.config.vocab_size):
        raise Glm5Error(f"{path}: token ids outside the vocabulary")
    ids = ids.tolist()
    placement = placement_digest(engine)
    if meta.get("placement", placement) != placement:  # (files written before it: unchecked)
        log.warning("%s: saved under another placement (rules, formats, operators, devices or dtype): its rows "
                    "resume as computed there; a fresh prefill under this one would round differently", path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # a read-only memory map: torch only reads it
        copies = []
        for name, target in targets.items():
            if target is None:
                continue
            source = torch.from_numpy(arrays[name])
            source = source if target.dtype == torch.float32 else source.view(target.dtype)
            rows = max(1, CHUNK // max(1, target[:1].nbytes))
            copies += [(target[i : i + rows], source[i : i + rows]) for i in range(0, target.shape[0], rows)]
        list(_pool.map(lambda pair: pair[0].copy_(pair[1]), copies))  # torch's copies free the GIL too
    engine.cache_ids = ids
    cache.replaced(n)
    return n
