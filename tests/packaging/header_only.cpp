// Header-only use: compiled by tests/packaging/header_only.cmake with the
// compiler alone (-std=c++20 and the include/ folders, no CMake target, no
// generated file). Plans the format's query example (W = 3,
// docs/plan-format.md section 4) and sends one-byte tokens forward and back
// over the sim transport: the round trip must give every rank its tokens back.
#include <cpdispatch/cpdispatch.hpp>
#include <cpdispatch/transports/sim.hpp>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <span>
#include <vector>

int main() {
  using cpdispatch::make_tensor;
  const auto seq_len = make_tensor<std::int64_t>({{5, 3, 4}, {2, 6, 1}, {8, 2, 5}});
  const auto dispatch = make_tensor<std::int64_t>({{0, 0, 1}, {2, 2, 2}, {1, 1, 0}});
  const cpdispatch::QueryMetadata meta = cpdispatch::plan_query(seq_len, dispatch);

  std::vector<int> same(3, 0);
  cpdispatch::SimWorld world(3);
  world.run([&](cpdispatch::SimTransport& t) {
    cpdispatch::Dispatcher<cpdispatch::SimTransport> q(t, meta.fwd, meta.rev, 1);
    const auto& sizes = q.required_bytes();
    std::vector<std::byte> mlp(sizes.mlp_bytes), attention(sizes.attention_bytes), back(sizes.replica_bytes);
    for (std::size_t i = 0; i < mlp.size(); ++i) mlp[i] = static_cast<std::byte>(t.rank() * 64 + static_cast<int>(i));
    q.forward(mlp, attention);
    q.reverse(attention, back);
    same[static_cast<std::size_t>(t.rank())] = back == mlp ? 1 : 0;
  });
  const bool ok = same == std::vector<int>{1, 1, 1};
  std::printf("cpdispatch %s by header inclusion: query round trip on 3 sim ranks %s\n", cpdispatch::version_string,
              ok ? "is the identity" : "FAILED");
  return ok ? 0 : 1;
}
