// The Dispatcher over MpiTransport against the global simulation: the same
// random plans and inputs give byte-identical outputs (forward Q, reverse Q,
// forward KV, reverse KV + combine, and the helpers' other pairs), for every
// world size mpiexec gives (CTest runs 1 to 4).
#include <cpdispatch/transports/mpi.hpp>

#include <gtest/gtest.h>

#include <climits>
#include <cstddef>
#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

#include "dispatch_helpers.hpp"

namespace cpdispatch {
namespace {

using cptest::Bytes;

struct Config {
  const char* name;
  MpiAllToAll all_to_all;
  std::size_t max_count;
};

void PrintTo(const Config& c, std::ostream* os) { *os << c.name; }

class MpiDispatch : public ::testing::TestWithParam<Config> {
 protected:
  static MpiTransportOptions options() {
    MpiTransportOptions o;
    o.all_to_all = GetParam().all_to_all;
    o.max_count = GetParam().max_count;
    return o;
  }
  MpiTransport t = MpiTransport::duplicate(MPI_COMM_WORLD, options());
  int me = t.rank();
  int W = t.world_size();
};

INSTANTIATE_TEST_SUITE_P(Options, MpiDispatch,
                         ::testing::Values(Config{"alltoallv", MpiAllToAll::alltoallv, INT_MAX},
                                           Config{"point_to_point", MpiAllToAll::point_to_point, INT_MAX},
                                           // Segments above 7 bytes as derived datatypes.
                                           Config{"max_count_7", MpiAllToAll::alltoallv, 7}),
                         [](const ::testing::TestParamInfo<Config>& info) { return std::string(info.param.name); });

TEST_P(MpiDispatch, MatchesTheGlobalSimulationByteForByte) {
  const auto meu = static_cast<std::size_t>(me);
  for (std::uint64_t seed = 1; seed <= 4; ++seed) {
    for (const cptest::PairCase& c : cptest::pair_cases(W, seed)) {
      SCOPED_TRACE(c.name + ", seed " + std::to_string(seed) + ", W = " + std::to_string(W));
      // KV gradients are summed: float32 or bfloat16 elements, 2 or 3 per token.
      const ElementType type = seed % 2 ? ElementType::float32 : ElementType::bfloat16;
      const std::size_t token_bytes = c.kv ? element_size(type) * (seed % 2 ? 2 : 3) : 12;

      Dispatcher<MpiTransport> d(t, c.fwd, c.rev, token_bytes);
      const BufferSizes& sizes = d.required_bytes();

      // Forward: every rank's MLP-layout input, the global simulation, this rank's part.
      const auto mlp = cptest::inputs_for(W, token_bytes, seed, [&](int r) { return c.fwd.send_tokens(r); });
      const auto attention_expected = cptest::simulate_bytes(c.fwd, mlp, token_bytes);
      Bytes attention(sizes.attention_bytes, std::byte{0xA5});
      d.forward(mlp[meu], attention);
      EXPECT_EQ(attention, attention_expected[meu]) << "forward";

      // Reverse: gradients in the attention layout back to the MLP layout / replica buffer.
      std::vector<Bytes> grads;
      for (int r = 0; r < W; ++r) {
        const std::size_t n = static_cast<std::size_t>(c.fwd.output_tokens(r)) * token_bytes;
        grads.push_back(c.kv ? cptest::float_pattern(n, seed * 100 + static_cast<std::uint64_t>(r), type)
                             : cptest::pattern(n, seed * 100 + static_cast<std::uint64_t>(r)));
      }
      const auto replica_expected = cptest::simulate_bytes(c.rev, grads, token_bytes);
      Bytes replica(sizes.replica_bytes, std::byte{0xA5});
      d.reverse(grads[meu], replica);
      EXPECT_EQ(replica, replica_expected[meu]) << "reverse";

      if (!c.kv) {
        Bytes back(sizes.replica_bytes, std::byte{0});
        d.reverse(attention, back);
        EXPECT_EQ(back, mlp[meu]) << "reverse(forward(x)) == x";
        continue;
      }
      // Reverse KV + combine: the copies of each shard summed in fixed order.
      Bytes grad_expected(sizes.mlp_bytes, std::byte{0});
      combine_copies(c.rev.get_slice(me), ConstBytes(replica_expected[meu]), MutableBytes(grad_expected), token_bytes, type);
      Bytes replica2(sizes.replica_bytes, std::byte{0xA5}), grad(sizes.mlp_bytes, std::byte{0});
      d.reverse_combine(grads[meu], replica2, grad, type);
      EXPECT_EQ(replica2, replica_expected[meu]) << "reverse_combine: replica";
      EXPECT_EQ(grad, grad_expected) << "reverse_combine: gradient";
    }
  }
}

}  // namespace
}  // namespace cpdispatch
