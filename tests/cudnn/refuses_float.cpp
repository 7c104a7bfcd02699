// Must not compile: CudnnAttentionKernel takes bfloat16 and float16 only
// (tests/cudnn/CMakeLists.txt checks the static_assert's message).
#include <cpdispatch/cudnn/attention.hpp>

void attend_floats(cpdispatch::cuda::CudnnAttentionKernel& kernel, std::span<const float> in, std::span<float> out,
                   std::span<float> lse) {
  kernel.forward<float>({}, {}, in, in, in, out, lse);
}
