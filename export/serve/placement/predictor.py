"""The expert-demand predictor (MoE-MPMC): a Simple Recurrent Unit over a sequence's tokens that
predicts which expert each MoE layer will route the sequence's *next* token to.

    moe-pipeline predictor train runs/tiny/package      # traces -> SRU -> predictor.* in the package
    moe-pipeline serve runs/tiny/package --ep-size 2 --placement predictive

Traces: the package's own model runs over blocks of its training split (the recipe in the
manifest names the data; the tokenizer is the package's) and records, for every token and MoE
layer, the expert the router chose (top-1; the first choice for top-2). The predictor reads tokens
0..t and outputs, per MoE layer, a distribution over the experts of token t+1. At serving time the
predictive policy (controller.py `PredictiveController`) runs it in a second thread and plans the
replica tables from the demand it predicts.

The SRU (Lei et al., 2018): with x~, f, r from one matrix product over all steps,
    c_t = f_t * c_{t-1} + (1 - f_t) * x~_t,  f_t = sigmoid(W_f x_t + v_f * c_{t-1} + b_f)
    h_t = r_t * c_t + (1 - r_t) * x_t,       r_t = sigmoid(W_r x_t + v_r * c_{t-1} + b_r)
so the recurrence is elementwise and a step costs two small products per layer (MoE-MPMC chose it
over SiDA-MoE's LSTM for that). MoE-MPMC's sparse attention over the SRU states is not built here.

Stored in the package as `predictor.safetensors` and `predictor.json` (its shape, the expert
frequencies of the training traces, and its held-out accuracy against a frequency baseline), both
listed with checksums in manifest.json.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from export.serve.config import PREDICTOR_CONFIG
from pipeline.model import route, router_logits

WEIGHTS = "predictor.safetensors"
CONFIG = PREDICTOR_CONFIG


@dataclass
class PredictorConfig:
    vocab_size: int
    experts: list[int]
    dim: int = 64
    layers: int = 2
    bos_id: int = 0  # the token read before a prompt (end-of-text)


class SRULayer(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.proj = nn.Linear(dim, 3 * dim)  # x~, f, r pre-activations for every step at once
        self.v = nn.Parameter(torch.zeros(2, dim))  # v_f, v_r
        self.b = nn.Parameter(torch.zeros(2, dim))  # b_f, b_r

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, T, d], c [B, d] -> h [B, T, d], the last c."""
        d = x.shape[-1]
        u = self.proj(x)  # [B, T, 3d]
        xt, ufr = u[..., :d], u[..., d:] + self.b.flatten()  # x~ [B, T, d]; f, r pre-activations [B, T, 2d]
        v = self.v.flatten()
        hs = []
        for t in range(x.shape[1]):  # few ops per step: a step is what the serving thread runs per token
            fr = torch.sigmoid(torch.addcmul(ufr[:, t], v, torch.cat([c, c], dim=-1)))  # [B, 2d]
            c = torch.lerp(xt[:, t], c, fr[:, :d])  # f * c + (1 - f) * x~
            hs.append(torch.lerp(x[:, t], c, fr[:, d:]))  # r * c + (1 - r) * x
        return torch.stack(hs, dim=1), c


class SRUPredictor(nn.Module):
    def __init__(self, cfg: PredictorConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.sru = nn.ModuleList(SRULayer(cfg.dim) for _ in range(cfg.layers))
        self.norm = nn.LayerNorm(cfg.dim)
        self.heads = nn.ModuleList(nn.Linear(cfg.dim, e) for e in cfg.experts)

    def initial_state(self, batch: int) -> torch.Tensor:
        return torch.zeros(self.cfg.layers, batch, self.cfg.dim)

    def forward(self, ids: torch.Tensor, state: torch.Tensor | None = None) -> tuple[list[torch.Tensor], torch.Tensor]:
        """ids [B, T] -> per MoE layer logits [B, T, experts] for the routing of each NEXT token, and the state."""
        x = self.embed(ids)
        state = self.initial_state(ids.shape[0]) if state is None else state
        out = []
        for layer, c in zip(self.sru, state):
            x, c = layer(x, c)
            out.append(c)
        h = self.norm(x)
        return [head(h) for head in self.heads], torch.stack(out)


# -- traces ----------------------------------------------------------------------------------------------

def record_routes(model, blocks: torch.Tensor, batch: int = 16) -> torch.Tensor:
    """[N, T, moe layers] int64: the expert each MoE layer's router picks (first choice) for each token."""
    moes = model.moe_layers()
    seen: list[torch.Tensor] = []

    def hook(module, args):
        x = args[0]
        logits = router_logits(x.reshape(-1, x.shape[-1]), module.moe.deepspeed_moe.gate.wg.weight)
        r = route(logits, module.cfg.top_k, module.cfg.top_k > 1)
        seen.append(r.experts[:, 0].view(x.shape[:-1]))  # the first choice

    handles = [m.register_forward_pre_hook(hook) for m in moes]
    out = []
    try:
        with torch.no_grad():
            for i in range(0, len(blocks), batch):
                seen.clear()
                model(blocks[i:i + batch])
                out.append(torch.stack(seen, dim=-1))
    finally:
        for h in handles:
            h.remove()
    return torch.cat(out)


def _blocks(tokens, seq_len: int, count: int, seed: int) -> torch.Tensor:
    import numpy as np

    n = len(tokens) // seq_len
    order = np.random.default_rng(seed).permutation(n)[:count]
    # block by block: the split (memory-mapped shards) is never loaded whole
    arr = np.stack([np.asarray(tokens[i * seq_len : (i + 1) * seq_len]) for i in np.sort(order)])
    return torch.from_numpy(arr.astype("int64"))


def traces(pkg: Path, train_blocks: int, val_blocks: int, seed: int = 0, model=None):
    """(train ids, train routes, val ids, val routes) from the package's model over its run's data."""
    from export.inference import load_package
    from pipeline import data as data_lib
    from pipeline.artifacts import cache_root, read_manifest
    from pipeline.recipe import validate_stored

    manifest = read_manifest(pkg)
    if "recipe" not in manifest:
        raise ValueError(f"{pkg}: its manifest names no recipe, so the training text is unknown")
    recipe = validate_stored(manifest["recipe"])
    prepared = data_lib.prepare_data(recipe.data, cache_root())
    if model is None:
        model, _ = load_package(pkg)
    T = model.cfg.seq_len
    tr = _blocks(prepared.train, T, train_blocks, seed)
    va = _blocks(prepared.val, T, val_blocks, seed + 1)
    return tr, record_routes(model, tr), va, record_routes(model, va)


# -- training and evaluation -------------------------------------------------------------------------------

def _shifted(ids: torch.Tensor, routes: torch.Tensor, bos: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs [bos, x_0 .. x_{T-2}] and targets routes(x_0 .. x_{T-1}): position t predicts token t's route
    having read only the tokens before it."""
    inp = torch.cat([torch.full((ids.shape[0], 1), bos, dtype=ids.dtype), ids[:, :-1]], dim=1)
    return inp, routes


def train_predictor(cfg: PredictorConfig, ids: torch.Tensor, routes: torch.Tensor, steps: int = 300,
                    batch: int = 16, lr: float = 3e-3, seed: int = 0, progress: bool = True) -> SRUPredictor:
    from tqdm import tqdm

    torch.manual_seed(seed)
    model = SRUPredictor(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.1)
    inp, tgt = _shifted(ids, routes, cfg.bos_id)
    g = torch.Generator().manual_seed(seed)
    bar = tqdm(range(steps), desc="[predictor] train", unit="step", disable=not progress)
    for _ in bar:
        pick = torch.randint(0, len(inp), (batch,), generator=g)
        logits, _ = model(inp[pick])
        loss = sum(F.cross_entropy(lg.flatten(0, 1), tgt[pick][..., i].flatten()) for i, lg in enumerate(logits))
        opt.zero_grad()
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        bar.set_postfix(loss=f"{loss.item() / len(logits):.3f}")
    return model.eval()


def frequencies(routes: torch.Tensor, experts: list[int]) -> list[list[float]]:
    return [(torch.bincount(routes[..., i].flatten(), minlength=n).float() / routes[..., i].numel()).tolist()
            for i, n in enumerate(experts)]


@torch.no_grad()
def evaluate(model: SRUPredictor, ids: torch.Tensor, routes: torch.Tensor, freq: list[list[float]],
             batch_tokens: int = 16, batches: int = 400, seed: int = 0) -> dict:
    """Held-out accuracy. Per token: top-1 accuracy. Per simulated decode step (`batch_tokens` tokens from
    different sequences, as a continuous batch): top-k recall of the active experts (k = how many were
    active) and the demand error sum_e |predicted - actual| / tokens, against a frequency baseline
    (demand = tokens x the training traces' expert frequencies)."""
    cfg = model.cfg
    inp, tgt = _shifted(ids, routes, cfg.bos_id)
    per_layer = [[] for _ in cfg.experts]
    for i in range(0, len(inp), 32):
        for j, lg in enumerate(model(inp[i:i + 32])[0]):
            per_layer[j].append(lg.softmax(-1))
    probs = [torch.cat(p) for p in per_layer]  # [N, T, E]
    g = torch.Generator().manual_seed(seed)
    N, T = tgt.shape[:2]
    out = {"layers": []}
    for j, n in enumerate(cfg.experts):
        p, y = probs[j], tgt[..., j]
        top1 = float((p.argmax(-1) == y).float().mean())
        err = base = recall = 0.0
        fq = torch.tensor(freq[j])
        for _ in range(batches):
            seqs = torch.randperm(N, generator=g)[:batch_tokens]
            pos = torch.randint(1, T, (len(seqs),), generator=g)
            actual = torch.bincount(y[seqs, pos], minlength=n).float()
            predicted = p[seqs, pos].sum(0)
            err += float((predicted - actual).abs().sum()) / len(seqs)
            base += float((fq * len(seqs) - actual).abs().sum()) / len(seqs)
            k = int((actual > 0).sum())
            recall += len(set(predicted.topk(k).indices.tolist()) & set(actual.nonzero().flatten().tolist())) / k
        out["layers"].append({"experts": n, "top1_accuracy": round(top1, 4),
                              "frequency_top1_accuracy": round(float((y == fq.argmax()).float().mean()), 4),
                              "demand_error": round(err / batches, 4), "frequency_demand_error": round(base / batches, 4),
                              "topk_recall": round(recall / batches, 4)})
    L = out["layers"]
    out.update(batch_tokens=batch_tokens, batches=batches, tokens=int(N * T),
               demand_error=round(sum(x["demand_error"] for x in L) / len(L), 4),
               frequency_demand_error=round(sum(x["frequency_demand_error"] for x in L) / len(L), 4),
               topk_recall=round(sum(x["topk_recall"] for x in L) / len(L), 4))
    return out


# -- the package files ----------------------------------------------------------------------------------------

def save_predictor(pkg: Path, model: SRUPredictor, info: dict) -> None:
    """Write predictor.safetensors and predictor.json into the package and list them in its manifest
    (each file written to a temporary name, then renamed; the manifest last)."""
    from safetensors.torch import save_file

    from pipeline.artifacts import MANIFEST, atomic_write_text, sha256_file

    pkg = Path(pkg)
    tmp = pkg / (WEIGHTS + ".tmp")
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, pkg / WEIGHTS)
    atomic_write_text(pkg / CONFIG, json.dumps({"config": asdict(model.cfg), **info}, indent=1) + "\n")
    manifest = json.loads((pkg / MANIFEST).read_text())
    for name in (WEIGHTS, CONFIG):
        manifest["files"][name] = {"sha256": sha256_file(pkg / name), "size": (pkg / name).stat().st_size}
    manifest["predictor"] = {k: info[k] for k in ("held_out",) if k in info}
    atomic_write_text(pkg / MANIFEST, json.dumps(manifest, indent=1) + "\n")


def load_predictor(pkg: Path) -> tuple[SRUPredictor, dict]:
    from safetensors.torch import load_file

    pkg = Path(pkg)
    if not (pkg / CONFIG).is_file():
        raise ValueError(f"{pkg} has no predictor: run `moe-pipeline predictor train {pkg}` first "
                         f"(--placement predictive needs it)")
    info = json.loads((pkg / CONFIG).read_text())
    model = SRUPredictor(PredictorConfig(**info["config"]))
    model.load_state_dict(load_file(str(pkg / WEIGHTS)))
    return model.eval().requires_grad_(False), info


def train_command(pkg: Path, train_blocks: int = 400, val_blocks: int = 100, steps: int = 300, dim: int = 64,
                  seed: int = 0) -> dict:
    """`moe-pipeline predictor train PKG`: traces, training, held-out evaluation, stored in the package."""
    from export.package import model_config_of, verify_package

    pkg = Path(pkg)
    problems = verify_package(pkg, checksums=False)
    if problems:
        raise ValueError(f"{pkg}: not a whole package ({problems[0]})")
    cfg = model_config_of(pkg)
    t0 = time.time()
    tr_ids, tr_routes, va_ids, va_routes = traces(pkg, train_blocks, val_blocks, seed)
    print(f"[predictor] traces: {tr_ids.numel():,} training and {va_ids.numel():,} held-out tokens "
          f"({time.time() - t0:.1f}s)", flush=True)
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast.from_pretrained(str(pkg))
    pcfg = PredictorConfig(vocab_size=cfg.vocab_size, experts=list(cfg.experts), dim=dim,
                           bos_id=tok.eos_token_id if tok.eos_token_id is not None else 0)
    model = train_predictor(pcfg, tr_ids, tr_routes, steps=steps, seed=seed)
    freq = frequencies(tr_routes, pcfg.experts)
    held = evaluate(model, va_ids, va_routes, freq, seed=seed)
    info = {"held_out": held, "frequencies": freq, "train_tokens": int(tr_ids.numel()), "steps": steps,
            "seconds": round(time.time() - t0, 1)}
    save_predictor(pkg, model, info)
    return info

