"""Hugging Face MoE checkpoints as teachers: Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE, read into `pipeline.model.GPT`.

A checkpoint directory (config.json, model.safetensors or shards with model.safetensors.index.json, tokenizer
files) becomes a `ModelConfig` (`model_config`) and fills a model of any expert-parallel layout by a plain name
map (`hf_sources`, in the style of gpt-fast's convert_hf_checkpoint), tensor by tensor straight from the files:
nothing is converted or copied on disk, no second copy is held in memory, and a rank reads only its own experts
(`load_hf_weights`). The Hub's per-expert names are read (what `save_pretrained` writes by default); a gate and
an up projection fill the two halves of our SwiGLU `fc1` ([gate; up], transformers 5's `gate_up_proj` layout).
What differs between the families (their config keys, refusals, expert names) is each one's record in
pipeline/families/; this module reads the keys and tensors they share.

    .venv/bin/python -m pipeline.hf_import /models/OLMoE-1B-7B-0924    # its ModelConfig and parameter counts

Nothing is downloaded: a directory is required.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import torch

from pipeline.families import FAMILIES
from pipeline.model import GPT, ModelConfig

SUPPORTED = tuple(FAMILIES)  # the model_types of pipeline/families/, in the order messages list them
CONFIG = "config.json"


class HFImportError(ValueError):
    """A checkpoint that cannot be imported; the message names the field or file and the fix."""


def read_hf_config(src: Path) -> dict:
    """config.json of a Hugging Face checkpoint directory, checked to be one of the supported families."""
    src = Path(src)
    if not src.is_dir():
        hint = (" (a Hub name? nothing is downloaded here: download it yourself, e.g. `huggingface-cli download "
                f"{src} --local-dir DIR`, and point teacher.load at DIR)" if re.fullmatch(r"[\w.-]+/[\w.-]+", str(src))
                else "")
        raise HFImportError(f"{src}: not a directory{hint}")
    return read_config_file(src / CONFIG, "a Hugging Face checkpoint directory has a config.json")


def read_config_file(path: Path, missing: str = "a config.json of a Hugging Face checkpoint") -> dict:
    """A config.json file (a checkpoint's, or an architecture-only one such as recipes/hf/mixtral.json), checked
    to be one of the supported families."""
    path = Path(path)
    try:
        raw = json.loads(path.read_text())
    except (FileNotFoundError, IsADirectoryError):
        raise HFImportError(f"{path}: missing: {missing}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise HFImportError(f"{path}: not JSON ({err})") from None
    return check_family(raw, path)


def check_family(raw, path: Path) -> dict:
    """`raw` (the parsed config.json at `path`) if it is of a supported family."""
    family = raw.get("model_type") if isinstance(raw, dict) else None
    if family not in SUPPORTED:
        raise HFImportError(f"{path}: model_type {family!r} is not supported; supported families: "
                            f"{', '.join(SUPPORTED)}")
    return raw


def _get(raw: dict, path: Path, *names, default=...):
    for name in names:
        if raw.get(name) is not None:
            return raw[name]
    if default is ...:
        raise HFImportError(f"{path}: lacks {names[0]}, which a {raw['model_type']} config needs")
    return default


def model_config(raw: dict, path: Path = Path(CONFIG)) -> ModelConfig:
    """The `ModelConfig` of a supported family's config.json (`raw`); what we cannot run exactly is refused. The
    keys every family shares are read here, the rest by the family's record (pipeline/families/)."""
    fam = FAMILIES[raw["model_type"]]
    g = lambda *names, default=...: _get(raw, path, *names, default=default)
    layers, hidden, heads = g("num_hidden_layers"), g("hidden_size"), g("num_attention_heads")
    experts = g("num_local_experts", "num_experts")
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) not in ("default", None):
        raise HFImportError(f"{path}: rope type {rope.get('rope_type', rope.get('type'))!r} is not supported "
                            "(only the default rotary embedding)")
    if g("hidden_act", default="silu") != "silu":
        raise HFImportError(f"{path}: hidden_act {raw['hidden_act']!r}: these families use silu (SwiGLU)")
    for refusal in fam.refusals:
        if (why := refusal.message(raw)) is not None:
            raise HFImportError(f"{path}: {why}")
    shape = fam.read_hf(raw, g, layers, experts)
    head_dim = raw.get("head_dim")
    return ModelConfig(
        vocab_size=g("vocab_size"), seq_len=g("max_position_embeddings"), layers=layers, hidden=hidden, heads=heads,
        experts=tuple(experts for _ in shape.moe_layers), moe_layers=shape.moe_layers, mlp_type="standard",
        top_k=g("num_experts_per_tok"), capacity_factor=1.0, eval_capacity_factor=None, min_capacity=4,
        aux_loss_coef=float(g("router_aux_loss_coef", default=0.01)), ffn_mult=4, dropout=0.0,
        tie_embeddings=bool(g("tie_word_embeddings", default=False)), init_std=float(g("initializer_range", default=0.02)),
        family=fam.model_type, norm="rmsnorm", norm_eps=float(g("rms_norm_eps")), positions="rope",
        rope_theta=float(rope.get("rope_theta", raw.get("rope_theta", fam.rope_theta))),
        head_dim=None if head_dim is None or head_dim * heads == hidden else int(head_dim),
        kv_heads=g("num_key_value_heads", default=heads), qk_norm=fam.qk_norm, qkv_bias=shape.qkv_bias,
        out_bias=shape.out_bias, activation="swiglu", mlp_bias=False, ffn_hidden=shape.ffn_hidden,
        expert_hidden=shape.expert_hidden, renormalize=shape.renormalize,
        shared_expert_hidden=shape.shared_expert_hidden)


# -- the name map: our global parameter name -> the checkpoint's tensors ---------------------------------------

_ATTN = {"q_proj": "q_proj", "k_proj": "k_proj", "v_proj": "v_proj", "out_proj": "o_proj",
         "q_norm": "q_norm", "k_norm": "k_norm"}


def hf_sources(cfg: ModelConfig, name: str) -> list[str]:
    """The checkpoint tensors that make our parameter `name` (global expert ids): one, or for a SwiGLU fc1 weight
    two (gate, then up), stacked along dim 0."""
    if name == "wte.weight":
        return ["model.embed_tokens.weight"]
    if name == "ln_f.weight":
        return ["model.norm.weight"]
    if name == "lm_head.weight":
        return ["lm_head.weight"]
    m = re.fullmatch(r"blocks\.(\d+)\.(.+)", name)
    if m is None:
        raise HFImportError(f"{name}: no {cfg.family} tensor maps to it")
    layer, rest = f"model.layers.{m.group(1)}", m.group(2)
    fam = FAMILIES.get(cfg.family)
    if fam is None:
        raise HFImportError(f"{name}: no {cfg.family} tensor maps to it (a Hugging Face family is one of "
                            f"{', '.join(SUPPORTED)})")
    moe = f"{layer}.{fam.moe_prefix}"
    swiglu = {"fc1.weight": ["gate_proj.weight", "up_proj.weight"], "fc2.weight": ["down_proj.weight"]}
    if rest in ("ln_1.weight", "ln_2.weight"):
        return [f"{layer}.{'input_layernorm' if rest == 'ln_1.weight' else 'post_attention_layernorm'}.weight"]
    if (a := re.fullmatch(r"attn\.(\w+)\.(weight|bias)", rest)) and a.group(1) in _ATTN:
        return [f"{layer}.self_attn.{_ATTN[a.group(1)]}.{a.group(2)}"]
    if rest == "mlp.moe.deepspeed_moe.gate.wg.weight":
        return [f"{moe}.gate.weight"]
    if e := re.fullmatch(r"mlp\.moe\.deepspeed_moe\.experts\.deepspeed_experts\.(\d+)\.(fc[12]\.weight)", rest):
        gate, up, down = fam.expert_names  # fc1 = [gate; up], fc2 = down
        names = (gate, up) if e.group(2) == "fc1.weight" else (down,)
        return [f"{moe}.experts.{e.group(1)}.{w}.weight" for w in names]
    if s := re.fullmatch(r"mlp\.shared\.(fc[12]\.weight)", rest):
        return [f"{layer}.mlp.shared_expert.{w}" for w in swiglu[s.group(1)]]
    if rest == "mlp.shared_gate.weight":
        return [f"{layer}.mlp.shared_expert_gate.weight"]
    if d := re.fullmatch(r"mlp\.(fc[12]\.weight)", rest):  # a dense layer (Qwen's mlp_only_layers)
        return [f"{layer}.mlp.{w}" for w in swiglu[d.group(1)]]
    raise HFImportError(f"{name}: no {cfg.family} tensor maps to it")


def name_map(cfg: ModelConfig) -> dict[str, list[str]]:
    """Our global parameter name -> the checkpoint tensors that make it (a teacher stage records it)."""
    return {name: keys for name, _, keys in _sources(cfg)}


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint of `cfg` has (all experts of every layer), with its shape: one of our parameter's,
    or its share of rows when several tensors make it."""
    return {key: (shape[0] // len(keys), *shape[1:]) for _, shape, keys in _sources(cfg) for key in keys}


def checkpoint_names(cfg: ModelConfig) -> set[str]:
    """Every tensor name a checkpoint of `cfg` has (all experts of every layer)."""
    return set(expected_shapes(cfg))


def _sources(cfg: ModelConfig):
    """(our global name, its shape, the checkpoint tensors that make it) for every parameter of `cfg`'s model, all
    experts local, built on the meta device."""
    from pipeline.weights import unique_params

    with torch.device("meta"):
        model = GPT(cfg)
    for name, p in unique_params(model):
        yield name, tuple(p.shape), hf_sources(cfg, name)


def checkpoint_files(src: Path) -> list[str]:
    """The files of the checkpoint in `src` that make the model: config.json, the index if sharded, each shard."""
    from pipeline.weights import weight_files

    where = weight_files(src)
    index = ["model.safetensors.index.json"] if (Path(src) / "model.safetensors.index.json").is_file() else []
    return [CONFIG, *index, *sorted(set(where.values()))]


def check_checkpoint(src: Path, cfg: ModelConfig) -> None:
    """The checkpoint in `src` has every tensor `cfg` needs, in its shape, and none it does not account for, read
    from the safetensors headers alone (no weights): an HFImportError names the first fault."""
    from pipeline.weights import read_header, weight_files

    src = Path(src)
    try:
        where = weight_files(src)
    except (FileNotFoundError, ValueError) as err:
        raise HFImportError(f"{src}: {err}") from None
    want = expected_shapes(cfg)
    _check_accounted(src, where, want)
    missing = sorted(set(want) - set(where))
    if missing:
        raise HFImportError(f"{src} lacks {len(missing)} tensor(s) of a {cfg.family} checkpoint, e.g. {missing[0]}: "
                            f"not a complete checkpoint {_LACKS}")
    for f in sorted(set(where.values())):
        try:
            with open(src / f, "rb") as fh:
                header, _ = read_header(fh, src / f)
        except FileNotFoundError:
            raise HFImportError(f"{src / f}: missing: the index names this shard; copy the whole checkpoint") from None
        except ValueError as err:
            raise HFImportError(str(err)) from None
        for key, info in header.items():
            if where.get(key) != f:
                continue
            if tuple(info["shape"]) != want[key]:
                raise HFImportError(f"{src / f}: {key} has shape {tuple(info['shape'])}; {CONFIG} makes it "
                                    f"{want[key]}: the config and the weights disagree")
            if info["dtype"] not in ("F32", "BF16", "F16"):
                raise HFImportError(f"{src / f}: {key} is {info['dtype']}; these are read as F32, BF16 or F16 "
                                    "(dequantize a quantized checkpoint first)")


def _check_accounted(src: Path, stored, wanted) -> None:
    """Every stored tensor name is one the config implies: else the config does not describe these weights (a q/k
    norm, a bias, a shared expert it lacks)."""
    unused = sorted(set(stored) - set(wanted))
    if unused:
        raise HFImportError(f"{src}: {len(unused)} tensor(s) that {CONFIG} does not account for, e.g. {unused[0]}: "
                            f"the config and the weights disagree")


_LACKS = ("with the Hub's tensor names (a shard missing, or saved with save_original_format=False: save it "
          "again with the default)")


def load_hf_weights(model: GPT, src: Path, ep_rank_of=None, files=None) -> None:
    """Fill `model` (built from `model_config` of the same checkpoint, any expert-parallel layout) from the
    checkpoint in `src`, reading only the tensors this rank holds, each into its parameter (or its half of one)."""
    from pipeline.weights import ep_rank_of as default_ep_rank_of
    from pipeline.weights import load_weights, weight_files

    _check_accounted(src, weight_files(src, files), checkpoint_names(model.cfg))
    load_weights(model, src, ep_rank_of or default_ep_rank_of, rename=lambda name: hf_sources(model.cfg, name),
                 files=files, lacks=f"not a complete {model.cfg.family} checkpoint {_LACKS}")


def checkpoint_dtype(raw: dict) -> torch.dtype:
    """The dtype the checkpoint's config.json names (transformers 5 writes `dtype`, earlier ones `torch_dtype`)."""
    name = raw.get("dtype") or raw.get("torch_dtype") or "float32"
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if name not in dtypes:
        raise HFImportError(f"{CONFIG}: dtype {name!r}: one of {', '.join(dtypes)}")
    return dtypes[name]


def main(argv: list[str] | None = None) -> int:
    from pipeline.model import param_counts

    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    try:
        cfg = model_config(read_hf_config(Path(argv[0])), Path(argv[0]) / CONFIG)
    except HFImportError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    with torch.device("meta"):
        counts = param_counts(GPT(cfg))
    print(json.dumps({"model": cfg.to_dict(), **counts}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
