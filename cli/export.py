"""The package commands: export (our package, a Hugging Face family's checkpoint, or GGUF) and verify."""

from __future__ import annotations

import json
import sys

from pipeline.artifacts import is_run_dir
from pipeline.schemes import written_by


def cmd_export(args) -> int:
    from export.package import Quantize, export_package, parse_size
    from pipeline.artifacts import read_manifest

    src = args.run / args.stage if is_run_dir(args.run) else args.run
    name = {"hf": f"hf-{args.quantize}" if args.quantize else "hf",
            "gguf": f"gguf/model-{(args.quantize or 'q8_0').upper()}.gguf"}.get(args.format, "package")
    out = args.out or (args.run / name if is_run_dir(args.run) else src.parent / name)
    try:
        formats = written_by(args.format)
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
