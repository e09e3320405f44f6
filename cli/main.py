"""`moe-pipeline`: the command line. Maps command names to stage functions and does nothing else.

    moe-pipeline prepare recipes/1.3b.yaml [--set data.workers=16]   # tokenize the corpus into the data cache, once
    moe-pipeline teacher recipes/tiny.yaml [--nproc 2] [--set teacher.train.steps=50] [--run-dir DIR] [--redo]
    moe-pipeline distill recipes/tiny.yaml [--nproc 2] ...     # teacher (skipped when done), then the student
    moe-pipeline plan recipes/1.3b.yaml --world-size 128 --json
    moe-pipeline plan recipes/tiny.yaml --measure    # candidate students cut from the trained teacher, scored untrained
    moe-pipeline export runs/tiny [--stage teacher] [--dtype bf16] [--out DIR] [--force]
    moe-pipeline export runs/olmoe-1b-7b-mos --format hf      # an imported teacher's family, the student's depth
    moe-pipeline verify runs/tiny/package
    moe-pipeline serve runs/tiny/package [--port 8000] [--ep-size 2] [--placement predictive] [--api-key-file F]
    moe-pipeline predictor train runs/tiny/package   # the expert-demand predictor for serve --placement predictive
    moe-pipeline eval runs/tiny [more models] [--tasks a,b] [--batch-size 32] [--out DIR] [--nproc 2]
    moe-pipeline lm-eval run --model moe-pipeline --model_args path=runs/tiny/student --tasks tiny_lastword

With `--nproc N` (or `distributed.nproc` in the recipe) above the number of running ranks, the
command restarts itself under the DeepSpeed launcher; on many nodes, start it yourself:
`deepspeed --hostfile HOSTFILE --no_local_rank --module cli teacher recipes/1.3b.yaml`.
Recipe errors print one line naming the key and exit with status 2, before anything is written.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from cli.common import add_nproc, positive_int
from cli.eval import cmd_eval
from cli.export import cmd_export, cmd_verify
from cli.serve import add_serve_flags, cmd_predictor, cmd_serve
from cli.train import cmd_plan, cmd_prepare, cmd_stages
from pipeline.recipe import RecipeError
from pipeline.schemes import SCHEMES


def _recipe_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("recipe", help="a recipe YAML, e.g. recipes/tiny.yaml")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY.PATH=VALUE",
                   help="override a recipe value (parsed as YAML), e.g. --set teacher.train.steps=50")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moe-pipeline", description="PR-MoE teacher -> Mixture-of-Students pipeline")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("prepare", help="tokenize the recipe's corpus into token shards in the data cache (resumable); "
                                       "teacher and distill then read it")
    _recipe_args(p)

    for name, text in (("teacher", "train (or load) the recipe's PR-MoE teacher"),
                       ("distill", "the teacher stage (skipped when done), then the Mixture-of-Students student")):
        p = sub.add_parser(name, help=text)
        _recipe_args(p)
        add_nproc(p, " (default: distributed.nproc)")
        p.add_argument("--run-dir", type=Path, default=None, help="run directory (default: runs/<recipe name>)")
        p.add_argument("--redo", action="store_true",
                       help=f"discard the finished or interrupted {'student' if name == 'distill' else 'teacher'} "
                            "stage and start it over")

    p = sub.add_parser("plan", help="parameter counts, expert-parallel layout and memory per rank")
    _recipe_args(p)
    p.add_argument("--world-size", type=positive_int, default=None, help="ranks to plan for (default: distributed.nproc)")
    p.add_argument("--json", action="store_true", help="print one JSON object {teacher: ..., student: ...}")
    p.add_argument("--measure", action="store_true",
                   help="score candidate students cut from the trained teacher (depth by each layer rule, experts "
                        "by each pruning rule) on held-out blocks, before any training; table, JSON and PNG")
    p.add_argument("--run-dir", type=Path, default=None,
                   help="with --measure: the run whose teacher stage to cut from (default: runs/<recipe name>; "
                        "teacher.load wins)")
    p.add_argument("--blocks", type=positive_int, default=64, help="with --measure: held-out blocks to score on")
    p.add_argument("--out", type=Path, default=None, help="with --measure: where measure.json/png go (default RUN/plan)")

    p = sub.add_parser("export", help="a deployable package of a run's student (or teacher)")
    p.add_argument("run", type=Path, help="a run directory (or a finished stage directory)")
    p.add_argument("--stage", choices=["student", "teacher"], default="student")
    p.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default=None,
                   help="weights' dtype (default: fp32 for our package, its MoE gates fp32 always; bf16 for --format "
                        "hf, as these families ship)")
    p.add_argument("--out", type=Path, default=None, help="package directory (default RUN/package)")
    p.add_argument("--force", action="store_true", help="replace an existing package")
    p.add_argument("--max-shard-size", default="2GB", help="split model.safetensors above this size (HF's layout)")
    p.add_argument("--format", choices=["package", "hf", "gguf"], default="package",
                   help="package: ours (expert-parallel serving, predictor, verify; remote code); hf: the imported "
                        "teacher's own family (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE) with the student's depth, for "
                        "plain transformers, vLLM, SGLang (default out RUN/hf); gguf: a file llama.cpp loads "
                        "(Qwen3-MoE, Qwen2-MoE; --quantize q8_0|q4_0|bf16; default out RUN/gguf/model-TYPE.gguf)")
    p.add_argument("--quantize", choices=list(SCHEMES), default=None,
                   help="package: weight-only int8 (one scale per output row) or int4 (one per --group-size inputs of a "
                        "row), routers, norms, embeddings and the output layer staying in --dtype; hf: compressed-tensors "
                        "as llm-compressor writes it, int8 (W8A16), int4 (W4A16) or w8a8 (int8 weights and per-token "
                        "int8 activations: vLLM's CPU backend; default out RUN/hf-SCHEME); gguf: llama.cpp's Q8_0, Q4_0 "
                        "or BF16 (default q8_0)")
    p.add_argument("--quantize-head", action="store_true", help="with --quantize: the output layer too (not a tied one)")
    p.add_argument("--quantize-method", choices=["gptq", "rtn"], default="gptq",
                   help="gptq: calibrated on the run's training split, every expert on every token (default); rtn: "
                        "round to nearest")
    p.add_argument("--group-size", type=positive_int, default=128, help="int4: inputs per scale (a multiple of 64)")
    p.add_argument("--calibration-blocks", type=positive_int, default=128,
                   help="GPTQ: blocks of the training split (of the model's context each) to calibrate on")

    p = sub.add_parser("verify", help="check a package: files, checksums, tensors (exit 1 and a list of problems)")
    p.add_argument("package", type=Path)
    p.add_argument("--skip-checksums", action="store_true", help="sizes, names, shapes and dtypes only")

    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server over a package (expert parallel with --nproc)",
                       allow_abbrev=False)
    add_serve_flags(p)

    p = sub.add_parser("predictor", help="the expert-demand predictor of a package (for serve --placement predictive)")
    psub = p.add_subparsers(dest="predictor_command", required=True)
    q = psub.add_parser("train", help="record router traces over the training split, train the SRU, store it in the package")
    q.add_argument("package", type=Path)
    q.add_argument("--train-blocks", type=positive_int, default=400, help="training sequences traced")
    q.add_argument("--val-blocks", type=positive_int, default=100, help="held-out sequences for its accuracy")
    q.add_argument("--steps", type=positive_int, default=300)
    q.add_argument("--dim", type=positive_int, default=64, help="SRU width")
    q.add_argument("--seed", type=int, default=0)

    p = sub.add_parser("eval", help="zero-shot evaluation with lm-evaluation-harness: models x tasks, resumable")
    p.add_argument("models", nargs="+", help="run directories (their teacher and student), stage directories or packages")
    p.add_argument("--tasks", default=None,
                   help="comma-separated lm-eval task or group names (default: the bundled offline tasks)")
    p.add_argument("--batch-size", type=positive_int, default=16, help="requests per forward pass")
    p.add_argument("--limit", type=float, default=None, help="documents per task (a fraction if below 1)")
    p.add_argument("--include-path", action="append", default=[], metavar="DIR",
                   help="a folder of extra task YAMLs (repeatable)")
    p.add_argument("--out", type=Path, default=None,
                   help="results folder (default: RUN/eval for one run directory, else evals/<models>)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="run the models in this dtype (default: their own; fp32 for run and stage directories)")
    add_nproc(p, " (expert parallel)")
    p.add_argument("--ep-size", type=positive_int, default=None, help="expert-parallel degree (default: all ranks)")
    p.add_argument("--bootstrap-iters", type=int, default=1000, help="lm-eval's bootstrap for non-mean stderrs")

    # listed for --help; main() hands everything after `lm-eval` to lm-eval's own parser
    sub.add_parser("lm-eval", add_help=False,
                   help="lm-eval's own command line (run, ls, validate: its arguments) with the model "
                        "`moe-pipeline` and the bundled tasks (eval/lm_eval_cli.py)")
    return parser


COMMANDS = {
    "prepare": lambda args, argv: cmd_prepare(args),
    "teacher": lambda args, argv: cmd_stages(args, argv),
    "distill": lambda args, argv: cmd_stages(args, argv),
    "plan": lambda args, argv: cmd_plan(args),
    "export": lambda args, argv: cmd_export(args),
    "verify": lambda args, argv: cmd_verify(args),
    "serve": cmd_serve,
    "predictor": lambda args, argv: cmd_predictor(args),
    "eval": cmd_eval,
}


def main(argv: list[str] | None = None) -> int:
    from pipeline.dist import quiet_cpu_accelerator

    quiet_cpu_accelerator()
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["lm-eval"]:
        from eval.lm_eval_cli import main as lm_eval_main

        return lm_eval_main(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args, argv)
    except RecipeError as err:
        print(f"recipe error: {err}", file=sys.stderr)
        return 2
