"""Small random Hugging Face MoE checkpoints of each supported family, made offline with transformers' own config and
model classes (`save_pretrained`: the Hub's tensor names), for tests/test_hf_import.py, tests/test_hf_distill.py
and benchmarks/hf_parity.py. `make_checkpoints` adds a byte-level BPE tokenizer trained on a few bundled documents
(saved beside each checkpoint, as a downloaded one's) and those documents as a .txt corpus.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import torch
import transformers

FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")
VOCAB = 512  # make_checkpoints' tokenizer and models
RECIPES = {"mixtral": "recipes/mixtral-8x7b-mos.yaml", "qwen2_moe": "recipes/qwen1.5-moe-a2.7b-mos.yaml",
           "qwen3_moe": "recipes/qwen3-30b-a3b-mos.yaml", "olmoe": "recipes/olmoe-1b-7b-mos.yaml"}
# the family recipes cut to seconds on these checkpoints: 3-layer teachers -> 2-layer students, fp32, 1 rank
SMALL = ["data.seq_len=32", "data.validation_fraction=0.2", "student.layers=2", "student.train.steps=6",
         "student.train.micro_batch_size=2", "student.train.global_batch_size=4", "student.train.warmup_steps=1",
         "student.train.log_every=2", "student.train.eval_every=6", "student.train.checkpoint_every=2",
         "student.train.eval_batches=2", "student.train.precision=fp32", "student.train.zero_stage=0",
         "teacher.eval.precision=fp32", "teacher.eval.eval_batches=2", "teacher.eval.micro_batch_size=2",
         "distributed.nproc=1", "distributed.ep_size=null", "kd.stop_at=50%"]

COMMON = {"vocab_size": 128, "hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4,
          "num_key_value_heads": 2, "max_position_embeddings": 128}


def family_model(family: str, **kw):
    """A small random Hugging Face model of `family` (fp32, eval)."""
    T = transformers
    if family == "mixtral":
        cfg, cls = dict(intermediate_size=96, num_local_experts=4, num_experts_per_tok=2), T.MixtralConfig
    elif family == "qwen2_moe":  # layer 0 dense; a shared expert with its sigmoid gate; unnormalised top-k
        cfg, cls = dict(intermediate_size=96, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                        num_experts=4, num_experts_per_tok=2, mlp_only_layers=[0]), T.Qwen2MoeConfig
    elif family == "qwen3_moe":  # per-head q/k norm; head_dim 32 != 64 / 4; MoE on layers 1 (sparse step 2)
        cfg, cls = dict(intermediate_size=96, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                        head_dim=32, norm_topk_prob=True, decoder_sparse_step=2), T.Qwen3MoeConfig
    else:  # olmoe: q/k norm over the whole projection; unnormalised top-k
        cfg, cls = dict(intermediate_size=32, num_experts=4, num_experts_per_tok=2, eos_token_id=0,
                        pad_token_id=1), T.OlmoeConfig
    cfg = cls(**{**COMMON, **cfg, **kw})
    cls = getattr(T, cls.__name__.replace("Config", "ForCausalLM"))
    torch.manual_seed(0)
    model = cls(cfg).float().eval()
    with torch.no_grad():  # routers and norms away from their initial values, so that they matter
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", "layernorm.weight")):
                p.add_(torch.randn_like(p) * 0.2)
            elif name.endswith("gate.weight"):
                p.normal_(0, 0.5)
    return model



def make_checkpoints(root: Path, families=FAMILIES) -> dict[str, Path | str]:
    """{family: checkpoint dir with a VOCAB-entry tokenizer}, and "corpus": a glob of the 20 .txt documents."""
    from pipeline import data as data_lib

    class Bundled:  # the data section's fields that iter_documents reads
        train, text_field = "bundled", "text"

    root = Path(root)
    docs = [data_lib.Document(d.id, d.text[:6000])
            for d in itertools.islice(data_lib.iter_documents(Bundled), 0, 200, 5)][:20]
    (root / "corpus").mkdir(parents=True, exist_ok=True)
    for i, d in enumerate(docs):
        (root / "corpus" / f"doc{i:02d}.txt").write_text(d.text)
    tok = data_lib.train_bpe_tokenizer(docs, VOCAB, 32)
    out: dict[str, Path | str] = {}
    for family in families:
        model = family_model(family, vocab_size=VOCAB, eos_token_id=0, bos_token_id=0, pad_token_id=0)
        model.save_pretrained(root / family)
        tok.save_pretrained(str(root / family))
        out[family] = root / family
    out["corpus"] = f"[{root / 'corpus'}/*.txt]"
    return out


def imported_stage(root: Path, family: str, **kw) -> tuple[Path, Path]:
    """A random `family` checkpoint (make_checkpoints' tokenizer; `kw` overrides its config) imported as a finished
    teacher stage, as benchmarks/peer_bench.py imports its checkpoint: (checkpoint dir, stage dir)."""
    from pipeline.teacher import hf_checkpoint_stage

    root = Path(root)
    ckpt = make_checkpoints(root, families=(family,))[family]
    family_model(family, vocab_size=VOCAB, eos_token_id=0, bos_token_id=0, pad_token_id=0, **kw).save_pretrained(ckpt)
    (root / "run").mkdir(parents=True)
    return ckpt, hf_checkpoint_stage(ckpt, root / "run" / "teacher", torch.float32)
