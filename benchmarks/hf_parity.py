"""The parity table for Hugging Face teachers: per family, the max |logit difference| (fp32) of
  * teacher import: our model read from the checkpoint (`pipeline.build.load_hf_teacher`) against transformers'
    own model of the same checkpoint;
  * EP 1 vs EP 2: the imported teacher over 2 expert-parallel ranks (DeepSpeed's MoE, the DeepSpeed launcher,
    gloo; each rank reads only its experts) against 1 rank;
  * student native export: `moe-pipeline distill` on the checkpoint (a few steps, 3 -> 2 layers), then
    `moe-pipeline export RUN --format hf --dtype fp32`, loaded by `AutoModelForCausalLM.from_pretrained` (no remote code),
    against our student.
The checkpoints are tests/hf_checkpoints.py's: small random models of transformers' own classes with a BPE
tokenizer, made offline under `--work`. A table on stdout, hf_parity.json and hf_parity.png under `--out`.

    .venv/bin/python benchmarks/hf_parity.py            # about two minutes on 2 cores
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, child_env, cli_command

sys.path.insert(1, str(ROOT))
sys.path.insert(2, str(ROOT / "tests"))

COLUMNS = ("teacher import", "EP 1 vs EP 2", "student native export")


def run(cmd: list[str]) -> None:
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=child_env())
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd[:4])} ... exited {proc.returncode}:\n{proc.stderr[-3000:]}")


def measure(work: Path) -> dict[str, dict[str, float]]:
    import torch
    import transformers

    from hf_checkpoints import FAMILIES, RECIPES, SMALL, VOCAB, make_checkpoints
    from pipeline.build import load_hf_teacher, load_stage_model
    from pipeline.dist import free_port

    ckpts = make_checkpoints(work / "checkpoints")
    ids = torch.randint(0, VOCAB, (4, 16), generator=torch.Generator().manual_seed(3))  # the EP worker's batch
    run([sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port", str(free_port()),
         "--no_local_rank", "tests/workers/hf_ep_parity.py", str(work / "ep2.pt"), *(str(ckpts[f]) for f in FAMILIES)])
    ep2 = torch.load(work / "ep2.pt", weights_only=True)
    table = {}
    for family in FAMILIES:
        ours = load_hf_teacher(ckpts[family], dtype=torch.float32)
        theirs = transformers.AutoModelForCausalLM.from_pretrained(ckpts[family], dtype=torch.float32).eval()
        with torch.no_grad():
            ep1 = ours(ids).logits
            row = {"teacher import": (ep1 - theirs(ids).logits).abs().max().item(),
                   "EP 1 vs EP 2": (ep2[family] - ep1).abs().max().item()}
        runs = work / "runs" / family
        sets = [f"teacher.load={ckpts[family]}", f"data.train={ckpts['corpus']}", *SMALL]
        run([*cli_command(), "distill", RECIPES[family], "--run-dir", str(runs), *sum((["--set", s] for s in sets), [])])
        run([*cli_command(), "export", str(runs), "--format", "hf", "--dtype", "fp32", "--force"])
        native = transformers.AutoModelForCausalLM.from_pretrained(runs / "hf", dtype=torch.float32).eval()
        with torch.no_grad():
            row["student native export"] = (native(ids).logits - load_stage_model(runs / "student")(ids).logits
                                            ).abs().max().item()
        row["class"] = type(native).__name__
        row["layers"] = f"{ours.cfg.layers} -> {native.config.num_hidden_layers}"
        table[family] = row
        print(f"{family}: " + ", ".join(f"{c} {row[c]:.2e}" for c in COLUMNS), flush=True)
    return table


def plot(table: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    width = 0.25
    for j, col in enumerate(COLUMNS):
        vals = [max(table[f][col], 1e-9) for f in table]
        ax.bar([i + (j - 1) * width for i in range(len(table))], vals, width, label=col)
    ax.axhline(1e-4, color="k", ls="--", lw=1, label="tolerance 1e-4")
    ax.set_yscale("log")
    ax.set_xticks(range(len(table)), list(table))
    ax.set_ylabel("max |logit diff| (fp32; 1e-9 = exact)")
    ax.legend(fontsize=8)
    ax.set_title("Hugging Face teachers: logit parity")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", type=Path, default=None, help="checkpoints and runs (default: a temporary directory)")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "hf_parity")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        table = measure(args.work or Path(tmp))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "hf_parity.json").write_text(json.dumps(table, indent=1))
    plot(table, args.out / "hf_parity.png")
    print(f"\n| family | class | layers | {' | '.join(COLUMNS)} |\n|---|---|---|---|---|---|")
    for family, row in table.items():
        print(f"| {family} | {row['class']} | {row['layers']} | " + " | ".join(f"{row[c]:.2e}" for c in COLUMNS) + " |")
    worst = max(row[c] for row in table.values() for c in COLUMNS)
    print(f"\nworst {worst:.2e} (tolerance 1e-4) -> {args.out}")
    return 0 if worst < 1e-4 else 1


if __name__ == "__main__":
    sys.exit(main())
