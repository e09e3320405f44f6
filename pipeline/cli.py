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
`deepspeed --hostfile HOSTFILE --no_local_rank --module pipeline.cli teacher recipes/1.3b.yaml`.
Recipe errors print one line naming the key and exit with status 2, before anything is written.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from pipeline.artifacts import is_run_dir
from pipeline.recipe import RecipeError, load_recipe


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


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
        p.add_argument("--nproc", type=_positive_int, default=None,
                       help="ranks on this machine (default: distributed.nproc)")
        p.add_argument("--run-dir", type=Path, default=None, help="run directory (default: runs/<recipe name>)")
        p.add_argument("--redo", action="store_true",
                       help=f"discard the finished or interrupted {'student' if name == 'distill' else 'teacher'} "
                            "stage and start it over")

    p = sub.add_parser("plan", help="parameter counts, expert-parallel layout and memory per rank")
    _recipe_args(p)
    p.add_argument("--world-size", type=_positive_int, default=None, help="ranks to plan for (default: distributed.nproc)")
    p.add_argument("--json", action="store_true", help="print one JSON object {teacher: ..., student: ...}")
    p.add_argument("--measure", action="store_true",
                   help="score candidate students cut from the trained teacher (depth by each layer rule, experts "
                        "by each pruning rule) on held-out blocks, before any training; table, JSON and PNG")
    p.add_argument("--run-dir", type=Path, default=None,
                   help="with --measure: the run whose teacher stage to cut from (default: runs/<recipe name>; "
                        "teacher.load wins)")
    p.add_argument("--blocks", type=_positive_int, default=64, help="with --measure: held-out blocks to score on")
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
    p.add_argument("--quantize", choices=["int8", "int4", "w8a8", "q8_0", "q4_0", "bf16"], default=None,
                   help="package: weight-only int8 (one scale per output row) or int4 (one per --group-size inputs of a "
                        "row), routers, norms, embeddings and the output layer staying in --dtype; hf: compressed-tensors "
                        "as llm-compressor writes it, int8 (W8A16), int4 (W4A16) or w8a8 (int8 weights and per-token "
                        "int8 activations: vLLM's CPU backend; default out RUN/hf-SCHEME); gguf: llama.cpp's Q8_0, Q4_0 "
                        "or BF16 (default q8_0)")
    p.add_argument("--quantize-head", action="store_true", help="with --quantize: the output layer too (not a tied one)")
    p.add_argument("--quantize-method", choices=["gptq", "rtn"], default="gptq",
                   help="gptq: calibrated on the run's training split, every expert on every token (default); rtn: "
                        "round to nearest")
    p.add_argument("--group-size", type=_positive_int, default=128, help="int4: inputs per scale (a multiple of 64)")
    p.add_argument("--calibration-blocks", type=_positive_int, default=128,
                   help="GPTQ: blocks of the training split (of the model's context each) to calibrate on")

    p = sub.add_parser("verify", help="check a package: files, checksums, tensors (exit 1 and a list of problems)")
    p.add_argument("package", type=Path)
    p.add_argument("--skip-checksums", action="store_true", help="sizes, names, shapes and dtypes only")

    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server over a package (expert parallel with --nproc)",
                       allow_abbrev=False)
    _serve_args(p)

    p = sub.add_parser("predictor", help="the expert-demand predictor of a package (for serve --placement predictive)")
    psub = p.add_subparsers(dest="predictor_command", required=True)
    q = psub.add_parser("train", help="record router traces over the training split, train the SRU, store it in the package")
    q.add_argument("package", type=Path)
    q.add_argument("--train-blocks", type=_positive_int, default=400, help="training sequences traced")
    q.add_argument("--val-blocks", type=_positive_int, default=100, help="held-out sequences for its accuracy")
    q.add_argument("--steps", type=_positive_int, default=300)
    q.add_argument("--dim", type=_positive_int, default=64, help="SRU width")
    q.add_argument("--seed", type=int, default=0)

    p = sub.add_parser("eval", help="zero-shot evaluation with lm-evaluation-harness: models x tasks, resumable")
    p.add_argument("models", nargs="+", help="run directories (their teacher and student), stage directories or packages")
    p.add_argument("--tasks", default=None,
                   help="comma-separated lm-eval task or group names (default: the bundled offline tasks)")
    p.add_argument("--batch-size", type=_positive_int, default=16, help="requests per forward pass")
    p.add_argument("--limit", type=float, default=None, help="documents per task (a fraction if below 1)")
    p.add_argument("--include-path", action="append", default=[], metavar="DIR",
                   help="a folder of extra task YAMLs (repeatable)")
    p.add_argument("--out", type=Path, default=None,
                   help="results folder (default: RUN/eval for one run directory, else evals/<models>)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="run the models in this dtype (default: their own; fp32 for run and stage directories)")
    p.add_argument("--nproc", type=_positive_int, default=None, help="ranks on this machine (expert parallel)")
    p.add_argument("--ep-size", type=_positive_int, default=None, help="expert-parallel degree (default: all ranks)")
    p.add_argument("--bootstrap-iters", type=int, default=1000, help="lm-eval's bootstrap for non-mean stderrs")

    # listed for --help; main() hands everything after `lm-eval` to lm-eval's own parser
    sub.add_parser("lm-eval", add_help=False,
                   help="lm-eval's own command line (run, ls, validate: its arguments) with the model "
                        "`moe-pipeline` and the bundled tasks (eval/lm_eval_cli.py)")
    return parser


class _NoKeyOnCommandLine(argparse.Action):
    """`serve --api-key KEY` is refused with the fix: a key on a command line shows in `ps`, on every rank."""

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error("--api-key: a key on the command line is visible to every user (`ps`), on every rank; set "
                     "MOE_PIPELINE_API_KEY or pass --api-key-file FILE")


def _literal(model, name: str) -> list[str]:
    """The values a pydantic model's Literal field (or optional Literal) takes: a flag's choices, kept in one place."""
    import typing

    args = typing.get_args(model.model_fields[name].annotation)
    return [a for arg in args for a in (typing.get_args(arg) or (arg,)) if isinstance(a, str)]


def _serve_args(p: argparse.ArgumentParser) -> None:
    """serve's flags: one per ServeConfig field, defaults (shown in --help) read from ServeConfig, the one place
    they live; a flag not given is left out, so ServeConfig's default applies."""
    from export.serve.config import ServeConfig

    d = {name: f.default for name, f in ServeConfig.model_fields.items()}
    quiet = argparse.SUPPRESS
    p.add_argument("package", type=Path)
    p.add_argument("--host", default=quiet, help=f"address to bind (default {d['host']}: this machine only)")
    p.add_argument("--port", type=int, default=quiet, help=f"default {d['port']}; 0: a free port")
    p.add_argument("--api-key", nargs="?", dest=argparse.SUPPRESS, action=_NoKeyOnCommandLine, help=argparse.SUPPRESS)
    p.add_argument("--api-key-file", type=Path, default=quiet,
                   help="require 'Authorization: Bearer KEY', KEY read from this file's first line (or from "
                        "$MOE_PIPELINE_API_KEY); never put a key on a command line, where `ps` shows it")
    p.add_argument("--max-batch", type=_positive_int, default=quiet,
                   help=f"sequences each rank decodes together (default {d['max_batch']})")
    p.add_argument("--max-batched-tokens", type=_positive_int, default=quiet,
                   help=f"tokens each rank runs in one step, decode tokens first, then prompt chunks: a longer "
                        f"prompt is prefilled in chunks over several steps (default {d['max_batched_tokens']}; "
                        f"at least --max-batch)")
    p.add_argument("--kv-cache-memory", type=float, metavar="GIB", default=quiet,
                   help="GiB of KV cache per rank, in blocks of --block-size tokens; requests are admitted by free "
                        "blocks and the newest is preempted (recomputed later) when they run out (default: a quarter "
                        "of the memory available at start-up, shared by this machine's ranks, on a GPU 80%% of its "
                        "free memory; at most what --max-batch sequences of --max-model-len fill)")
    p.add_argument("--max-model-len", type=_positive_int, default=quiet,
                   help="longest sequence served, prompt + max_tokens (default: the model's context, lowered with a "
                        "printed reason when the KV cache cannot hold one such sequence); longer requests get 400")
    p.add_argument("--block-size", type=_positive_int, default=quiet,
                   help=f"tokens per KV block, the unit of allocation and of prefix sharing (default {d['block_size']})")
    p.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false", default=quiet,
                   help="do not share the KV blocks of a common prompt prefix between requests (on by default)")
    p.add_argument("--expert-exchange", choices=_literal(ServeConfig, "expert_exchange"), default=quiet,
                   help="data parallel: how tokens reach their experts' ranks. all-to-all: DeepSpeed comm's "
                        "variable-split all_to_all_single (each rank receives only its tokens); all-reduce: two "
                        "low-latency all-reduces of every rank's routed tokens (DeepSpeed's shared-memory kernel, "
                        "for the ranks of one CPU machine); auto (default): all-reduce there, else all-to-all")
    p.add_argument("--max-prefill-seqs", type=_positive_int, default=quiet,
                   help="prompts prefilled together in one forward on a rank (default: every prompt chunk the step's "
                        "token budget takes, in one padded batch; 1: each prompt its own forward)")
    p.add_argument("--max-waiting", type=_positive_int, default=quiet,
                   help="sequences waiting for a slot; beyond it new requests get 429 with Retry-After "
                        "(default 4 x --max-batch)")
    p.add_argument("--max-prompts", type=_positive_int, default=quiet,
                   help=f"prompts in one request (default {d['max_prompts']})")
    p.add_argument("--nproc", type=_positive_int, default=None,
                   help="ranks on this machine, through the DeepSpeed launcher (default: the largest of --ep-size "
                        "and --tp-size, else 1)")
    p.add_argument("--ep-size", type=_positive_int, default=quiet,
                   help="expert-parallel degree (default: all ranks, at most a layer's experts). Equal to --nproc "
                        "(and every layer's experts divisible by it): data parallel + expert parallel, each rank "
                        "serves its own sequences and tokens cross ranks only in each MoE layer's all-to-all. "
                        "Below --nproc the ranks that hold the same experts slice each expert (expert slicing), "
                        "and every rank then runs the same sequences (one data-parallel group)")
    p.add_argument("--tp-size", type=_positive_int, default=quiet,
                   help="tensor-slice attention and the dense MLPs over all ranks (DeepSpeed AutoTP): 1 or --nproc; "
                        "every rank then runs the same sequences (one data-parallel group, no DP x TP); PR-MoE "
                        "models only (a Mixtral/Qwen/OLMoE student: --ep-size, or its --format hf export in vLLM)")
    p.add_argument("--dtype", choices=_literal(ServeConfig, "dtype"), default=quiet, help="default: the package's")
    p.add_argument("--quantize", choices=_literal(ServeConfig, "quantize"), default=quiet,
                   help="the linears and experts quantised as the package loads (round to nearest): weight-only "
                        "int8 (one scale per output channel, 1 byte a weight) or int4 (one scale per 128 inputs of a "
                        "row, half a byte), or w8a8 (int8 weights, and each row of a linear's inputs rounded to int8 "
                        "with its own scale, as vLLM's W8A8: int8 x int8 products; also on a package exported with "
                        "--quantize int8, whose weights it runs); the output layer, routers, norms and embeddings stay "
                        "in the package's dtype. CPU, data-parallel layouts (no --tp-size)")
    p.add_argument("--quantize-head", action="store_true", default=quiet,
                   help="with --quantize: the output layer too (its logits change; the greedy head's exact int8 screen "
                        "is dropped)")
    p.add_argument("--placement", choices=_literal(ServeConfig, "placement"), default=quiet,
                   help="place experts by a replica table (export/serve/placement/): none, reactive (from observed "
                        "load, EPLB-style) or predictive (the package's predictor; `moe-pipeline predictor train`)")
    p.add_argument("--replica-budget", type=float, default=quiet,
                   help=f"with --placement: replicas a rank may hold, as a fraction of its own expert memory "
                        f"(default {d['replica_budget']})")
    p.add_argument("--resident-experts", type=float, default=quiet,
                   help=f"with --placement: fraction of a rank's experts kept in memory (default "
                        f"{d['resident_experts']}); the rest stay mapped in the package and are prefetched or loaded "
                        f"on demand")
    p.add_argument("--max-body-bytes", type=_positive_int, default=quiet,
                   help=f"larger request bodies get 413 (default {d['max_body_bytes']})")
    p.add_argument("--smoke", metavar="PROMPT", default=quiet,
                   help="serve, send this one completion over HTTP, print it and shut down (port 0: a free port)")


def cmd_export(args) -> int:
    from export.package import Quantize, export_package, parse_size
    from pipeline.artifacts import read_manifest

    src = args.run / args.stage if is_run_dir(args.run) else args.run
    name = {"hf": f"hf-{args.quantize}" if args.quantize else "hf",
            "gguf": f"gguf/model-{(args.quantize or 'q8_0').upper()}.gguf"}.get(args.format, "package")
    out = args.out or (args.run / name if is_run_dir(args.run) else src.parent / name)
    try:
        formats = {"package": ("int8", "int4"), "hf": ("int8", "int4", "w8a8"),
                   "gguf": ("q8_0", "q4_0", "bf16")}[args.format]
        if args.quantize and args.quantize not in formats:
            raise ValueError(f"--quantize {args.quantize} with --format {args.format}: one of {', '.join(formats)}")
        if args.quantize_head and not args.quantize:
            raise ValueError("--quantize-head needs --quantize (int8 or int4)")
        quantize = None
        if args.quantize and args.format != "gguf":
            from export.compressed import weight_scheme

            quantize = Quantize(weight_scheme(args.quantize), args.quantize_head, args.quantize_method,
                                args.group_size, args.calibration_blocks)
        if args.format == "gguf":
            from export.gguf import export_gguf

            pkg = export_gguf(src, out, args.quantize or "q8_0", args.force)
            print(f"[export] {src} -> {pkg}: GGUF {(args.quantize or 'q8_0').upper()}, {pkg.stat().st_size / 1e6:.1f} MB")
            return 0
        if args.format == "hf":
            from export.native import export_native

            pkg = export_native(src, out, args.dtype or "bf16", args.force, parse_size(args.max_shard_size),
                                quantize, args.quantize, progress=True)
        else:
            pkg = export_package(src, out, dtype=args.dtype or "fp32", force=args.force,
                                 max_shard_bytes=parse_size(args.max_shard_size), quantize=quantize, progress=True)
    except (FileNotFoundError, FileExistsError, ValueError) as err:
        print(f"export error: {err}", file=sys.stderr)
        return 2
    manifest = read_manifest(pkg)
    size = sum(f["size"] for f in manifest["files"].values())
    if args.format == "hf":
        config = json.loads((pkg / "config.json").read_text())
        q = manifest.get("quantization")
        quantized = f" + {q['compressed_tensors']} (compressed-tensors, {q['method']})" if q else ""
        print(f"[export] {src} -> {pkg}: {config['architectures'][0]}, {config['num_hidden_layers']} layers, "
              f"{config['torch_dtype']}{quantized}, {len(manifest['files'])} files, {size / 1e6:.1f} MB")
        return 0
    q = manifest.get("quantization")
    quantized = f" + {q['scheme']} weights ({q['method']}, {q['weights']} quantised)" if q else ""
    print(f"[export] {src} -> {pkg}: {manifest['dtype']}{quantized}, {manifest['params']['total']:,} parameters "
          f"({manifest['params']['active_per_token']:,} active per token), {len(manifest['files'])} files, "
          f"{size / 1e6:.1f} MB")
    if q and q.get("round_to_nearest"):
        print(f"[export] rounded to nearest (GPTQ could not calibrate them): {', '.join(q['round_to_nearest'])}")
    if q and q.get("never_routed"):
        print(f"[export] experts no calibration token was routed to (calibrated on all tokens): {q['never_routed']}")
    return 0


def cmd_verify(args) -> int:
    from export.package import verify_package
    from pipeline.artifacts import read_manifest

    problems = verify_package(args.package, checksums=not args.skip_checksums)
    if problems:
        print(f"{args.package}: {len(problems)} problem(s)", file=sys.stderr)
        for problem in problems:
            print(f"  {problem}", file=sys.stderr)
        return 1
    manifest = read_manifest(args.package)
    print(f"{args.package}: ok ({len(manifest['files'])} files{'' if args.skip_checksums else ' checksummed'}, "
          f"{manifest['tensors']} tensors, {manifest['dtype']})")
    return 0


def _relaunch_if_asked(args, argv: list[str], relaunch=None) -> int | None:
    """With --nproc N > 1 outside a launcher: this command again under the DeepSpeed launcher (its exit
    status; `relaunch`: how, default `dist.relaunch`); otherwise None (go on in this process)."""
    from pipeline import dist

    if not dist.under_launcher() and (args.nproc or 1) > 1:
        return (relaunch or dist.relaunch)(args.nproc, "pipeline.cli", _strip_nproc(argv))
    return None


def cmd_serve(args, argv: list[str]) -> int:
    from export.serve.config import ServeConfig, ServeConfigError
    from pipeline import dist

    flags = {k: v for k, v in vars(args).items() if k in ServeConfig.model_fields}
    if (running := dist.launched_world()) is not None:  # relaunched, or started by a launcher: the running ranks
        flags["nproc"] = running
    try:
        config = ServeConfig.from_flags(flags)  # validated here, once, before any rank starts
    except ServeConfigError as err:
        print(f"serve error: {err}", file=sys.stderr)
        return 2
    args.nproc = config.nproc
    from export.serve.lifecycle import relaunch_server

    if (code := _relaunch_if_asked(args, argv, relaunch_server)) is not None:
        return code
    from export.package import PackageError
    from export.serve.server import serve

    try:
        return serve(config)
    except (FileNotFoundError, PackageError, ValueError) as err:
        print(f"serve error: {err}", file=sys.stderr)
        return 2


def cmd_eval(args, argv: list[str]) -> int:
    if (code := _relaunch_if_asked(args, argv)) is not None:
        return code
    from eval.jobs import run_eval
    from eval.models import resolve

    try:
        for spec in args.models:
            resolve(spec)
        out = args.out
        if out is None:
            first = Path(args.models[0])
            out = first / "eval" if len(args.models) == 1 and is_run_dir(first) else \
                Path("evals") / "+".join(Path(m).resolve().name for m in args.models)
        tasks = [t.strip() for t in args.tasks.split(",") if t.strip()] if args.tasks else None
        run_eval(args.models, tasks, out, batch_size=args.batch_size, limit=args.limit,
                 include_path=args.include_path, dtype=args.dtype, ep_size=args.ep_size,
                 bootstrap_iters=args.bootstrap_iters)
    except (FileNotFoundError, ValueError) as err:
        print(f"eval error: {err}", file=sys.stderr)
        return 2
    return 0


def cmd_prepare(args) -> int:
    import time

    from pipeline.artifacts import cache_root
    from pipeline.data import prepare_data

    recipe = load_recipe(args.recipe, args.overrides)
    t0 = time.perf_counter()
    try:
        data = prepare_data(recipe.data, cache_root())
    except ValueError as err:  # data errors name their recipe key
        raise RecipeError.from_message(str(err)) from None
    splits = data.meta["splits"]
    print(f"[prepare] {data.cache_dir}: train {splits['train']['tokens']:,} tokens, val {splits['val']['tokens']:,} "
          f"tokens in {len(splits['train']['shard_tokens'])} part(s), vocabulary {data.vocab_size:,} "
          f"({time.perf_counter() - t0:.1f}s)")
    return 0


def cmd_plan(args) -> int:
    from distill.plan import format_plan, plan

    recipe = load_recipe(args.recipe, args.overrides, world_size=args.world_size)
    if args.measure:
        from distill.measure import run

        run_dir = args.run_dir or Path("runs") / recipe.name
        run(recipe, run_dir, args.out or run_dir / "plan", args.blocks, args.json)
        return 0
    world = args.world_size or recipe.distributed.nproc
    try:
        result = plan(recipe, world)
    except ValueError as err:
        raise RecipeError("--world-size", world, str(err)) from None
    print(json.dumps(result) if args.json else format_plan(result, world))
    return 0


def cmd_stages(args, argv: list[str]) -> int:
    """`teacher` runs the teacher stage; `distill` runs it (skipped when done) and then the student stage."""
    from pipeline import dist
    from pipeline.teacher import check_hardware

    running = dist.launched_world()  # started by a launcher (DeepSpeed's, mpirun, srun): its ranks
    if running is not None and args.nproc not in (None, running):
        raise RecipeError("--nproc", args.nproc, f"the launcher started {running} ranks: drop --nproc, "
                          f"or launch {args.nproc}")
    # world size: the running ranks, else --nproc, else the recipe's distributed.nproc
    recipe = load_recipe(args.recipe, args.overrides, world_size=running or args.nproc)
    check_hardware(recipe)
    nproc = args.nproc or recipe.distributed.nproc
    if running is None and nproc > 1:  # validated above, so errors show once, not on every rank
        return dist.relaunch(nproc, "pipeline.cli", _strip_nproc(argv))

    from pipeline.runs import RunDir
    from pipeline.teacher import run_teacher

    ranks = dist.init()
    run = RunDir(args.run_dir or Path("runs") / recipe.name)
    if args.command == "teacher":
        run_teacher(recipe, run, ranks, redo=args.redo)
    else:
        from distill.stage import run_student

        run_teacher(recipe, run, ranks)
        run_student(recipe, run, ranks, redo=args.redo)
    return 0


def _strip_nproc(argv: list[str]) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--nproc":
            skip = True
        elif not a.startswith("--nproc="):
            out.append(a)
    return out


def cmd_predictor(args) -> int:
    from export.serve.placement.predictor import train_command

    try:
        info = train_command(args.package, args.train_blocks, args.val_blocks, args.steps, args.dim, args.seed)
    except (FileNotFoundError, ValueError) as err:
        print(f"predictor error: {err}", file=sys.stderr)
        return 2
    h = info["held_out"]
    for i, layer in enumerate(h["layers"]):
        print(f"[predictor] MoE layer {i} ({layer['experts']} experts): next-token route top-1 "
              f"{layer['top1_accuracy']:.3f} (most frequent expert {layer['frequency_top1_accuracy']:.3f}); "
              f"{h['batch_tokens']}-token step demand error {layer['demand_error']:.3f} "
              f"(frequency baseline {layer['frequency_demand_error']:.3f}), top-k recall {layer['topk_recall']:.3f}")
    print(f"[predictor] stored in {args.package} ({info['seconds']:.0f}s)")
    return 0


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


if __name__ == "__main__":
    sys.exit(main())
