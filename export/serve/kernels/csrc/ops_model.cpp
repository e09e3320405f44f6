// One translation unit of the extension: the MoE layers, `DecodeModel` and the Python module compiled together
// (ops_dense.cpp says why the files are compiled in groups).
#include "moe.cpp"
#include "decode_model.cpp"
#include "bindings.cpp"
