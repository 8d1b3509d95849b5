"""Saving and loading a context (runtime/saved_context.py) beside the disk's own sequential write and read speed,
measured in the same run on the same folder, and the projection to the full model's context.

The bench model's cache is filled with random rows (no prefill: the bytes are what is timed; bench/profile_prefill.py
fills its context so too), --context tokens of a GLM-5-shaped checkpoint cut to a few layers, placed by --rules.
Writes are timed to the end of an fsync. Reads are cold: the file's pages are dropped from the page cache first
(posix_fadvise DONTNEED, clean pages after the fsync), the context's and the disk test file's alike; the context is
then loaded a second time from the page cache (warm): a cold load as fast as the warm one means the drop did not
take (a tmpfs folder, say).

    PYTHONPATH=.:bench python3 bench/bench_context.py --dir /tmp/g52 [--preset glm-5.2 --layers 2 --fp8]
        [--rules glm5] [--context 1048576] [--folder /tmp] [--json FILE]
"""

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np
import torch

from glm5_offload.config import load_config
from glm5_offload.formats.kv_rows import FP8Keys, quantize_keys, quantize_latent
from glm5_offload.loader import load_model
from glm5_offload.model import build_model
from glm5_offload.model.pooled_indexer import PooledKeys
from glm5_offload.planner import make_plan
from glm5_offload.rules import load_rules, place
from glm5_offload.runtime.engine import Engine
from glm5_offload.runtime.kv_cache import new_cache
from glm5_offload.runtime.saved_context import load_context, save_context
from glm5_offload.runtime.tiered_kv import TieredLatent
from glm5_offload.tiny import make_tiny


def fill(engine: Engine, n: int):
    """n tokens of random cache rows and ids, as if prefilled: normal values in each store's form (FP8 rows and keys
    quantised from them, so that scores and attention over them stay finite). GLM-5.3-Flash: a pooled indexer's key
    a complete group (the open group's keys and the KDA layers' states stay zeros, values a prefill could leave)."""
    cache = engine.cache = new_cache(engine.model, engine.max_seq_len)
    config, device = engine.model.config, engine.model.device
    for first in range(0, n, 1 << 16):
        rows = slice(first, min(n, first + (1 << 16)))
        m = rows.stop - rows.start
        for latent in cache.latent:
            if latent is None:  # a KDA layer's
                continue
            store = latent.host if isinstance(latent, TieredLatent) else latent
            values = torch.randn(m, config.latent_dim, device=device)
            store[rows].copy_(quantize_latent(values, config.kv_lora_rank) if store.dtype == torch.uint8
                              else values.to(store.dtype))
        for keys in cache.index_keys.values():
            values = torch.randn(m, config.index_head_dim, device=device)
            if isinstance(keys, PooledKeys):
                groups = slice(rows.start // config.index_kpool, rows.stop // config.index_kpool)
                keys.groups[groups].copy_(values[: groups.stop - groups.start].to(keys.groups.dtype))
            elif isinstance(keys, FP8Keys):
                k8, scales = quantize_keys(values)
                keys.values[rows].copy_(k8)
                keys.scales[rows].copy_(scales)
            else:
                keys[rows].copy_(values.to(keys.dtype))
    cache.replaced(n)
    engine.cache_ids = torch.randint(0, config.vocab_size, (n,)).tolist()


def drop_cached(path: Path):
    """Drop path's pages from the page cache (written and fsynced: clean), so that its next read comes from the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def disk_speeds(folder: Path, nbytes: int) -> tuple[float, float]:
    """Sequential write (to the end of an fsync) and cold read of one file of nbytes, in GB/s."""
    path = folder / "bench_context_disk.bin"
    data = np.random.randint(0, 255, nbytes, dtype=np.uint8)  # as large as the context: written from RAM, once
    block = np.empty(64 << 20, dtype=np.uint8)
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        for i in range(0, nbytes, block.nbytes):
            f.write(memoryview(data)[i : i + block.nbytes])
        f.flush()
        os.fsync(f.fileno())
    write = path.stat().st_size / (time.perf_counter() - t0) / 1e9
    drop_cached(path)
    t0 = time.perf_counter()
    with open(path, "rb") as f:
        while f.readinto(block):
            pass
    read = path.stat().st_size / (time.perf_counter() - t0) / 1e9
    path.unlink()
    return write, read


def run(args) -> dict:
    path = Path(args.dir)
    if not (path / "config.json").exists():
        make_tiny(path, preset=None if args.preset == "tiny" else args.preset, layers=args.layers, fp8=args.fp8)
    rules = load_rules(args.rules)
    engine = Engine(load_model(path, rules=rules, device=args.device), max_seq_len=args.context)
    fill(engine, args.context)
    file = Path(args.folder) / "bench_context.safetensors"
    t0 = time.perf_counter()
    save_context(engine, file)
    with open(file, "rb+") as f:
        os.fsync(f.fileno())
    save_s = time.perf_counter() - t0
    size = file.stat().st_size
    ids = list(engine.cache_ids)
    fresh = Engine(engine.model, max_seq_len=args.context)
    t0 = time.perf_counter()  # the fresh engine's cache (pinned host rows), as its first prompt would allocate it
    fresh.cache = new_cache(fresh.model, fresh.max_seq_len)
    allocate_s = time.perf_counter() - t0
    drop_cached(file)
    t0 = time.perf_counter()
    load_context(fresh, file)
    load_s = time.perf_counter() - t0
    assert fresh.cache_ids == ids
    t0 = time.perf_counter()
    load_context(fresh, file)  # again, from the page cache
    warm_load_s = time.perf_counter() - t0
    file.unlink()
    write, read = disk_speeds(Path(args.folder), size)
    config = load_config(args.full)
    plan = make_plan(config, place(build_model(config), rules), args.context, {})  # rows in host memory, keys
    full_bytes = sum(d.latent_kv for d in plan.devices if d.device == "cpu") + sum(d.indexer_keys for d in plan.devices)
    return {"layers": engine.model.config.num_hidden_layers, "context": args.context, "file_bytes": size,
            "save_s": save_s, "save_gb_s": size / save_s / 1e9, "allocate_s": allocate_s, "load_s": load_s,
            "load_gb_s": size / load_s / 1e9, "warm_load_gb_s": size / warm_load_s / 1e9,
            "disk_write_gb_s": write, "disk_read_gb_s": read, "full_model": args.full, "full_context_bytes": full_bytes,
            "full_save_s_projected": full_bytes / (size / save_s),
            "full_load_s_projected": full_bytes / (size / load_s)}


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", required=True)
    parser.add_argument("--preset", default="glm-5.2", help="the checkpoint's dims (tiny: the small test model's)")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--fp8", action="store_true")
    parser.add_argument("--rules", default="glm5")
    parser.add_argument("--device", default=None)
    parser.add_argument("--context", type=int, default=1 << 20)
    parser.add_argument("--folder", default="/tmp", help="where the context and the disk test file are written")
    parser.add_argument("--full", default="glm-5.2")
    parser.add_argument("--json")
    args = parser.parse_args()
    r = run(args)
    print(f"{r['layers']}-layer model, {r['context']} tokens: file {r['file_bytes'] / 1e9:.2f} GB; "
          f"save {r['save_s']:.2f} s "
          f"({r['save_gb_s']:.2f} GB/s = {r['save_gb_s'] / r['disk_write_gb_s']:.0%} of the disk's sequential write "
          f"{r['disk_write_gb_s']:.2f} GB/s); load {r['load_s']:.2f} s ({r['load_gb_s']:.2f} GB/s = "
          f"{r['load_gb_s'] / r['disk_read_gb_s']:.0%} of its read {r['disk_read_gb_s']:.2f} GB/s, both cold; "
          f"{r['warm_load_gb_s']:.2f} GB/s from the page cache), after {r['allocate_s']:.2f} s allocating the fresh "
          f"engine's cache")
    print(f"{r['full_model']} at {r['context']} tokens: {r['full_context_bytes'] / 1e9:.1f} GB of rows and keys: save "
          f"~{r['full_save_s_projected']:.0f} s, load ~{r['full_load_s_projected']:.0f} s at these speeds")
    if args.json:
        Path(args.json).write_text(json.dumps(r, indent=1))
