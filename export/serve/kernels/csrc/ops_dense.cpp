// One translation unit of the extension: the dense ops' files compiled together (the linears, the quantised
// linears, attention, norms, the output layer's heads, transport, the sampler), as ops_model.cpp compiles the rest.
//
// Why two groups and not a translation unit a file: each one parses torch's headers again (ATen's Tensor alone is
// most of a small file's compile time), so a unit a file took half again as long to build on 2 cores as the one file
// they came from; two units of about equal work build in parallel, in less time than it did. The files stay
// one an op to read; each includes what it uses, and their static names do not collide.
#include "linears.cpp"
#include "quantized.cpp"
#include "attention.cpp"
#include "norms.cpp"
#include "heads.cpp"
#include "transport.cpp"
#include "sampling.cpp"
