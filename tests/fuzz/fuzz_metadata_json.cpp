// Fuzz target: a metadata document (one Metadata, or the query / QKV
// metadata objects) as cpdispatch-plan writes it and a user may hand back.
// Reading and validate() must succeed or throw invalid_input; metadata that
// validates must slice, and simulate() over it must run on buffers of the
// sizes it asks for.

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <span>
#include <vector>

#include "cpdispatch/execute/simulate.hpp"
#include "cpdispatch/io/json.hpp"
#include "fuzz_target.hpp"

namespace {

// Bounds the buffers a valid input may ask for, so one input stays fast.
constexpr std::int64_t max_tokens = 1 << 16;

// Every step on its own: simulate() and get_slice() check what they rely on
// themselves, so they must hold up on metadata that validate() rejects too.
void exercise(const cpdispatch::Metadata& m) {
  cpdispatch_fuzz::expect_valid_or_invalid_input([&] { m.validate("metadata"); });
  cpdispatch_fuzz::expect_valid_or_invalid_input([&] {
    for (std::int64_t r = 0; r < m.world_size; ++r) (void)m.get_slice(r);
  });
  cpdispatch_fuzz::expect_valid_or_invalid_input([&] {
    std::vector<std::vector<std::byte>> in, out;
    for (std::int64_t r = 0; r < m.world_size; ++r) {
      const std::int64_t send = m.send_tokens(r), recv = m.output_tokens(r);
      if (send < 0 || recv < 0 || send > max_tokens || recv > max_tokens) return;
      in.emplace_back(static_cast<std::size_t>(send), std::byte{1});
      out.emplace_back(static_cast<std::size_t>(recv));
    }
    std::vector<cpdispatch::ConstBytes> ins(in.begin(), in.end());
    std::vector<cpdispatch::MutableBytes> outs(out.begin(), out.end());
    cpdispatch::simulate(m, ins, outs, 1);
  });
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  cpdispatch_fuzz::expect_valid_or_invalid_input([&] {
    const nlohmann::json j = cpdispatch::parse_json(cpdispatch_fuzz::as_text(data, size), cpdispatch_fuzz::limits);
    if (j.is_object() && j.contains("q_fwd")) {
      const cpdispatch::QkvMetadata q = cpdispatch::qkv_metadata_from_json(j);
      for (const cpdispatch::Metadata* m : {&q.q_fwd, &q.q_rev, &q.kv_fwd, &q.kv_rev}) exercise(*m);
    } else if (j.is_object() && j.contains("fwd")) {
      const cpdispatch::QueryMetadata q = cpdispatch::query_metadata_from_json(j);
      exercise(q.fwd);
      exercise(q.rev);
    } else {
      exercise(cpdispatch::metadata_from_json(j));
    }
  });
  return 0;
}
