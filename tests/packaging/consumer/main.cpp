// Plans the format's query example (W = 3, docs/plan-format.md section 4)
// and checks a few of its numbers: proof that the library arrived and works.
#include <cpdispatch/cpdispatch.hpp>

#include <cstdint>
#include <cstdio>

int main() {
  using cpdispatch::make_tensor;
  const auto seq_len = make_tensor<std::int64_t>({{5, 3, 4}, {2, 6, 1}, {8, 2, 5}});
  const auto dispatch = make_tensor<std::int64_t>({{0, 0, 1}, {2, 2, 2}, {1, 1, 0}});
  const cpdispatch::QueryMetadata meta = cpdispatch::plan_query(seq_len, dispatch);

  // Rank 2's second shard lands on rank 1 after rank 0's shard (4 tokens) and
  // rank 2's first (8 tokens); rank 1 receives 14 tokens in all.
  const std::int64_t offset = meta.fwd.dst_offset(2, 1);
  const std::int64_t total = meta.fwd.num_recv_tokens(1, 3);
  std::printf("cpdispatch %s: fwd.dst_offset[2][1] = %lld (expected 12), rank 1 receives %lld tokens (expected 14)\n",
              cpdispatch::version_string, static_cast<long long>(offset), static_cast<long long>(total));
  return offset == 12 && total == 14 ? 0 : 1;
}
