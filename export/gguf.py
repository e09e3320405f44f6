"""A student as a GGUF file that llama.cpp loads: `moe-pipeline export RUN --format gguf --quantize q8_0|q4_0|bf16`.

    moe-pipeline export runs/qwen3-30b-a3b-mos --format gguf --quantize q8_0       # -> RUN/gguf/model-Q8_0.gguf
    moe-pipeline export RUN --stage teacher --format gguf --quantize bf16 --out teacher-bf16.gguf
    llama-server -m RUN/gguf/model-Q8_0.gguf

The model of a family llama.cpp runs (Qwen3-MoE `qwen3moe`, Qwen2-MoE `qwen2moe`, OLMoE `olmoe`, Mixtral as `llama`
with experts: a teacher imported from one, and the students distilled from it) is written as llama.cpp's own converter
(convert_hf_to_gguf.py) writes that family's Hugging Face checkpoint: the same architecture key and hyper-parameters,
the same tensor names (gguf-py's tensor map; each layer's experts stacked into one [experts, out, in] tensor per
projection), Mixtral's q and k rows permuted as the converter permutes llama's (llama.cpp rotates adjacent pairs), the
tokenizer as a GPT-2 style BPE vocabulary with its merges and special tokens, and the same tensor types: norms, biases
and the routers (`ffn_gate_inp`, llama.cpp never quantises them) in F32; every other weight in the requested type
(Q8_0: blocks of 32 values with one fp16 scale, what the converter's `--outtype q8_0` writes; Q4_0: blocks of 32 4-bit
values, the output layer in Q8_0 as llama-quantize keeps it wider; BF16), F16 where a row does not divide into blocks
of 32. The quantisation is gguf-py's (PyPI `gguf`), the code llama.cpp's converter runs. Written to a temporary name,
then renamed.

Refused, naming what works: our own PR-MoE GPT, a student with dense layers (llama.cpp's MoE architectures have an
MoE in every layer), a pyramid of expert counts, an OLMoE with grouped-query attention (llama.cpp's olmoe norms k over
the whole hidden size), and a tokenizer whose pre-tokenizer is not one recognised here
(GPT-2's byte level, Qwen2's split; Mixtral's own SentencePiece tokenizer among them: `export --format hf` and
llama.cpp's convert_hf_to_gguf.py on it).
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import numpy as np
import torch

from pipeline.artifacts import DONE, TOKENIZER, read_model_config
from pipeline.families import FAMILIES
from pipeline.model import ModelConfig
from pipeline.schemes import SCHEMES, written_by

TYPES = written_by("gguf")  # what --quantize takes with --format gguf (pipeline/schemes.py)
# our family -> gguf-py's MODEL_ARCH member (each family's `gguf_arch`, pipeline/families/: Mixtral runs as llama)
ARCHES = {name: fam.gguf_arch for name, fam in FAMILIES.items() if fam.gguf_arch is not None}
# the Qwen2 tokenizer's pre-tokenizer regex (tokenizer.json), which llama.cpp names "qwen2"
QWEN2_SPLIT = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"


class GGUFExportError(ValueError):
    """A model or tokenizer this GGUF writer cannot express; the message says what works instead."""


def check_gguf(cfg: ModelConfig, qtype: str) -> None:
    """Refuse, before anything is read, what llama.cpp (or this writer) cannot run, naming what works."""
    if qtype not in TYPES:
        raise GGUFExportError(f"--quantize {qtype!r} with --format gguf: one of {', '.join(TYPES)}")
    ours = "export our package (`moe-pipeline export RUN`, served by `moe-pipeline serve`)"
    if cfg.family not in ARCHES:
        raise GGUFExportError(f"--format gguf: a {cfg.family} model has no llama.cpp architecture (llama.cpp runs the "
                              f"Qwen3-MoE, Qwen2-MoE, OLMoE and Mixtral students here, imported teachers' families); "
                              f"{ours}")
    dense = [i for i in range(cfg.layers) if not cfg.is_moe(i)]
    if dense:
        raise GGUFExportError(f"--format gguf: layers {dense} are dense; llama.cpp's {ARCHES[cfg.family].lower()} has an "
                              f"MoE in every layer (a student keeping only MoE layers can be written); {ours}")
    if (why := FAMILIES[cfg.family].gguf_refusal(cfg)) is not None:  # e.g. OLMoE with grouped-query attention
        raise GGUFExportError(f"--format gguf: {why}; {ours}")
    if len(set(cfg.experts)) > 1:
        raise GGUFExportError(f"--format gguf: its MoE layers have different expert counts {list(cfg.experts)}; "
                              f"llama.cpp has one count per model; {ours}")


def tokenizer_pre(tokenizer) -> str:
    """llama.cpp's name for the tokenizer's pre-tokenizer (`tokenizer.ggml.pre`), from tokenizer.json's structure."""
    pre = json.loads(tokenizer.backend_tokenizer.to_str()).get("pre_tokenizer") or {}
    parts = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    kinds = [p.get("type") for p in parts]
    if kinds == ["ByteLevel"] and parts[0].get("use_regex", True):
        return "gpt-2"
    if kinds == ["Split", "ByteLevel"] and parts[0].get("pattern", {}).get("Regex") == QWEN2_SPLIT:
        return "qwen2"
    raise GGUFExportError(f"--format gguf: the tokenizer's pre-tokenizer ({kinds}) is not one this writer names (GPT-2's "
                          f"byte level, Qwen2's split); `moe-pipeline export RUN --format hf` and llama.cpp's "
                          f"convert_hf_to_gguf.py, which recognises more")


def vocab(tokenizer, vocab_size: int) -> tuple[list[str], list[int]]:
    """(tokens, token types) of every id below `vocab_size`, as llama.cpp's converter lists a BPE vocabulary: ids the
    tokenizer lacks as "[PADi]" (unused), added special tokens as control tokens."""
    import gguf

    reverse = {i: t for t, i in tokenizer.get_vocab().items()}
    added = tokenizer.get_added_vocab()
    decoder = tokenizer.added_tokens_decoder
    tokens, types = [], []
    for i in range(vocab_size):
        if i not in reverse:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
            continue
        token = reverse[i]
        if token in added:
            special = decoder[i].special or (token.startswith("<|") and token.endswith("|>"))
            types.append(gguf.TokenType.CONTROL if special else gguf.TokenType.USER_DEFINED)
        else:
            types.append(gguf.TokenType.NORMAL)
        tokens.append(token)
    return tokens, types


def tensor_type(name: str, data: np.ndarray, qtype: str):
    """The GGML type of a GGUF tensor, as the converter picks it (see the module docstring)."""
    import gguf

    T = gguf.GGMLQuantizationType
    if data.ndim <= 1 or name.endswith("_norm.weight") or not name.endswith(".weight") or ".ffn_gate_inp" in name:
        return T.F32
    scheme = SCHEMES[qtype]
    if name == "output.weight" and scheme.gguf_head_type:
        return T[scheme.gguf_head_type]
    return T[scheme.gguf_type]


def rope_permuted(w: torch.Tensor, heads: int) -> torch.Tensor:
    """A q or k projection's rows (or bias) with each head's two rotary halves interleaved, as llama.cpp's converter
    permutes them for an architecture whose rotation pairs adjacent dimensions (llama, and so Mixtral): Hugging Face's
    checkpoints rotate the first half of a head against the second."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_tensors(model, arch) -> dict[str, torch.Tensor]:
    """{GGUF name: fp32 tensor} of `model` (all experts local): the family's Hugging Face tensors (export/native.py)
    renamed by gguf-py's map, each layer's experts stacked per projection (Mixtral's under the name its converter
    gives them), llama's q and k rows permuted (`rope_permuted`)."""
    import re

    import gguf

    from export.native import native_tensors

    cfg, fam = model.cfg, FAMILIES[model.cfg.family]
    hf = native_tensors(model, torch.float32)
    names = gguf.get_tensor_name_map(arch, cfg.layers)
    out, experts = {}, {}
    for key, t in hf.items():
        if e := re.fullmatch(rf"model\.layers\.(\d+)\.{re.escape(fam.moe_prefix)}\.experts\.(\d+)\.(\w+)\.weight", key):
            experts.setdefault((int(e.group(1)), e.group(3)), {})[int(e.group(2))] = t
            continue
        if fam.gguf_permute_qk and key.endswith(("q_proj.weight", "q_proj.bias")):
            t = rope_permuted(t, cfg.heads)
        elif fam.gguf_permute_qk and key.endswith(("k_proj.weight", "k_proj.bias")):
            t = rope_permuted(t, cfg.kv_heads)
        new = names.get_name(key, try_suffixes=(".weight", ".bias"))
        if new is None:
            raise GGUFExportError(f"--format gguf: no GGUF name for {key}")
        out[new] = t
    for (b, proj), by_expert in sorted(experts.items()):
        key = fam.gguf_experts_key.format(layer=b, proj=proj)
        out[names.get_name(key, try_suffixes=(".weight",))] = torch.stack([by_expert[e] for e in sorted(by_expert)])
    return out


def write_gguf(model, tokenizer, out: Path, qtype: str, name: str, force: bool = False) -> dict:
    """Write `model` (our model of a family in ARCHES, all experts local) and its tokenizer to the GGUF file `out`
    (a temporary name, then renamed). Returns {tensor name: GGML type name}."""
    import gguf

    from export.native import native_config

    cfg = model.cfg
    check_gguf(cfg, qtype)
    out = Path(out)
    if out.exists() and not force:
        raise FileExistsError(f"{out} exists: pass --force to replace it, or --out another file")
    arch = getattr(gguf.MODEL_ARCH, ARCHES[cfg.family])
    pre = tokenizer_pre(tokenizer)
    hf = native_config(cfg, torch.bfloat16, tokenizer.bos_token_id, tokenizer.eos_token_id)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    types = {}
    try:
        w = gguf.GGUFWriter(str(tmp), gguf.MODEL_ARCH_NAMES[arch])
        w.add_type(gguf.GGUFType.MODEL)
        w.add_name(name)
        w.add_block_count(cfg.layers)
        w.add_context_length(cfg.seq_len)
        w.add_embedding_length(cfg.hidden)
        w.add_feed_forward_length(hf["intermediate_size"])
        w.add_head_count(cfg.heads)
        w.add_head_count_kv(cfg.kv_heads)
        w.add_rope_freq_base(cfg.rope_theta)
        w.add_layer_norm_rms_eps(cfg.norm_eps)
        w.add_expert_count(cfg.experts[0])
        w.add_expert_used_count(cfg.top_k)
        if "head_dim" in hf:
            w.add_key_length(hf["head_dim"])
            w.add_value_length(hf["head_dim"])
        w.add_file_type(gguf.LlamaFileType[f"MOSTLY_{SCHEMES[qtype].gguf_type}"])
        w.add_quantization_version(gguf.GGML_QUANT_VERSION)
        FAMILIES[cfg.family].gguf_metadata(w, cfg)  # the keys each family's converter adds
        if cfg.shared_expert_hidden:
            w.add_expert_shared_feed_forward_length(cfg.shared_expert_hidden)
        tokens, token_types = vocab(tokenizer, cfg.vocab_size)
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(pre)
        w.add_token_list(tokens)
        w.add_token_types(token_types)
        with tempfile.TemporaryDirectory() as d:  # SpecialVocab reads a checkpoint directory: the family's files
            tokenizer.save_pretrained(d)
            (Path(d) / "config.json").write_text(json.dumps(hf))
            gguf.SpecialVocab(Path(d), load_merges=True, n_vocab=cfg.vocab_size).add_to_gguf(w)
        for key, t in gguf_tensors(model, arch).items():
            data = t.detach().float().contiguous().numpy()
            kind = tensor_type(key, data, qtype)
            try:
                packed = gguf.quants.quantize(data, kind)
            except gguf.QuantError:  # rows not a multiple of the block: F16, as the converter falls back
                kind = gguf.GGMLQuantizationType.F16
                packed = gguf.quants.quantize(data, kind)
            w.add_tensor(key, packed, raw_dtype=kind)
            types[key] = kind.name
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return types


def export_gguf(stage_dir: Path, out: Path, qtype: str = "q8_0", force: bool = False) -> Path:
    """Write a finished stage (a student of an imported teacher of a family in ARCHES, or that teacher) as a GGUF file. What
    llama.cpp cannot run is refused before any weight is read (GGUFExportError)."""
    from pipeline import data as data_lib
    from pipeline.build import load_stage_model

    stage_dir = Path(stage_dir)
    if not (stage_dir / DONE).is_file():
        raise FileNotFoundError(f"{stage_dir / DONE} is missing: the stage is not finished "
                                f"(run `moe-pipeline distill RECIPE` first)")
    cfg = read_model_config(stage_dir)
    check_gguf(cfg, qtype)
    tokenizer = data_lib.load_tokenizer(stage_dir / TOKENIZER)
    tokenizer_pre(tokenizer)
    if Path(out).exists() and not force:
        raise FileExistsError(f"{out} exists: pass --force to replace it, or --out another file")
    model = load_stage_model(stage_dir, torch.float32)
    write_gguf(model, tokenizer, out, qtype, f"{stage_dir.resolve().parent.name}-{stage_dir.name}", force)
    return Path(out)
