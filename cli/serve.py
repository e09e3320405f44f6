"""The serving commands: serve (an OpenAI-compatible server over a package; its flags are ServeConfig's fields)
and predictor (the expert-demand predictor for serve --placement predictive)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from cli.common import add_nproc, positive_int, relaunch_if_asked


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


def add_serve_flags(p: argparse.ArgumentParser) -> None:
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
    p.add_argument("--max-batch", type=positive_int, default=quiet,
                   help=f"sequences each rank decodes together (default {d['max_batch']})")
    p.add_argument("--max-batched-tokens", type=positive_int, default=quiet,
                   help=f"tokens each rank runs in one step, decode tokens first, then prompt chunks: a longer "
                        f"prompt is prefilled in chunks over several steps (default {d['max_batched_tokens']}; "
                        f"at least --max-batch)")
    p.add_argument("--kv-cache-memory", type=float, metavar="GIB", default=quiet,
                   help="GiB of KV cache per rank, in blocks of --block-size tokens; requests are admitted by free "
                        "blocks and the newest is preempted (recomputed later) when they run out (default: a quarter "
                        "of the memory available at start-up, shared by this machine's ranks, on a GPU 80%% of its "
                        "free memory; at most what --max-batch sequences of --max-model-len fill)")
    p.add_argument("--max-model-len", type=positive_int, default=quiet,
                   help="longest sequence served, prompt + max_tokens (default: the model's context, lowered with a "
                        "printed reason when the KV cache cannot hold one such sequence); longer requests get 400")
    p.add_argument("--block-size", type=positive_int, default=quiet,
                   help=f"tokens per KV block, the unit of allocation and of prefix sharing (default {d['block_size']})")
    p.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false", default=quiet,
                   help="do not share the KV blocks of a common prompt prefix between requests (on by default)")
    p.add_argument("--expert-exchange", choices=_literal(ServeConfig, "expert_exchange"), default=quiet,
                   help="data parallel: how tokens reach their experts' ranks. all-to-all: DeepSpeed comm's "
                        "variable-split all_to_all_single (each rank receives only its tokens); all-reduce: two "
                        "low-latency all-reduces of every rank's routed tokens (DeepSpeed's shared-memory kernel, "
                        "for the ranks of one CPU machine); auto (default): all-reduce there, else all-to-all")
    p.add_argument("--max-prefill-seqs", type=positive_int, default=quiet,
                   help="prompts prefilled together in one forward on a rank (default: every prompt chunk the step's "
                        "token budget takes, in one padded batch; 1: each prompt its own forward)")
    p.add_argument("--max-waiting", type=positive_int, default=quiet,
                   help="sequences waiting for a slot; beyond it new requests get 429 with Retry-After "
                        "(default 4 x --max-batch)")
    p.add_argument("--max-prompts", type=positive_int, default=quiet,
                   help=f"prompts in one request (default {d['max_prompts']})")
    add_nproc(p, ", through the DeepSpeed launcher (default: the largest of --ep-size and --tp-size, else 1)")
    p.add_argument("--ep-size", type=positive_int, default=quiet,
                   help="expert-parallel degree (default: all ranks, at most a layer's experts). Equal to --nproc "
                        "(and every layer's experts divisible by it): data parallel + expert parallel, each rank "
                        "serves its own sequences and tokens cross ranks only in each MoE layer's all-to-all. "
                        "Below --nproc the ranks that hold the same experts slice each expert (expert slicing), "
                        "and every rank then runs the same sequences (one data-parallel group)")
    p.add_argument("--tp-size", type=positive_int, default=quiet,
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
    p.add_argument("--max-body-bytes", type=positive_int, default=quiet,
                   help=f"larger request bodies get 413 (default {d['max_body_bytes']})")
    p.add_argument("--no-checksums", dest="checksums", action="store_false", default=quiet,
                   help="load without verifying every file's sha256 (on by default)")
    kernels = p.add_argument_group("CPU kernels (what /health lists under \"kernels\"; the defaults are the fastest)")
    kernels.add_argument("--cpu-linears", choices=_literal(ServeConfig, "cpu_linears"), default=quiet,
                         help=f"who runs the linears: kernel (our few-row kernel, oneDNN for more rows), onednn (every "
                              f"row count), aten (PyTorch's F.linear, every layer as it is) (default {d['cpu_linears']})")
    kernels.add_argument("--no-head-screen", dest="head_screen", action="store_false", default=quiet,
                         help="greedy and top-k rows read the whole output layer instead of its int8 screen (the same "
                              "tokens; the screen reads about half the bytes)")
    kernels.add_argument("--no-map-weights", dest="map_weights", action="store_false", default=quiet,
                         help="keep the weights in anonymous memory instead of a file mapping (2 MB pages)")
    kernels.add_argument("--no-local-reduce", dest="local_reduce", action="store_false", default=quiet,
                         help="data parallel on one machine: the ranks' sums through DeepSpeed's shared-memory "
                              "all-reduce (it spins while it waits) instead of the kernel's")
    kernels.add_argument("--prefetch", choices=_literal(ServeConfig, "prefetch"), default=quiet,
                         help=f"the kernel's weight prefetch hint: t0 (into every cache level), nta (non-temporal); "
                              f"auto: by CPU vendor (default {d['prefetch']})")
    kernels.add_argument("--attention-kernel-rows", type=int, metavar="TOKENS", default=quiet,
                         help=f"a mixed step's rows of up to this many new tokens attend in the paged-attention kernel, "
                              f"longer ones in scaled_dot_product_attention (default {d['attention_kernel_rows']})")
    kernels.add_argument("--no-malloc-tuning", dest="malloc_tuning", action="store_false", default=quiet,
                         help="leave glibc malloc's thresholds alone (by default tuned for large short-lived tensors)")
    p.add_argument("--smoke", metavar="PROMPT", default=quiet,
                   help="serve, send this one completion over HTTP, print it and shut down (port 0: a free port)")


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

    if (code := relaunch_if_asked(args, argv, relaunch_server)) is not None:
        return code
    from export.package import PackageError
    from export.serve.server import serve

    try:
        return serve(config)
    except (FileNotFoundError, PackageError, ValueError) as err:
        print(f"serve error: {err}", file=sys.stderr)
        return 2


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
