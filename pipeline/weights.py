"""Consolidated weights: safetensors files with global expert ids, readable at any expert-parallel degree.

A model trained on N ranks holds each MoE layer's experts spread over its expert-parallel group,
numbered locally. `save_weights` writes every tensor once under its global name (expert ids
counted over the whole layer): one `model.safetensors`, or with several writing ranks one shard per
rank plus `model.safetensors.index.json` (Hugging Face's sharded layout). `load_weights` fills a
model of any layout, reading only the tensors that rank owns, each straight from the file (no mmap).
Given what verification saw of a package's files (`files`, export/package.py), it reads only files
the index may name and that are unchanged since (else a FileChangedError names the file).

A stage directory may instead hold `source.json`: its weights are another checkpoint's (a Hugging Face teacher,
pipeline/hf_import.py), read in place through the name map it records (our global name -> the checkpoint's
tensors), after checking the files are the ones whose sha256 it recorded. Nothing is copied.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from pipeline.artifacts import (INDEX, SOURCE, WEIGHTS, FileChangedError, FileFacts, atomic_write_text, check_unchanged,
                                 file_name_problem, open_regular, sha256_file)
from pipeline.dist import barrier
from pipeline.model import GPT, global_name, split_expert_key


def ep_rank_of(moe) -> int:
    """This rank's index inside the layer's expert-parallel group.

    DeepSpeed's default layout puts consecutive ranks in one expert-parallel group, so the index is
    known before the groups exist (weights are initialised before deepspeed.initialize makes them);
    once they exist, DeepSpeed's own answer must agree.
    """
    import torch.distributed as td

    rank = td.get_rank() if td.is_initialized() else 0
    ep_rank = rank % moe.ep_size
    if moe.impl == "deepspeed" and moe.moe.deepspeed_moe.ep_group is not None:
        from deepspeed.utils import groups

        actual = groups._get_expert_parallel_rank(moe.moe.expert_group_name)
        if actual != ep_rank:
            raise RuntimeError(f"expert-parallel rank {actual} of rank {rank} is not the consecutive layout's "
                               f"{ep_rank}: global expert ids would be wrong")
    return ep_rank


def unique_params(model: GPT):
    """(name, tensor) for each parameter once: a tied lm_head is the embedding and is not stored twice."""
    seen: set[int] = set()
    for name, p in model.named_parameters():
        if id(p) not in seen:
            seen.add(id(p))
            yield name, p


def _owned(model: GPT, rank: int) -> dict[str, torch.Tensor]:
    """Tensors this rank writes: its experts if it is in the first expert-parallel group, plus (rank 0) the rest."""
    out = {}
    for name, p in unique_params(model):
        parts = split_expert_key(name)
        if parts is None:
            if rank == 0:
                out[name] = p
        else:
            moe = model.blocks[parts.block].mlp
            if rank < moe.ep_size:  # ranks 0..ep-1 (the first group) hold every expert of the layer once
                out[global_name(model, name, ep_rank_of)] = p
    return {k: v.detach().to("cpu").contiguous() for k, v in out.items()}


def save_weights(model: GPT, out_dir: Path, metadata: dict[str, str] | None = None) -> list[str]:
    """Collective: every rank calls it. Returns the file names written (on every rank)."""
    import torch.distributed as td

    rank = td.get_rank() if td.is_initialized() else 0
    world = td.get_world_size() if td.is_initialized() else 1
    writers = max([1] + [m.ep_size for m in model.moe_layers()])
    out_dir = Path(out_dir)
    meta = {"format": "pt", **(metadata or {})}
    if writers == 1:
        if rank == 0:
            _atomic_save(_owned(model, 0), out_dir / WEIGHTS, meta)
        files = [WEIGHTS]
    else:
        files = [f"model-{i + 1:05d}-of-{writers:05d}.safetensors" for i in range(writers)]
        if rank < writers:
            _atomic_save(_owned(model, rank), out_dir / files[rank], meta)
    if world > 1:
        barrier()
    if writers > 1 and rank == 0:
        weight_map, total = {}, 0
        for f in files:
            with safe_open(out_dir / f, framework="pt") as sf:
                for key in sf.keys():
                    weight_map[key] = f
            total += (out_dir / f).stat().st_size
        atomic_write_text(out_dir / INDEX, json.dumps(
            {"metadata": {"total_size": total, **meta}, "weight_map": dict(sorted(weight_map.items()))}, indent=1))
        files.append(INDEX)
    if world > 1:
        barrier()
    return files


def _atomic_save(tensors: dict[str, torch.Tensor], path: Path, meta: dict[str, str]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp), metadata=meta)
    os.replace(tmp, path)


def weight_files(src: Path, files: dict[str, FileFacts] | None = None) -> dict[str, str]:
    """Global tensor name -> file name inside `src` (single file or sharded with an index).

    `files`: what verification saw of a package's files (export/package.py); then the index (or the
    single file) must be the file verified, unchanged, and the index may name only verified files.
    """
    src = Path(src)
    sharded = INDEX in files if files is not None else (src / INDEX).is_file()
    if files is not None and not sharded and (src / INDEX).exists():
        raise FileChangedError(f"{src / INDEX}: appeared after {src} was verified: re-run `moe-pipeline verify {src}`")
    if sharded:
        with open_regular(src / INDEX) as fh:
            if files is not None:
                check_unchanged(fh.fileno(), src / INDEX, files[INDEX])
            raw = fh.read()
        return index_weight_map(raw, src / INDEX, files)
    if files is not None or (src / WEIGHTS).is_file():
        if files is not None and WEIGHTS not in files:
            raise ValueError(f"{src}: neither {WEIGHTS} nor {INDEX} was verified: not a package's weights")
        with open_regular(src / WEIGHTS) as fh:
            if files is not None:
                check_unchanged(fh.fileno(), src / WEIGHTS, files[WEIGHTS])
            header, _ = read_header(fh, src / WEIGHTS)
        return {k: WEIGHTS for k in header}
    raise FileNotFoundError(f"{src} has no {WEIGHTS} or {INDEX}: train or export a model there first "
                            f"(moe-pipeline teacher RECIPE)")


def index_weight_map(raw: bytes, path: Path, files: dict[str, FileFacts] | None = None) -> dict[str, str]:
    """The `weight_map` of an index file's bytes, checked: {tensor name: safetensors file in the same directory}
    (and, with `files`, a verified one); a ValueError names the index and the entry at fault."""
    try:
        index = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path}: not JSON ({err})") from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict):
        raise ValueError(f"{path}: needs a weight_map object {{tensor name: file name}}, got "
                         f"{type(weight_map).__name__ if isinstance(index, dict) else type(index).__name__}")
    for key, f in weight_map.items():
        problem = file_name_problem(f) if isinstance(f, str) else f"{f!r} is not a file name"
        if problem is None and not f.endswith(".safetensors"):
            problem = f"{f!r} is not a .safetensors file"
        if problem is None and files is not None and f not in files:
            problem = f"{f!r} was not verified (manifest.json does not list it)"
        if problem is not None:
            raise ValueError(f"{path}: weight_map entry {key}: {problem}")
    return weight_map


LACKS = "the weights belong to a different architecture (check config.json)"  # a missing tensor's fix, by default


def load_weights(model: GPT, src: Path, ep_rank_of=ep_rank_of, rename=None,
                 files: dict[str, FileFacts] | None = None, lacks: str = LACKS) -> None:
    """Fill `model` (any expert-parallel layout) from consolidated weights, reading only its own tensors.

    `rename` maps a global parameter name of `model` to the name it has in `src` (a student takes
    teacher block 5 as its block 2, say); by default the names are the same. A parameter with a
    `shard` attribute (dim, start, whole size) receives that slice of the stored tensor: expert and
    tensor slicing read only a rank's part (export/inference.py); one with a `pick` attribute (dim,
    indices, whole size) receives those indices along dim (a pruned student's router keeps the rows of
    its experts, distill/student.py). `files`: what verification saw of a
    package's files (export/package.py); a file that differs from it, before or after its tensors are
    read, is refused (FileChangedError). Without it, a file that changes while it is read is refused.
    `rename` may give several stored names for one parameter: they fill equal slices of it along dim 0, in
    order (a Hugging Face gate and up projection make our SwiGLU fc1). A stage directory with `source.json`
    is read from the checkpoint it records, through its name map.
    """
    rename = rename or (lambda name: name)
    src = Path(src)
    if files is None and (src / SOURCE).is_file():
        src, name_map = read_source(src)
        inner = rename
        rename = lambda name: _mapped(name_map, inner(name), src)
    wanted: dict[str, list[torch.Tensor]] = {}  # stored name -> the parameters it fills (a tied, sliced head: 2)
    for name, p in unique_params(model):
        keys = rename(global_name(model, name, ep_rank_of))
        if isinstance(keys, str):
            wanted.setdefault(keys, []).append(p)
            continue
        if len(keys) > 1 and (hasattr(p, "shard") or hasattr(p, "pick")):
            raise ValueError(f"{name}: made of {len(keys)} stored tensors, which cannot be read sliced or picked")
        rows = p.shape[0] // len(keys)
        for j, key in enumerate(keys):
            wanted.setdefault(key, []).append(p if len(keys) == 1 else p.data.narrow(0, j * rows, rows))
    fill_tensors(src, wanted, files, lacks)


def _mapped(name_map: dict[str, list[str]], name: str, src: Path) -> list[str]:
    if name not in name_map:
        raise ValueError(f"{SOURCE}'s name map has no entry for {name}: the model is not the recorded checkpoint's "
                         f"({src}); run the teacher stage again (--redo)")
    return name_map[name]


def read_source(stage_dir: Path) -> tuple[Path, dict[str, list[str]]]:
    """(the checkpoint directory, the name map) that `stage_dir/source.json` records, after checking each recorded
    file is still there with the size and modification time it had when its sha256 was taken (a ValueError names
    the file and the fix). Hashing is the teacher stage's, once: a load never re-reads the whole checkpoint, except
    a file whose modification time differs (a copy on another node's own disk, made at another time): that file is
    hashed, once per machine (`_same_contents`), and read if its sha256 is the recorded one."""
    record = json.loads((Path(stage_dir) / SOURCE).read_text())
    src = Path(record["path"])
    redo = (f"the teacher stage ({stage_dir}) recorded it from {src} with its sha256; restore that file, or record "
            "the checkpoint again: `moe-pipeline teacher RECIPE --redo`")
    for name, facts in record["files"].items():
        path = src / name
        try:
            st = path.stat()
        except OSError:
            raise ValueError(f"{path}: missing: {redo}") from None
        if st.st_size != facts["size"]:
            raise ValueError(f"{path}: {st.st_size} bytes, {facts['size']} when recorded: {redo}")
        if st.st_mtime_ns != facts["mtime_ns"] and not _same_contents(path, st, facts["sha256"]):
            raise ValueError(f"{path}: modified since it was recorded (its sha256 differs): {redo}")
    return src, record["name_map"]


def _same_contents(path: Path, st: os.stat_result, sha256: str) -> bool:
    """Whether `path` (whose modification time is not the recorded one) has the recorded `sha256`. A match is kept
    as a stamp in this machine's data cache, keyed by the path, size, modification time and inode, so that the
    file is hashed once per machine, not at every load; any change to the file makes a new key."""
    import hashlib

    from pipeline.artifacts import cache_root

    key = hashlib.sha256(f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{st.st_ino}|{sha256}".encode()).hexdigest()
    stamp = cache_root() / "verified" / key
    if stamp.is_file():
        return True
    if sha256_file(path) != sha256:
        return False
    stamp.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(stamp, json.dumps({"path": str(path.resolve()), "sha256": sha256}))
    return True


def file_facts(src: Path, names: list[str]) -> dict[str, dict]:
    """{name: sha256, size, modification time} of the files `names` in `src`, with a progress bar."""
    from tqdm import tqdm

    out = {}
    with tqdm(total=sum((Path(src) / n).stat().st_size for n in names), desc="sha256 of the teacher's files",
              unit="B", unit_scale=True) as bar:
        for n in names:
            st = (Path(src) / n).stat()
            out[n] = {"sha256": sha256_file(Path(src) / n), "size": st.st_size, "mtime_ns": st.st_mtime_ns}
            bar.update(st.st_size)
    return out


def write_source(stage_dir: Path, src: Path, files: dict[str, dict], name_map: dict[str, list[str]],
                 info: dict) -> None:
    """Record in `stage_dir/source.json` that its weights are the checkpoint in `src`: its `files` (`file_facts`),
    the name map, and `info`."""
    atomic_write_text(Path(stage_dir) / SOURCE, json.dumps({**info, "path": str(Path(src).resolve()),
                                                             "files": files, "name_map": name_map}, indent=1))


def fill_tensors(src: Path, wanted: dict[str, list[torch.Tensor]], files: dict[str, FileFacts] | None = None,
                 lacks: str = LACKS, dequantize: bool = True) -> None:
    """Read each stored tensor `wanted` names into the tensors listed for it (parameters, or contiguous views of
    them: a Hugging Face gate and up projection fill the two halves of one fc1), file by file in file order, one
    tensor in flight. `lacks`: the fix a missing tensor's error gives. A weight stored quantised (export --quantize)
    fills its parameters with the weight it stands for, unless not `dequantize`."""
    src = Path(src)
    where = weight_files(src, files)
    if dequantize:
        wanted = _dequantizing(wanted, where)
    missing = sorted(set(wanted) - set(where))
    if missing:
        raise ValueError(f"{src} lacks {len(missing)} tensor(s) this model needs, e.g. {missing[0]}: {lacks}")
    by_file: dict[str, list[str]] = {}
    for key in wanted:
        by_file.setdefault(where[key], []).append(key)
    with torch.no_grad():
        for f, keys in by_file.items():
            with open_regular(src / f) as fh:
                facts = files[f] if files is not None else FileFacts.of(os.fstat(fh.fileno()))
                check_unchanged(fh.fileno(), src / f, facts)
                try:
                    _fill(fh, src / f, keys, wanted)
                except ValueError:
                    check_unchanged(fh.fileno(), src / f, facts)  # cut short because it changed: say that
                    raise
                check_unchanged(fh.fileno(), src / f, facts)  # written to while it was read


def _fill(fh, path: Path, keys: list[str], wanted: dict[str, list[torch.Tensor]]) -> None:
    """Read `keys` from the open safetensors file `fh` into the parameters `wanted` names for each (or, for a
    quantised weight's part, hand it to its `_Dequantize`)."""
    header, data_start = read_header(fh, path)
    for key in keys:
        if key not in header:
            raise ValueError(f"{path}: has no tensor {key}, which the weight map places in it")
    for key in sorted(keys, key=lambda k: header[k]["data_offsets"][0]):  # in file order
        params = wanted[key]
        if hasattr(params, "take"):  # a _Dequantize, or read_tensors' keeper
            params.take(key, _read_tensor(fh, header, key, data_start, path), path)
            continue
        _check_shapes(params, key, tuple(header[key]["shape"]), path)
        p = params[0]
        direct = (len(params) == 1 and getattr(p, "shard", None) is None and getattr(p, "pick", None) is None
                  and p.device.type == "cpu"
                  and p.is_contiguous() and SAFETENSORS_DTYPES.get(header[key]["dtype"]) == p.dtype)
        t = _read_tensor(fh, header, key, data_start, path, out=p.data if direct else None)
        if not direct:
            _place(t, params)


def _check_shapes(params: list[torch.Tensor], key: str, shape: tuple[int, ...], path: Path) -> None:
    """Each parameter (or its `shard`, or its `pick`) fits a stored tensor of `shape`."""
    for p in params:
        shard = getattr(p, "shard", None)  # (dim, start, whole size): one slice (export.inference)
        pick = getattr(p, "pick", None)  # (dim, indices, whole size): chosen rows (distill.student)
        whole = list(p.shape)
        if shard is not None:
            whole[shard[0]] = shard[2]
        if pick is not None:
            whole[pick[0]] = pick[2]
        if list(shape) != whole:
            raise ValueError(f"{path}: {key} has shape {shape}, the model expects {tuple(whole)}")


def _place(t: torch.Tensor, params: list[torch.Tensor]) -> None:
    """A whole stored tensor copied into each parameter: its slice (`shard`), its rows (`pick`), or all of it."""
    for p in params:
        shard, pick = getattr(p, "shard", None), getattr(p, "pick", None)
        part = t.narrow(shard[0], shard[1], p.shape[shard[0]]) if shard is not None else t
        if pick is not None:
            part = part.index_select(pick[0], torch.as_tensor(pick[1], dtype=torch.long))
        p.copy_(part.to(p.dtype))


def read_tensors(src: Path, keys: list[str], files: dict[str, FileFacts] | None = None) -> dict[str, torch.Tensor]:
    """{key: the stored tensor as it is} for each of `keys` (a quantised package's values and scales, say)."""
    out: dict[str, torch.Tensor] = {}

    class Keep:
        def take(self, key: str, t: torch.Tensor, path: Path) -> None:
            out[key] = t

    fill_tensors(src, {k: Keep() for k in keys}, files, dequantize=False)
    return out


class _Dequantize:
    """The parameters of one weight a package stores quantised (`export --quantize`: values `name` int8 or
    `name`_packed int4, scales `name`_scale; pipeline/quantize.py): filled with the weight they stand for once both
    parts are read."""

    def __init__(self, name: str, values: str, params: list[torch.Tensor]):
        self.name, self.values, self.params, self.parts = name, values, params, {}

    def take(self, key: str, t: torch.Tensor, path: Path) -> None:
        from pipeline.quantize import scale_name, stored_dequantized

        self.parts[key] = t
        if len(self.parts) == 2:
            w = stored_dequantized(self.parts.pop(self.values), self.parts.pop(scale_name(self.name)))
            _check_shapes(self.params, self.name, tuple(w.shape), path)
            _place(w, self.params)


def _dequantizing(wanted: dict[str, list[torch.Tensor]], where: dict[str, str]) -> dict:
    """`wanted`, with each weight the files hold quantised (its `name`_scale is there) asked for as its two parts."""
    from pipeline.quantize import scale_name, values_name

    out = {}
    for key, params in wanted.items():
        if scale_name(key) not in where:
            out[key] = params
            continue
        values = key if key in where else values_name(key, "int4")
        out[values] = out[scale_name(key)] = _Dequantize(key, values, params)
    return out


# -- reading safetensors tensor by tensor ----------------------------------------------------------
# `safe_open` memory-maps the file: every page a rank touches stays mapped, and counted in its
# resident memory, until the file is closed, so a rank that loads half the experts of a large file
# peaks at its parameters plus the pages it read. These read each wanted tensor with a plain
# read() into a fresh buffer (the format: 8-byte little-endian header length, a JSON header of
# {name: {dtype, shape, data_offsets}}, then the raw little-endian data); a rank's resident memory
# is then its parameters plus one tensor in flight. No pickle: only dtype, shape and raw bytes.

SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
              "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
              "BOOL": torch.bool}


def read_header(fh, path: Path) -> tuple[dict, int]:
    """(the safetensors JSON header without __metadata__, offset of the data section), checked as
    safetensors' own reader checks it: each entry a dtype, a shape and two offsets, the tensors tiling
    the data section exactly (a truncated or padded file is refused). A ValueError names the file."""
    size = os.fstat(fh.fileno()).st_size
    raw = fh.read(8)
    if len(raw) < 8:
        raise ValueError(f"{path}: not a safetensors file (shorter than its header)")
    n = int.from_bytes(raw, "little")
    if n > size - 8:
        raise ValueError(f"{path}: header of {n} bytes in a file of {size}: truncated or not safetensors")
    try:
        header = json.loads(fh.read(n))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path}: unreadable safetensors header ({err})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: the safetensors header is a JSON {type(header).__name__}, not an object")
    header.pop("__metadata__", None)
    data_start = 8 + n
    spans = []
    for key, info in header.items():
        if not (isinstance(info, dict) and isinstance(info.get("dtype"), str) and _counts(info.get("shape"))
                and _counts(info.get("data_offsets")) and len(info["data_offsets"]) == 2):
            raise ValueError(f"{path}: tensor {key}: a header entry needs dtype (a string), shape and "
                             f"data_offsets (non-negative integers), got {str(info)[:120]}")
        begin, end = info["data_offsets"]
        if not begin <= end or data_start + end > size:
            raise ValueError(f"{path}: tensor {key} lies outside the file ({size} bytes): truncated?")
        dtype = SAFETENSORS_DTYPES.get(info["dtype"])
        if dtype is not None and math.prod(info["shape"]) * dtype.itemsize != end - begin:
            raise ValueError(f"{path}: tensor {key} has {end - begin} bytes, shape {info['shape']} of "
                             f"{info['dtype']} needs {math.prod(info['shape']) * dtype.itemsize}")
        spans.append((begin, end, key))
    at = 0
    for begin, end, key in sorted(spans):
        if begin != at:
            raise ValueError(f"{path}: tensor {key} starts at byte {begin} of the data section, not {at}: "
                             f"tensors overlap or leave gaps")
        at = end
    if data_start + at != size:
        raise ValueError(f"{path}: {size - data_start - at} bytes after the last tensor")
    return header, data_start


def _counts(v) -> bool:
    return isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in v)


def _read_tensor(fh, header: dict, key: str, data_start: int, path: Path, out: torch.Tensor | None = None) -> torch.Tensor:
    """The tensor `key`, read into `out` (a contiguous CPU tensor of its dtype and shape) or a new tensor."""
    info = header[key]
    dtype = SAFETENSORS_DTYPES.get(info["dtype"])
    if dtype is None:
        raise ValueError(f"{path}: tensor {key} has dtype {info['dtype']}, which this loader does not read")
    if sys.byteorder != "little":
        raise RuntimeError("safetensors data is little-endian; this loader runs on little-endian machines only")
    begin, end = info["data_offsets"]
    shape = tuple(info["shape"])
    out = torch.empty(shape, dtype=dtype) if out is None else out
    nbytes = out.numel() * out.element_size()
    if nbytes != end - begin:
        raise ValueError(f"{path}: tensor {key} has {end - begin} bytes, shape {list(shape)} of {info['dtype']} "
                         f"needs {nbytes}")
    fh.seek(data_start + begin)
    if nbytes and fh.readinto(memoryview(out.view(torch.uint8).reshape(-1).numpy())) != nbytes:
        raise ValueError(f"{path}: tensor {key} is cut short: the file is truncated")
    return out
