"""Does llama.cpp run our GGUF as it runs the file of its own converter? The peer benchmark's Qwen3-MoE, both ways.

    bash scripts/peers_setup.sh llama                  # llama.cpp's llama-server and converter, under .peers/ (once)
    .venv/bin/python benchmarks/gguf_interop.py        # Q8_0 and BF16
    .venv/bin/python benchmarks/gguf_interop.py --family mixtral     # a random Mixtral of the same sizes (or olmoe)
    .venv/bin/python benchmarks/gguf_interop.py --types q8_0 --checkpoint DIR

For each type: the checkpoint (peer_bench.py's random Qwen3-MoE, or --checkpoint) written by `moe-pipeline export
--format gguf` (export/gguf.py, from the checkpoint imported as a teacher stage) and by llama.cpp's
convert_hf_to_gguf.py `--outtype`; the two files compared with gguf-py's reader (metadata keys that differ; tensors
whose type, shape or bytes differ); then each served by llama-server on 127.0.0.1 in turn, and 16 greedy tokens of
peer_bench.py's 16 prompts compared token by token (the prompts sent as token ids). Q4_0 is not a converter type
(llama-quantize makes it): with --types q4_0, our file is served and its tokens are compared with our Q8_0 file's.
Prints a table with the CPU, writes gguf_interop.json under --out.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import cpu_info, cpu_line  # noqa: E402
from peer_bench import (LLAMA_SERVER, PEERS, PROMPTS, ROOT, compare, complete, derived_dir, gguf,  # noqa: E402
                        make_checkpoint, our_gguf, serve_llama, served_model, server_greedy)


def file_differences(a: Path, b: Path) -> dict:
    """Metadata keys and tensors that differ between two GGUF files (gguf-py's reader)."""
    import numpy as np
    from gguf import GGUFReader

    ra, rb = GGUFReader(str(a)), GGUFReader(str(b))

    def kv(r):
        return {f.name: f.contents() for f in r.fields.values() if not f.name.startswith("GGUF.")}

    ka, kb = kv(ra), kv(rb)
    ta, tb = {t.name: t for t in ra.tensors}, {t.name: t for t in rb.tensors}
    tensors = sorted(n for n in set(ta) | set(tb) if n not in ta or n not in tb or ta[n].tensor_type != tb[n].tensor_type
                     or list(ta[n].shape) != list(tb[n].shape) or not np.array_equal(ta[n].data, tb[n].data))
    return {"metadata": {k: [str(ka.get(k))[:80], str(kb.get(k))[:80]] for k in sorted(set(ka) | set(kb))
                         if ka.get(k) != kb.get(k)}, "tensors": tensors, "tensor_count": len(ta)}


def greedy_of(path: Path, cores: int, tok, prompts, new: int, log: Path) -> list[dict]:
    with serve_llama(path, cores, log) as (url, _):
        model = served_model(url)
        complete(url, {"model": model, "prompt": "Warm up.", "max_tokens": 4, "temperature": 0})
        return server_greedy(url, model, "llama", tok, prompts, new)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "gguf_interop")
    ap.add_argument("--work", type=Path, default=PEERS / "work")
    ap.add_argument("--checkpoint", type=Path, help="a checkpoint directory (Qwen3-MoE, Qwen2-MoE, OLMoE, Mixtral) "
                                                     "instead of the random one")
    ap.add_argument("--family", default="qwen3_moe", choices=["qwen3_moe", "mixtral", "olmoe"],
                    help="the random checkpoint's family (peer_bench.py's sizes)")
    ap.add_argument("--types", nargs="+", default=["q8_0", "bf16"], choices=["q8_0", "bf16", "q4_0"])
    ap.add_argument("--new-tokens", type=int, default=16)
    args = ap.parse_args(argv)
    args.out, args.work = args.out.resolve(), args.work.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    if not LLAMA_SERVER.is_file():
        raise SystemExit(f"{LLAMA_SERVER} missing: run `bash scripts/peers_setup.sh llama`")
    cpu = cpu_info()
    print(f"CPU: {cpu_line(cpu)}")
    from pipeline import data as data_lib

    ckpt = (args.checkpoint or make_checkpoint(args.work, args.family)).resolve()
    derived = derived_dir(ckpt, args.work)
    tok = data_lib.load_tokenizer(ckpt)
    prompts = [tok(p, add_special_tokens=False).input_ids for p in PROMPTS]
    rows, t0 = {}, time.perf_counter()
    for qtype in args.types:
        ours = our_gguf(ckpt, derived, qtype)
        # no converter Q4_0 (llama-quantize makes it): our Q4_0 against our Q8_0 file
        theirs = our_gguf(ckpt, derived, "q8_0") if qtype == "q4_0" else gguf(ckpt, derived, args.out / "convert.log",
                                                                             qtype)
        diff = file_differences(ours, theirs) if qtype != "q4_0" else None
        g_ours = greedy_of(ours, cpu["cores"], tok, prompts, args.new_tokens, args.out / f"llama-ours-{qtype}.log")
        g_theirs = greedy_of(theirs, cpu["cores"], tok, prompts, args.new_tokens,
                             args.out / f"llama-{'ours-q8_0' if qtype == 'q4_0' else 'converter'}-{qtype}.log")
        agreement = compare(g_ours, g_theirs)
        rows[qtype] = {"ours": str(ours), "against": str(theirs), "file_differences": diff, "agreement": agreement,
                       "greedy_ours": g_ours, "greedy_against": g_theirs}
        print(f"[{qtype}] {agreement}" + (f"; differing tensors {len(diff['tensors'])} of {diff['tensor_count']}, "
                                          f"metadata {list(diff['metadata'])}" if diff else ""), flush=True)
    print(f"\n## llama-server on our GGUF against {'its converter' if args.types != ['q4_0'] else 'our Q8_0'}: "
          f"{len(prompts)} prompts, {args.new_tokens} greedy tokens ({cpu_line(cpu)})\n")
    print("| type | against | prompts with identical tokens | mean common prefix | first token's top-5 max abs "
          "d logprob | differing tensors | differing metadata |")
    print("|---|---|---|---|---|---|---|")
    for qtype, r in rows.items():
        a, d = r["agreement"], r["file_differences"]
        print(f"| {qtype} | {'converter' if d is not None else 'our Q8_0'} | {a['identical']}/{a['prompts']} | "
              f"{a['mean_prefix']:.2f} | {a['max_abs_dlogprob']} | "
              f"{(str(len(d['tensors'])) + ' of ' + str(d['tensor_count'])) if d else '-'} | "
              f"{', '.join(d['metadata']) if d else '-'} |")
    report = {"cpu": cpu, "checkpoint": str(ckpt), "rows": rows, "wall_s": round(time.perf_counter() - t0, 1)}
    (args.out / "gguf_interop.json").write_text(json.dumps(report, indent=1))
    print(f"\n{args.out / 'gguf_interop.json'}")
    return report


if __name__ == "__main__":
    main()
