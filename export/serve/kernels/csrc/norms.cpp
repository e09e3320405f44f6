// RMSNorm in one call.
#include "kernels.h"
#include "norms.h"

// x [..., C] contiguous, weight [C], both fp32 or bf16 alike -> y of x's shape.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  RECORD_FUNCTION("moe_pipeline::rms_norm", std::vector<c10::IValue>({x}));
  TORCH_CHECK(x.dim() >= 1 && weight.dim() == 1 && x.size(-1) == weight.size(0), "rms_norm: x [..., C], weight [C]");
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous() && x.device().is_cpu() && weight.device().is_cpu(),
              "rms_norm: contiguous CPU tensors");
  const auto dt = x.scalar_type();
  TORCH_CHECK((dt == at::kFloat || dt == at::kBFloat16) && weight.scalar_type() == dt,
              "rms_norm: x and weight fp32 or bf16, alike");
  at::Tensor y = at::empty_like(x);
  const int64_t C = x.size(-1), R = C ? x.numel() / C : 0;
  const int64_t grain = std::max<int64_t>(1, (int64_t(64) << 10) / (C * int64_t(x.element_size()) + 1));
  AT_DISPATCH_SWITCH(dt, "rms_norm", AT_DISPATCH_CASE(at::kFloat, [&] {
    at::parallel_for(0, R, grain, [&](int64_t b, int64_t e) {
      rms_norm_rows<scalar_t>(x.data_ptr<scalar_t>(), weight.data_ptr<scalar_t>(), y.data_ptr<scalar_t>(), C,
                              static_cast<float>(eps), b, e);
    });
  }) AT_DISPATCH_CASE(at::kBFloat16, [&] {
    at::parallel_for(0, R, grain, [&](int64_t b, int64_t e) {
      rms_norm_rows<scalar_t>(x.data_ptr<scalar_t>(), weight.data_ptr<scalar_t>(), y.data_ptr<scalar_t>(), C,
                              static_cast<float>(eps), b, e);
    });
  }));
  return y;
}
