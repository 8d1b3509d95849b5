"""A checkpoint directory: safetensors shards, located and checked from their headers before any data is read, then
read tensor by tensor as the operators ask for them.

Reads `model.safetensors.index.json` and its shards, or one `model.safetensors`; pickle files are never loaded.
Accepts bf16, fp16 and fp32 tensors, and FP8 e4m3 weights with a `weight_scale_inv` sibling (the block of
config.json's fp8 quantization_config), which read as their dequantised values (formats.fp8_blocks). The MTP
layers that config.json's `num_nextn_predict_layers` announces after the last decoder layer are skipped; a layer
beyond those is an error (a config with too few layers would otherwise run a smaller model silently). Every
tensor's name, shape and dtype is checked against the model's before the first is read, so a bad checkpoint
raises one Glm5Error naming the tensor or file.
"""

import bisect
import hashlib
import json
import logging
import math
import mmap
import os
import re
import struct
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError, safe_open

from .config import ModelConfig
from .errors import Glm5Error
from .formats import fp8_blocks

log = logging.getLogger("glm5_offload")

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
HEADER_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
                 "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I8": torch.int8, "U8": torch.uint8,
                 "I16": torch.int16, "U16": torch.uint16, "I32": torch.int32, "U32": torch.uint32,
                 "I64": torch.int64, "U64": torch.uint64, "BOOL": torch.bool}
FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MAPPED_DTYPES = {  # the safetensors dtypes memory_map reads, as numpy dtypes
    "I8": np.int8, "U8": np.uint8, "U16": np.uint16, "I32": np.int32, "F32": np.float32}
_LAYER = re.compile(r"model\.layers\.(\d+)\.")
_HYPER = re.compile(r"\.hc_(attn|ffn)_(fn|base|scale)$")  # GLM-5.3-Flash's stored names for the model's {attn,ffn}_hc.*


def model_name(config: ModelConfig, stored: str) -> str | None:
    """The model's name for a stored tensor; None for one the text model does not use (GLM-5.3-Flash's vision tower,
    `model.visual.*`). The text model's prefix (`model.language_model.` in GLM-5.3-Flash's release) reads as
    `model.`, and its hyper-connection tensors `hc_attn_fn` ... as `attn_hc.fn` ... (transformers' names)."""
    if config.text_prefix != "model.":
        if stored.startswith("model.visual."):
            return None
        if stored.startswith(config.text_prefix):
            stored = "model." + stored.removeprefix(config.text_prefix)
    return _HYPER.sub(r".\1_hc.\2", stored)


def stored_name(config: ModelConfig, name: str) -> str:
    """model_name's inverse: where the release stores the model's tensor `name`."""
    name = re.sub(r"\.(attn|ffn)_hc\.(fn|base|scale)$", r".hc_\1_\2", name)
    return config.text_prefix + name.removeprefix("model.") if name.startswith("model.") else name


def shard_files(model_dir: Path) -> dict[Path, set[str] | None]:
    """Each shard file, with the tensor names the index assigns to it (None: no index, take all)."""
    index = model_dir / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            assert isinstance(weight_map, dict)
        except (json.JSONDecodeError, KeyError, TypeError, AssertionError, UnicodeDecodeError, RecursionError):
            raise Glm5Error(f"{index}: not a safetensors index (no 'weight_map' object)") from None
        shards: dict[Path, set[str]] = {}
        for name, file in weight_map.items():
            if not isinstance(file, str) or not file or "/" in file or file.startswith("."):
                raise Glm5Error(f"{index}: weight_map gives {name} the file {file!r}, not a shard's file name")
            shards.setdefault(model_dir / file, set()).add(name)
        for file in shards:
            if not file.is_file():
                raise Glm5Error(f"{file}: shard named in {INDEX_FILE} is missing")
        return shards
    if (model_dir / SINGLE_FILE).is_file():
        return {model_dir / SINGLE_FILE: None}
    pickles = sorted(p.name for p in model_dir.glob("*.bin")) + sorted(p.name for p in model_dir.glob("*.pt"))
    hint = f" ({', '.join(pickles)} found: pickle checkpoints are never loaded)" if pickles else ""
    raise Glm5Error(f"{model_dir}: no {INDEX_FILE} or {SINGLE_FILE}{hint}")


def check_shard(path: Path) -> tuple[int, dict]:
    """Refuse a truncated or corrupt safetensors file before it is memory-mapped; (header length, header)."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise Glm5Error(f"{path}: truncated safetensors file ({size} bytes)")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8:
            raise Glm5Error(f"{path}: corrupt or truncated safetensors header (claims {n} bytes, file has {size})")
        try:
            header = json.loads(f.read(n))
            tensors = {k: v for k, v in header.items() if k != "__metadata__"}
            for v in tensors.values():
                if (v["dtype"] not in HEADER_DTYPES or not isinstance(v["shape"], list)
                        or not all(isinstance(o, int) for o in v["data_offsets"]) or len(v["data_offsets"]) != 2):
                    raise TypeError
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, IndexError, AttributeError,
                RecursionError):  # (JSON nested past Python's stack)
            raise Glm5Error(f"{path}: corrupt safetensors header") from None
    # each tensor's bytes as its dtype and shape say, the tensors one after another (as safetensors checks when the
    # file is opened, but naming the tensor: its message names none, and comes from whichever module read first)
    at, previous = 0, None
    for name, v in sorted(tensors.items(), key=lambda item: item[1]["data_offsets"]):
        start, stop = v["data_offsets"]
        if start != at:
            raise Glm5Error(f"{path}: corrupt safetensors header (tensor {name}'s data starts at {start}, "
                            + (f"{previous}'s ends at {at})" if previous else "the first must start at 0)"))
        at, previous = stop, name
        shape, itemsize = v["shape"], HEADER_DTYPES[v["dtype"]].itemsize
        if not all(isinstance(d, int) and d >= 0 for d in shape) or not 0 <= start <= stop:
            raise Glm5Error(f"{path}: corrupt safetensors header (tensor {name}: shape {shape}, data_offsets "
                            f"{v['data_offsets']})")
        if math.prod(shape) * itemsize != stop - start:
            raise Glm5Error(f"{path}: corrupt safetensors header (tensor {name}: {v['dtype']} {shape} is "
                            f"{math.prod(shape) * itemsize} bytes, its data_offsets hold {stop - start})")
    if 8 + n + at != size:  # at: where the last tensor's data ends
        raise Glm5Error(f"{path}: truncated or corrupt safetensors file (data needs {8 + n + at} bytes, file has "
                        f"{size})")
    return n, header


def _mapped_tensors(path: Path):
    """(name, dtype, shape, file offset, bytes) of each tensor of a safetensors file, checked."""
    n, header = check_shard(path)
    for name, info in header.items():
        if name == "__metadata__":
            continue
        start, end = info["data_offsets"]
        if info["dtype"] not in MAPPED_DTYPES:
            raise Glm5Error(f"{path}: tensor {name} has dtype {info['dtype']}, not one of {', '.join(MAPPED_DTYPES)}")
        yield name, MAPPED_DTYPES[info["dtype"]], tuple(info["shape"]), 8 + n + start, end - start


def memory_map(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of a safetensors file as a read-only memory map (nothing is read until used)."""
    return {name: np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=shape) if size else np.zeros(shape, dtype)
            for name, dtype, shape, offset, size in _mapped_tensors(path)}


READ_CHUNK = 1 << 28


def anonymous_memory(size: int) -> mmap.mmap:
    """size bytes of anonymous memory in a mapping of its own, huge pages asked for: what the CPU experts are read
    into (read_into_memory) and what bench/bench_experts.py holds its layers in."""
    buf = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        buf.madvise(mmap.MADV_HUGEPAGE)
    return buf


def read_into_memory(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of a safetensors file read into anonymous memory of its own (one mapping a tensor, huge pages
    asked for), read-only like a memory map; the file's pages are dropped from the page cache as they are read, so
    the bytes are not held twice. The CPU experts read such memory faster than a file's map (bench/RESULTS.md)."""
    arrays = {}
    with open(path, "rb", buffering=0) as f:
        for name, dtype, shape, offset, size in _mapped_tensors(path):
            if not size:
                arrays[name] = np.zeros(shape, dtype)
                arrays[name].flags.writeable = False
                continue
            buf = anonymous_memory(size)
            view = memoryview(buf)
            done = 0
            while done < size:
                got = os.preadv(f.fileno(), [view[done : done + READ_CHUNK]], offset + done)
                if got <= 0:
                    raise Glm5Error(f"{path}: tensor {name} ends early ({done} of {size} bytes read)")
                if hasattr(os, "posix_fadvise"):
                    os.posix_fadvise(f.fileno(), offset + done, got, os.POSIX_FADV_DONTNEED)
                done += got
            view.release()
            array = np.frombuffer(buf, dtype=dtype).reshape(shape)
            array.flags.writeable = False
            arrays[name] = array
    return arrays


def huge_pages(arrays: list[np.ndarray]) -> tuple[int, int] | None:
    """(bytes mapped, bytes in transparent huge pages) of the memory mappings that hold `arrays` (read_into_memory's
    ask for huge pages; a file's map gets none), from /proc/self/smaps; None where there is none (not Linux)."""
    try:
        with open("/proc/self/smaps") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    spans = []  # the arrays' address ranges, merged: sorted and disjoint
    for start, end in sorted((a.ctypes.data, a.ctypes.data + a.nbytes) for a in arrays if a.nbytes):
        if spans and start <= spans[-1][1]:
            spans[-1][1] = max(spans[-1][1], end)
        else:
            spans.append([start, end])
    starts = [start for start, _ in spans]
    mapped = huge = 0
    holds = False
    for line in lines:
        head = line.split(" ", 1)[0]
        if "-" in head and not head.endswith(":"):  # a mapping's first line: start-end perms offset ...
            begin, end = (int(x, 16) for x in head.split("-"))
            i = bisect.bisect_left(starts, end) - 1  # the last span starting below the mapping's end
            holds = i >= 0 and spans[i][1] > begin  # (a mapping may hold part of an array: madvise splits them)
            mapped += (end - begin) if holds else 0
        elif holds and line.startswith("AnonHugePages:"):
            huge += int(line.split()[1]) * 1024
    return mapped, huge


def fingerprint(model_dir: Path) -> str:
    """Identifies a checkpoint's bytes: its files' names, sizes and modification times."""
    files = sorted(p for p in model_dir.iterdir() if p.suffix in (".safetensors", ".json"))
    stats = [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files]
    return hashlib.sha256(json.dumps(stats).encode()).hexdigest()


class Checkpoint:
    """The tensors of model_dir that a model of config expects ({name: shape}), checked from the shard headers;
    `aliases` names tensors read under another name (a tied lm_head reads the embedding)."""

    def __init__(self, model_dir: Path, config: ModelConfig, expected: dict[str, tuple[int, ...]],
                 aliases: dict[str, str] | None = None):
        self.model_dir, self.block, self.aliases = model_dir, config.fp8_block_size, aliases or {}
        self.config = config
        self.located: dict[str, tuple[Path, torch.dtype, tuple]] = {}  # name -> shard, dtype, shape
        self.stored: dict[str, str] = {}  # name -> the name in the shard (model_name's inverse)
        self._open: dict[Path, object] = {}
        n_layers, n_mtp = config.num_hidden_layers, config.num_nextn_predict_layers
        skipped_mtp, skipped_other = 0, 0
        for path, listed in shard_files(model_dir).items():
            _, header = check_shard(path)
            names = set(header) - {"__metadata__"}
            if listed is not None and listed - names:
                raise Glm5Error(f"{path}: {INDEX_FILE} lists {sorted(listed - names)[0]} but the shard lacks it")
            for stored in sorted(names if listed is None else listed):
                name = model_name(config, stored)
                if name is None:
                    skipped_other += 1
                    continue
                layer = _LAYER.match(name)
                if layer and int(layer.group(1)) >= n_layers:
                    if int(layer.group(1)) >= n_layers + n_mtp:
                        raise Glm5Error(f"{path}: tensor {stored} is beyond the {n_layers} decoder layers and "
                                        f"{n_mtp} MTP layer(s) config.json announces (num_hidden_layers, "
                                        "num_nextn_predict_layers)")
                    skipped_mtp += 1
                    continue
                info = header[stored]
                self.located[name] = path, HEADER_DTYPES[info["dtype"]], tuple(info["shape"])
                self.stored[name] = stored
                if name not in expected and not name.endswith(".weight_scale_inv"):
                    raise Glm5Error(f"{path}: unexpected tensor {stored} (not part of this {config.model_type} model)")
        if skipped_mtp:
            mtp = ", ".join(f"model.layers.{i}.*" for i in range(n_layers, n_layers + n_mtp))
            log.info("skipped %d tensors of the MTP layer(s) %s (not used for decoding)", skipped_mtp, mtp)
        if skipped_other:
            log.warning("skipped %d tensors outside the text model (the vision tower): images and video are not "
                        "supported yet", skipped_other)
        self._check(expected)

    def _check(self, expected: dict[str, tuple[int, ...]]):
        where = self.model_dir
        missing = [n for n in expected if n not in self.located]
        if missing:
            raise Glm5Error(f"{where}: missing tensor {stored_name(self.config, missing[0])}"
                            + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
        for name in self.located:
            weight = name.removesuffix("_scale_inv")
            if name.endswith(".weight_scale_inv") and (weight not in self.located
                                                       or self.located[weight][1] != torch.float8_e4m3fn):
                raise Glm5Error(f"{where}: unexpected tensor {self.stored[name]} (no float8_e4m3fn weight "
                                f"{stored_name(self.config, weight)} beside it)")
        for name, want in expected.items():
            _, dtype, shape = self.located[name]
            shown = self.stored[name]
            if shape != tuple(want):
                raise Glm5Error(f"{where}: tensor {shown} has shape {shape}, expected {tuple(want)}")
            if dtype == torch.float8_e4m3fn:
                scale = self.located.get(name + "_scale_inv")
                if scale is None or self.block is None:
                    why = "without its weight_scale_inv" if scale is None else "but config.json has no fp8 quantization_config"
                    raise Glm5Error(f"{where}: tensor {shown} is float8_e4m3fn {why}")
                want_scale = fp8_blocks.scale_shape(shape, self.block)
                if len(shape) != 2 or scale[2] != want_scale or not scale[1].is_floating_point:
                    raise Glm5Error(f"{where}: tensor {shown}_scale_inv has shape {scale[2]} {scale[1]}, expected "
                                    f"{want_scale} float")
            elif dtype not in FLOAT_DTYPES:
                raise Glm5Error(f"{where}: tensor {shown} has dtype {dtype}, expected bfloat16, float16, float32 or "
                                "float8_e4m3fn with weight_scale_inv")

    def _get(self, name: str) -> torch.Tensor:
        path = self.located[name][0]
        try:
            if path not in self._open:
                self._open[path] = safe_open(path, framework="pt")
            return self._open[path].get_tensor(self.stored[name])
        except SafetensorError as e:
            raise Glm5Error(f"{path}: corrupt safetensors file ({e})") from None

    def read_fp8(self, name: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        """An FP8 weight as stored, (W8 float8_e4m3fn, scale_inv fp32), when its blocks are fp8_blocks' 128 x 128;
        None for any other weight."""
        name = self.aliases.get(name, name)
        if self.located[name][1] != torch.float8_e4m3fn or tuple(self.block) != fp8_blocks.BLOCK:
            return None
        return self._get(name), self._get(name + "_scale_inv").float()

    def read(self, name: str) -> torch.Tensor:
        """A tensor as stored (bf16, fp16, fp32), or an FP8 weight's dequantised values (fp32)."""
        name = self.aliases.get(name, name)
        t = self._get(name)
        if t.dtype == torch.float8_e4m3fn:
            return fp8_blocks.dequantize(t, self._get(name + "_scale_inv"), self.block)
        return t
