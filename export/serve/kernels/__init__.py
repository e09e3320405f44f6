"""CPU serving kernels: our C++ extension (csrc/, built at first use) and the Python that serves a model through it.

    from export.serve import kernels
    kernels.serving_linears(model)   # every large enough nn.Linear of a CPU model in eval mode, in place

  options.py    the options in force (serve's kernel flags): configure, current, using
  info.py       what /health reports: the build, the options, every threshold with its reason
  extension.py  the extension: its build per instruction set and prefetch hint, `kernel()`
  weights.py    ServingWeight: a weight and the linear that fits a call's rows (the kernel, AMX, oneDNN, F.linear)
  quantized.py  int8, int4 and W8A8 weights and the quantisation schemes
  heads.py      the output layer's greedy rows screened through an int8 copy (HeadScreen), argmax_rows
  experts.py    an MoE layer's experts in one or two kernel calls
  swaps.py      a model's linears, norms and q/k/v swapped for serving ones, in place (serving_linears)
  mapping.py    weights moved into a file mapping (the ranks' shared-memory sums: export/serve/transport.py)
  csrc/         the C++ sources, one file an op (csrc/kernels.h lists them)
"""

from export.serve.kernels import options
from export.serve.kernels.extension import available, build, cpu_isa, kernel, prefetch_hint
from export.serve.kernels.experts import (GROUPED_MAX_ROWS, combine_pairs, expert_mlps, expert_pairs, expert_tensors,
                                          gathered_layer, grouped_experts, grouped_max_rows, local_layer, route,
                                          routed_layer)
from export.serve.kernels.heads import HeadScreen, QuantizedHeadScreen, argmax_rows
from export.serve.kernels.quantized import (DEQUANTIZE_ABOVE, MORE_INT4, MORE_INT8, MORE_W8A8, QUANTIZED, Int4Weight,
                                            Int8Weight, QuantizedWeight, W8A8Weight, as_scheme, int8_activations,
                                            quantized_kind, quantized_weights, stored_weight, w8a8_reference)
from export.serve.kernels.swaps import (FusedAttention, FusedQKV, ServingLinear, ServingRMSNorm, quantize_linears,
                                        serving_linears, serving_norms)
from export.serve.kernels.options import KernelOptions, configure
from export.serve.kernels.mapping import map_weights
from export.serve.kernels.weights import (MORE_ATEN, MORE_CHUNKS, MORE_ONEDNN, MORE_PLAIN, ONEDNN_FROM, SERVE_FROM,
                                          ServingWeight, bucket, linear, serves, serving_weight)
