"""What the CPU kernels run with, as /health reports it: the build (instruction set, prefetch hint), the options in
force, and every threshold that picks a path, with its value and the reason it exists.

    from export.serve.kernels.info import describe
    describe()["thresholds"]["ONEDNN_FROM"]    # {"value": 524288, "where": "kernels/weights.py", "why": "..."}

The thresholds are named constants where they are used (a test patches them there); this table is the one place
that lists them all and says why each exists. The benchmarks named in docs/results.md measured where they sit; they
were tuned on 2-core AMD EPYC and Intel Xeon machines, and none is probed at start-up.
"""

from __future__ import annotations

import dataclasses

from export.serve.kernels import experts, extension, heads, options, quantized, weights

# name -> (module, attribute path, why it exists)
THRESHOLDS = {
    "SERVE_FROM": (weights, "SERVE_FROM", "smaller weights stay plain nn.Linear: F.linear's call is the cheapest"),
    "ONEDNN_FROM": (weights, "ONEDNN_FROM", "below it, more rows than the few-row kernel's go to F.linear (as fast, "
                    "and oneDNN would keep a compiled primitive for every row count it meets)"),
    "PACK_ROWS": (weights, "PACK_ROWS", "the row count oneDNN's packed weight layout is chosen for (a decode "
                  "batch's)"),
    "MAX_ROWS": (None, "MAX_ROWS", "rows the few-row kernel takes in one pass (one weight read for all of them)"),
    "AMX_MAX_ROWS": (None, "AMX_MAX_ROWS", "rows up to which a bf16 linear streams its weight once through AMX's "
                     "tiles (more: oneDNN's GEMM, as fast some hundreds of rows on)"),
    "VNNI_MAX_ROWS": (None, "VNNI_MAX_ROWS", "rows the int8 x int8 head screen takes in one pass"),
    "GROUPED_MAX_ROWS": (experts, "GROUPED_MAX_ROWS", "experts' mean rows up to which a layer's experts run in one "
                         "kernel call (more: one GEMM an expert, oneDNN's); any number in bf16 on AMX, or on a build "
                         "without bf16 products, where oneDNN's bf16 GEMM is the slower way"),
    "DEQUANTIZE_ABOVE": (quantized, "DEQUANTIZE_ABOVE", "rows above which a quantised weight is dequantised for one "
                         "oneDNN GEMM (the kernels read it MAX_ROWS rows a pass)"),
    "HeadScreen.GIVE_UP": (heads, "HeadScreen.GIVE_UP", "fallbacks to the whole layer after which a screen stops "
                           "trying (a model whose logits are too flat for its error bound)"),
    "HeadScreen.MOST": (heads, "HeadScreen.MOST", "candidates (all rows of a call) past this share of the outputs: "
                        "the whole layer is cheaper"),
    "HeadScreen.TOPK_MOST": (heads, "HeadScreen.TOPK_MOST", "candidates a top-k row may have, however many rows"),
}


def _value(module, path: str, k):
    if module is None:
        return getattr(k, path, None) if k is not None else None
    obj = module
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def describe() -> dict:
    """The build, the options and the thresholds in force in this process (builds the kernel if it is not yet)."""
    k = extension.kernel()
    return {"isa": extension.cpu_isa(), "kernel": k is not None,
            "prefetch": extension.built_hint() if k is not None else None,
            "options": dataclasses.asdict(options.current()),
            "thresholds": {name: {"value": _value(module, path, k),
                                  "where": f"kernels/{module.__name__.rsplit('.', 1)[-1]}.py" if module else "csrc",
                                  "why": why}
                           for name, (module, path, why) in THRESHOLDS.items()}}
