// HostAttentionKernel against the double-precision reference over whole
// documents: forward (out, log-sum-exp) and backward (dq, dk, dv), every
// mask, MHA and GQA, several block sizes and thread counts; entries covering
// parts of a document merged through the log-sum-exp, and attended in one
// call that shares their rows; shared-prefix, inverse and bi-causal bands and
// random entries against a brute-force reference; empty entries and rows
// that see nothing; 16-bit types; bad input.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>

#include "../common/counting_allocator.hpp"
#include "attention_case.hpp"
#include "cpdispatch/attention/host_kernel.hpp"
#include "cpdispatch/error.hpp"

// The same tests run on both block-product builds, under names that tell them apart.
#ifdef CPDISPATCH_ATTENTION_CBLAS
#define HOST_KERNEL_SUITE HostAttentionKernelCblas
#else
#define HOST_KERNEL_SUITE HostAttentionKernel
#endif

namespace cpdispatch::testing {
namespace {

constexpr double float_tolerance = 1e-5;
constexpr float nan = std::numeric_limits<float>::quiet_NaN();
constexpr double minus_inf = -std::numeric_limits<double>::infinity();

/// A batch of documents laid out back to back, each attended as one entry.
template <class E>
struct Batch {
  AttentionShape shape;
  std::vector<std::int64_t> cu;
  std::vector<E> q, k, v, dout;

  Batch(AttentionShape s, const std::vector<std::int64_t>& lengths, unsigned seed) : shape(s), cu(prefix_sums(lengths)) {
    std::mt19937 rng(seed);
    const auto t = static_cast<std::size_t>(cu.back());
    q = random_elements<E>(t * static_cast<std::size_t>(s.heads_q * s.head_dim), rng);
    k = random_elements<E>(t * static_cast<std::size_t>(s.heads_kv * s.head_dim), rng);
    v = random_elements<E>(t * static_cast<std::size_t>(s.heads_kv * s.head_dim), rng);
    dout = random_elements<E>(q.size(), rng);
  }
  std::int64_t tokens() const { return cu.back(); }
  std::vector<AttentionEntry> entries(const AttentionMask& mask) const { return layout_entries(cu, cu, mask); }
};

template <class E>
struct Results {
  std::vector<E> out, dq, dk, dv;
  std::vector<float> lse;
};

template <class E>
Results<E> run_kernel(HostAttentionKernel& kernel, const Batch<E>& b, const AttentionMask& mask) {
  Results<E> r{std::vector<E>(b.q.size(), to_element<E>(nan)), std::vector<E>(b.q.size(), to_element<E>(nan)),
               std::vector<E>(b.k.size(), to_element<E>(nan)), std::vector<E>(b.k.size(), to_element<E>(nan)),
               std::vector<float>(static_cast<std::size_t>(b.shape.heads_q * b.tokens()), nan)};
  const auto entries = b.entries(mask);
  kernel.forward<E>(b.shape, entries, b.q, b.k, b.v, r.out, r.lse);
  kernel.backward<E>(b.shape, entries, b.q, b.k, b.v, r.out, r.lse, b.dout, r.dq, r.dk, r.dv);
  return r;
}

/// Per document: the kernel's tensors and the reference's, as doubles.
struct DocumentErrors {
  double out = 0, lse = 0, dq = 0, dk = 0, dv = 0;
};

inline std::vector<double> lse_rows(const std::vector<double>& lse, std::int64_t heads, std::int64_t tokens,
                                    std::int64_t first, std::int64_t count) {
  std::vector<double> x;
  for (std::int64_t h = 0; h < heads; ++h) {
    for (std::int64_t p = first; p < first + count; ++p) x.push_back(lse[static_cast<std::size_t>(h * tokens + p)]);
  }
  return x;
}

template <class E>
DocumentErrors document_errors(const Batch<E>& b, const Results<E>& r, const AttentionMask& mask, std::size_t d) {
  const AttentionShape& s = b.shape;
  const std::int64_t first = b.cu[d], L = b.cu[d + 1] - b.cu[d];
  const std::int64_t wq = s.heads_q * s.head_dim, wk = s.heads_kv * s.head_dim;
  const auto q = rows_of(as_doubles<E>(b.q), first, L, wq), k = rows_of(as_doubles<E>(b.k), first, L, wk);
  const auto v = rows_of(as_doubles<E>(b.v), first, L, wk), dout = rows_of(as_doubles<E>(b.dout), first, L, wq);
  const auto fwd = reference_attention_forward(q, k, v, L, reference_shape(s), mask);
  const auto grad = reference_attention_backward(q, k, v, dout, L, reference_shape(s), mask);
  std::vector<double> lse(r.lse.begin(), r.lse.end());
  return {relative_error(rows_of(as_doubles<E>(r.out), first, L, wq), fwd.out),
          relative_error(lse_rows(lse, s.heads_q, b.tokens(), first, L), lse_rows(fwd.lse, s.heads_q, L, 0, L)),
          relative_error(rows_of(as_doubles<E>(r.dq), first, L, wq), grad.dq),
          relative_error(rows_of(as_doubles<E>(r.dk), first, L, wk), grad.dk),
          relative_error(rows_of(as_doubles<E>(r.dv), first, L, wk), grad.dv)};
}

struct Config {
  AttentionShape shape;
  std::vector<std::int64_t> lengths;
  HostAttentionOptions options;
};

std::vector<Config> float_configs() {
  return {{make_shape(2, 2, 8), {1, 7, 16, 21}, {3, 4, 8}},  // MHA, blocks much smaller than the documents
          {make_shape(4, 1, 5), {13, 3}, {2, 3, 5}},         // GQA, odd head_dim and block sizes
          {make_shape(6, 3, 16), {33}, {1, 128, 256}}};      // GQA, one block per document
}

TEST(HOST_KERNEL_SUITE, FloatMatchesTheReferenceForEveryMask) {
  for (const Config& c : float_configs()) {
    HostAttentionKernel kernel(c.options);
    const Batch<float> batch(c.shape, c.lengths, 7);
    for (const AttentionMask& mask : all_masks()) {
      SCOPED_TRACE(to_string(mask) + ", heads " + std::to_string(c.shape.heads_q) + "/" + std::to_string(c.shape.heads_kv));
      const auto r = run_kernel(kernel, batch, mask);
      for (std::size_t d = 0; d + 1 < batch.cu.size(); ++d) {
        const auto e = document_errors(batch, r, mask, d);
        EXPECT_LE(e.out, float_tolerance) << "document " << d;
        EXPECT_LE(e.lse, float_tolerance) << "document " << d;
        EXPECT_LE(e.dq, float_tolerance) << "document " << d;
        EXPECT_LE(e.dk, float_tolerance) << "document " << d;
        EXPECT_LE(e.dv, float_tolerance) << "document " << d;
      }
    }
  }
}

/// Log-sum-exp merge of partial attentions: out = sum_i exp(lse_i - lse) out_i.
struct Merged {
  std::vector<double> out, lse;
};

/// One document cut into query parts and key parts; every (query part, key
/// part) pair is attended once, n pairs per call (pair i with part (i + shift) mod n,
/// so no call shares a row), each entry with the mask's band in its rows.
TEST(HOST_KERNEL_SUITE, PartsOfADocumentMergeToTheWhole) {
  const AttentionShape s = make_shape(4, 2, 6);
  const std::int64_t L = 19, wq = s.heads_q * s.head_dim;
  const std::vector<std::int64_t> q_cuts{0, 5, 11, 19}, k_cuts{0, 7, 8, 19};
  const std::size_t n = 3;
  const Batch<float> b(s, {L}, 11);
  HostAttentionKernel kernel({2, 4, 4});
  for (const AttentionMask& mask : all_masks()) {
    SCOPED_TRACE(to_string(mask));
    const auto q = as_doubles<float>(b.q), k = as_doubles<float>(b.k), v = as_doubles<float>(b.v);
    const auto fwd = reference_attention_forward(q, k, v, L, reference_shape(s), mask);
    const auto grad = reference_attention_backward(q, k, v, as_doubles<float>(b.dout), L, reference_shape(s), mask);
    std::vector<std::vector<AttentionEntry>> calls;
    for (std::size_t shift = 0; shift < n; ++shift) {
      std::vector<AttentionEntry> entries;
      for (std::size_t i = 0; i < n; ++i) {
        const std::size_t j = (i + shift) % n;
        entries.push_back(part_entry(mask, q_cuts[i], q_cuts[i + 1] - q_cuts[i], k_cuts[j], k_cuts[j + 1] - k_cuts[j],
                                     q_cuts[i] - k_cuts[j]));
      }
      calls.push_back(entries);
    }
    // Forward: merge the parts' outputs through their log-sum-exp.
    std::vector<double> lse(fwd.lse.size(), minus_inf), out(fwd.out.size(), 0.0);
    std::vector<std::vector<float>> part_out, part_lse;
    for (const auto& entries : calls) {
      std::vector<float> o(b.q.size(), nan), l(lse.size(), nan);
      kernel.forward<float>(s, entries, b.q, b.k, b.v, o, l);
      for (std::size_t i = 0; i < lse.size(); ++i) {
        const double m = std::max(lse[i], static_cast<double>(l[i]));
        if (m != minus_inf) lse[i] = m + std::log(std::exp(lse[i] - m) + std::exp(l[i] - m));
      }
      part_out.push_back(o);
      part_lse.push_back(l);
    }
    for (std::size_t c = 0; c < calls.size(); ++c) {
      for (std::int64_t p = 0; p < L; ++p) {
        for (std::int64_t h = 0; h < s.heads_q; ++h) {
          const auto li = static_cast<std::size_t>(h * L + p);
          if (lse[li] == minus_inf) continue;
          const double w = std::exp(part_lse[c][li] - lse[li]);
          for (std::int64_t d = 0; d < s.head_dim; ++d) {
            const auto oi = static_cast<std::size_t>(p * wq + h * s.head_dim + d);
            out[oi] += w * part_out[c][oi];
          }
        }
      }
    }
    EXPECT_LE(relative_error(out, fwd.out), float_tolerance);
    EXPECT_LE(relative_error(lse, fwd.lse), float_tolerance);
    // Backward: each part, given the whole attention's out and lse, yields a share; the shares sum to the whole.
    std::vector<float> whole_out(fwd.out.begin(), fwd.out.end()), whole_lse(fwd.lse.begin(), fwd.lse.end());
    std::vector<double> dq(b.q.size(), 0.0), dk(b.k.size(), 0.0), dv(b.k.size(), 0.0);
    for (const auto& entries : calls) {
      std::vector<float> gq(b.q.size(), nan), gk(b.k.size(), nan), gv(b.k.size(), nan);
      kernel.backward<float>(s, entries, b.q, b.k, b.v, whole_out, whole_lse, b.dout, gq, gk, gv);
      for (std::size_t i = 0; i < dq.size(); ++i) dq[i] += gq[i];
      for (std::size_t i = 0; i < dk.size(); ++i) {
        dk[i] += gk[i];
        dv[i] += gv[i];
      }
    }
    EXPECT_LE(relative_error(dq, grad.dq), float_tolerance);
    EXPECT_LE(relative_error(dk, grad.dk), float_tolerance);
    EXPECT_LE(relative_error(dv, grad.dv), float_tolerance);
  }
}

/// The same parts, all nine in one call: entries share query rows and key
/// rows, and the kernel folds each row's parts into one softmax (forward)
/// and sums each row's shares (backward), so the call alone is the whole.
TEST(HOST_KERNEL_SUITE, PartsSharingRowsInOneCallAreTheWhole) {
  const AttentionShape s = make_shape(4, 2, 6);
  const std::int64_t L = 19;
  const std::vector<std::int64_t> q_cuts{0, 5, 11, 19}, k_cuts{0, 7, 8, 19};
  const Batch<float> b(s, {L}, 11);
  for (const HostAttentionOptions& options : {HostAttentionOptions{2, 4, 4}, HostAttentionOptions{3, 3, 2}}) {
    HostAttentionKernel kernel(options);
    for (const AttentionMask& mask : all_masks()) {
      SCOPED_TRACE(to_string(mask) + ", blocks " + std::to_string(options.block_q) + " x " + std::to_string(options.block_kv));
      std::vector<AttentionEntry> entries;
      for (std::size_t i = 0; i + 1 < q_cuts.size(); ++i) {
        for (std::size_t j = 0; j + 1 < k_cuts.size(); ++j) {
          entries.push_back(part_entry(mask, q_cuts[i], q_cuts[i + 1] - q_cuts[i], k_cuts[j], k_cuts[j + 1] - k_cuts[j],
                                       q_cuts[i] - k_cuts[j]));
        }
      }
      const auto q = as_doubles<float>(b.q), k = as_doubles<float>(b.k), v = as_doubles<float>(b.v);
      const auto fwd = reference_attention_forward(q, k, v, L, reference_shape(s), mask);
      const auto grad = reference_attention_backward(q, k, v, as_doubles<float>(b.dout), L, reference_shape(s), mask);
      std::vector<float> out(b.q.size(), nan), lse(fwd.lse.size(), nan), dq(b.q.size(), nan), dk(b.k.size(), nan),
          dv(b.k.size(), nan);
      kernel.forward<float>(s, entries, b.q, b.k, b.v, out, lse);
      kernel.backward<float>(s, entries, b.q, b.k, b.v, out, lse, b.dout, dq, dk, dv);
      EXPECT_LE(relative_error(as_doubles<float>(out), fwd.out), float_tolerance);
      EXPECT_LE(relative_error(as_doubles<float>(lse), fwd.lse), float_tolerance);
      EXPECT_LE(relative_error(as_doubles<float>(dq), grad.dq), float_tolerance);
      EXPECT_LE(relative_error(as_doubles<float>(dk), grad.dk), float_tolerance);
      EXPECT_LE(relative_error(as_doubles<float>(dv), grad.dv), float_tolerance);
    }
  }
}

/// Inputs of a call over `tokens_q` query and `tokens_kv` key rows, and the
/// kernel's results with outputs starting as 0 and lse as -infinity (what
/// reference_by_entries gives rows outside every entry).
struct EntryCall {
  AttentionShape shape;
  std::vector<float> q, k, v, dout;
  EntryCall(AttentionShape s, std::int64_t tokens_q, std::int64_t tokens_kv, unsigned seed) : shape(s) {
    std::mt19937 rng(seed);
    q = random_elements<float>(static_cast<std::size_t>(tokens_q * s.heads_q * s.head_dim), rng);
    k = random_elements<float>(static_cast<std::size_t>(tokens_kv * s.heads_kv * s.head_dim), rng);
    v = random_elements<float>(k.size(), rng);
    dout = random_elements<float>(q.size(), rng);
  }

  Results<float> run(HostAttentionKernel& kernel, const std::vector<AttentionEntry>& entries) const {
    Results<float> r{std::vector<float>(q.size(), 0.0f), std::vector<float>(q.size(), 0.0f), std::vector<float>(k.size(), 0.0f),
                     std::vector<float>(k.size(), 0.0f),
                     std::vector<float>(q.size() / static_cast<std::size_t>(shape.head_dim), -INFINITY)};
    kernel.forward<float>(shape, entries, q, k, v, r.out, r.lse);
    kernel.backward<float>(shape, entries, q, k, v, r.out, r.lse, dout, r.dq, r.dk, r.dv);
    return r;
  }

  /// Every tensor of the kernel's results within float_tolerance of the brute-force reference.
  void expect_matches_reference(const Results<float>& got, const std::vector<AttentionEntry>& entries) const {
    const auto want = reference_by_entries(as_doubles<float>(q), as_doubles<float>(k), as_doubles<float>(v),
                                           as_doubles<float>(dout), shape, entries);
    EXPECT_LE(relative_error(as_doubles<float>(got.out), want.out), float_tolerance) << "out";
    EXPECT_LE(relative_error(as_doubles<float>(got.lse), want.lse), float_tolerance) << "lse";
    EXPECT_LE(relative_error(as_doubles<float>(got.dq), want.dq), float_tolerance) << "dq";
    EXPECT_LE(relative_error(as_doubles<float>(got.dk), want.dk), float_tolerance) << "dk";
    EXPECT_LE(relative_error(as_doubles<float>(got.dv), want.dv), float_tolerance) << "dv";
  }
};

/// A shared-prefix document (section 2e): a prompt of 7 tokens, causal, and
/// two responses of 5 and 6 that each see the whole prompt and themselves
/// causally. Its slices as entries share the responses' query rows and the
/// prompt's key rows.
std::vector<AttentionEntry> shared_prefix_entries() {
  const Band causal{Band::unbounded_lo, 0}, full{};
  return {{0, 7, 0, 7, causal}, {7, 5, 0, 7, full}, {7, 5, 7, 5, causal}, {12, 6, 0, 7, full}, {12, 6, 12, 6, causal}};
}

TEST(HOST_KERNEL_SUITE, SharedPrefixMatchesTheReference) {
  const EntryCall call(make_shape(4, 2, 6), 18, 18, 61);
  const auto entries = shared_prefix_entries();
  for (const HostAttentionOptions& options : {HostAttentionOptions{2, 4, 4}, HostAttentionOptions{1, 3, 5}, HostAttentionOptions{2, 128, 256}}) {
    SCOPED_TRACE("blocks " + std::to_string(options.block_q) + " x " + std::to_string(options.block_kv));
    HostAttentionKernel kernel(options);
    const auto got = call.run(kernel, entries);
    call.expect_matches_reference(got, entries);
    // The prompt and the first response are one causal document of 12 tokens: the whole-document reference agrees.
    const std::int64_t wq = call.shape.heads_q * call.shape.head_dim;
    const auto doc = reference_attention_forward(rows_of(as_doubles<float>(call.q), 0, 12, wq),
                                                 rows_of(as_doubles<float>(call.k), 0, 12, call.shape.heads_kv * call.shape.head_dim),
                                                 rows_of(as_doubles<float>(call.v), 0, 12, call.shape.heads_kv * call.shape.head_dim), 12,
                                                 reference_shape(call.shape), AttentionMask::causal());
    EXPECT_LE(relative_error(rows_of(as_doubles<float>(got.out), 0, 12, wq), doc.out), float_tolerance);
  }
}

/// Inverse causal (top-left: t - j >= lo) and bi-causal bands, a sliding
/// band that looks both ways, and an empty band, their rows and keys shared.
TEST(HOST_KERNEL_SUITE, InverseAndBiCausalBandsMatchTheReference) {
  const EntryCall call(make_shape(2, 1, 5), 16, 16, 67);
  const std::vector<AttentionEntry> entries{
      {0, 8, 0, 12, {0, Band::unbounded_hi}},  // inverse causal: row j sees keys j and later
      {0, 8, 12, 4, {}},                       // and the last four keys whole
      {8, 8, 0, 16, {-3, 2}},                  // a band around the diagonal, both ways
      {4, 6, 2, 9, {5, 1}},                    // an empty band: nothing
      {10, 6, 3, 6, {-9, -4}},                 // bi-causal: ka - qa <= t - j <= kb - qb
  };
  for (const HostAttentionOptions& options : {HostAttentionOptions{2, 2, 3}, HostAttentionOptions{3, 5, 4}}) {
    SCOPED_TRACE("blocks " + std::to_string(options.block_q) + " x " + std::to_string(options.block_kv));
    HostAttentionKernel kernel(options);
    call.expect_matches_reference(call.run(kernel, entries), entries);
  }
}

/// A band end: open, or a value in [-span, span].
std::int64_t random_band_end(std::mt19937& rng, std::int64_t open, std::int64_t span) {
  if (rng() % 4 == 0) return open;
  return static_cast<std::int64_t>(rng() % static_cast<unsigned>(2 * span + 1)) - span;
}

/// Calls of up to six random entries (random rectangles, bands with open or
/// bounded ends, empty ones included), rows and pairs shared at random.
std::vector<AttentionEntry> random_entries(std::mt19937& rng, std::int64_t tokens_q, std::int64_t tokens_kv) {
  std::vector<AttentionEntry> entries(1 + rng() % 6);
  for (AttentionEntry& e : entries) {
    e.q_start = static_cast<std::int64_t>(rng() % static_cast<unsigned>(tokens_q + 1));
    e.q_len = static_cast<std::int64_t>(rng() % static_cast<unsigned>(tokens_q - e.q_start + 1));
    e.kv_start = static_cast<std::int64_t>(rng() % static_cast<unsigned>(tokens_kv + 1));
    e.kv_len = static_cast<std::int64_t>(rng() % static_cast<unsigned>(tokens_kv - e.kv_start + 1));
    e.band = {random_band_end(rng, Band::unbounded_lo, 20), random_band_end(rng, Band::unbounded_hi, 20)};
  }
  return entries;
}

TEST(HOST_KERNEL_SUITE, RandomEntriesMatchTheReference) {
  const EntryCall call(make_shape(4, 2, 3), 20, 17, 71);
  std::mt19937 rng(73);
  HostAttentionKernel small({2, 3, 4}), large({2, 8, 16});
  for (int round = 0; round < 40; ++round) {
    const auto entries = random_entries(rng, 20, 17);
    SCOPED_TRACE("round " + std::to_string(round));
    call.expect_matches_reference(call.run(small, entries), entries);
    call.expect_matches_reference(call.run(large, entries), entries);
  }
}

/// The rows some entry covers, cut where the covering entries change, each
/// segment's entries in index order; empty ranges cover nothing.
TEST(HOST_KERNEL_SUITE, RowCoverCutsRowsWhereTheirEntriesChange) {
  using cpdispatch::detail::attention::CoverSide;
  using cpdispatch::detail::attention::RowCover;
  const Band full{};
  const std::vector<AttentionEntry> entries{{4, 6, 0, 3, full}, {0, 5, 3, 0, full}, {12, 2, 1, 4, full}, {4, 2, 9, 2, full}, {7, 0, 5, 5, full}};
  RowCover cover;
  cover.build(entries, CoverSide::query);
  struct Seg {
    std::int64_t begin, end, offset;
    std::vector<std::int64_t> ids;
    bool operator==(const Seg&) const = default;
  };
  auto segments = [&] {
    std::vector<Seg> out;
    for (const auto& s : cover.segments()) {
      const auto ids = cover.entries_of(s);
      out.push_back({s.begin, s.end, s.offset, {ids.begin(), ids.end()}});
    }
    return out;
  };
  EXPECT_EQ(segments(), (std::vector<Seg>{{0, 4, 0, {1}}, {4, 5, 4, {0, 1, 3}}, {5, 6, 5, {0, 3}}, {6, 10, 6, {0}}, {12, 14, 10, {2}}}));
  EXPECT_EQ(cover.rows(), 12);
  EXPECT_EQ(cover.end(), 14);
  cover.build(entries, CoverSide::key);  // entry 1 has no keys; entry 4's keys have no queries but are covered
  EXPECT_EQ(segments(), (std::vector<Seg>{{0, 1, 0, {0}}, {1, 3, 1, {0, 2}}, {3, 5, 3, {2}}, {5, 9, 5, {4}}, {9, 10, 9, {3, 4}}, {10, 11, 10, {3}}}));
  cover.build({}, CoverSide::query);
  EXPECT_TRUE(cover.segments().empty());
  EXPECT_EQ(cover.rows(), 0);
}

/// Entries without keys or without queries, rows that see no key and keys no
/// row sees: zeros and -infinity where the concept says so, and rows outside
/// every entry left as they were.
TEST(HOST_KERNEL_SUITE, EmptyEntriesAndRowsThatSeeNothing) {
  const AttentionShape s = make_shape(2, 1, 4);
  const std::int64_t tokens = 12;
  std::mt19937 rng(3);
  const auto q = random_elements<float>(static_cast<std::size_t>(tokens * 8), rng);
  const auto k = random_elements<float>(static_cast<std::size_t>(tokens * 4), rng);
  const auto v = random_elements<float>(k.size(), rng);
  const auto dout = random_elements<float>(q.size(), rng);
  const AttentionMask causal = AttentionMask::causal();
  const std::vector<AttentionEntry> entries{
      part_entry(causal, 0, 3, 0, 0, 0),    // query rows 0-2 without keys
      part_entry(causal, 3, 0, 0, 3, 0),    // key rows 0-2 without queries
      part_entry(causal, 3, 4, 3, 4, -2),   // rows 3, 4 see nothing, row 5 key 3, row 6 keys 3, 4; keys 5, 6 unseen
      part_entry(causal, 7, 4, 7, 4, -10),  // every row before every key: nothing is seen
  };
  HostAttentionKernel kernel({2, 2, 2});
  constexpr float untouched = 42.0f;
  std::vector<float> out(q.size(), untouched), lse(static_cast<std::size_t>(2 * tokens), untouched);
  kernel.forward<float>(s, entries, q, k, v, out, lse);
  std::vector<float> dq(q.size(), untouched), dk(k.size(), untouched), dv(k.size(), untouched);
  kernel.backward<float>(s, entries, q, k, v, out, lse, dout, dq, dk, dv);
  auto q_row_zero = [&](const std::vector<float>& x, std::int64_t row) {
    for (std::int64_t i = row * 8; i < row * 8 + 8; ++i) {
      if (x[static_cast<std::size_t>(i)] != 0.0f) return false;
    }
    return true;
  };
  for (std::int64_t row : {0, 1, 2, 3, 4, 7, 8, 9, 10}) {
    EXPECT_TRUE(q_row_zero(out, row)) << "out row " << row;
    EXPECT_TRUE(q_row_zero(dq, row)) << "dq row " << row;
    for (std::int64_t h = 0; h < 2; ++h) EXPECT_EQ(lse[static_cast<std::size_t>(h * tokens + row)], -INFINITY) << row;
  }
  for (std::int64_t row : {5, 6}) {  // row 5 sees key 3, row 6 keys 3 and 4
    EXPECT_FALSE(q_row_zero(out, row)) << "out row " << row;
    EXPECT_TRUE(std::isfinite(lse[static_cast<std::size_t>(row)]));
  }
  for (std::int64_t row : {0, 1, 2, 5, 6, 7, 8, 9, 10}) {  // keys nobody sees
    for (std::int64_t i = row * 4; i < row * 4 + 4; ++i) {
      EXPECT_EQ(dk[static_cast<std::size_t>(i)], 0.0f) << "dk row " << row;
      EXPECT_EQ(dv[static_cast<std::size_t>(i)], 0.0f) << "dv row " << row;
    }
  }
  for (std::int64_t i = 11 * 8; i < 12 * 8; ++i) {  // row 11 belongs to no entry
    EXPECT_EQ(out[static_cast<std::size_t>(i)], untouched);
    EXPECT_EQ(dq[static_cast<std::size_t>(i)], untouched);
  }
  for (std::int64_t i = 11 * 4; i < 12 * 4; ++i) EXPECT_EQ(dk[static_cast<std::size_t>(i)], untouched);
  EXPECT_EQ(lse[11], untouched);
  EXPECT_EQ(lse[tokens + 11], untouched);
}

/// A window wider than every document is the causal mask (and its bounds do not overflow).
TEST(HOST_KERNEL_SUITE, AHugeWindowIsCausal) {
  const Batch<float> batch(make_shape(2, 1, 4), {7, 12}, 13);
  HostAttentionKernel kernel({2, 4, 4});
  const auto huge = AttentionMask::sliding_window(std::numeric_limits<std::int64_t>::max());
  EXPECT_EQ(batch.entries(huge), batch.entries(AttentionMask::causal()));  // the band's lower end left open
  const auto wide = run_kernel(kernel, batch, huge);
  const auto causal = run_kernel(kernel, batch, AttentionMask::causal());
  EXPECT_EQ(wide.out, causal.out);
  EXPECT_EQ(wide.lse, causal.lse);
  EXPECT_EQ(wide.dq, causal.dq);
  EXPECT_EQ(wide.dk, causal.dk);
}

/// True when x and y hold the same bytes (unlike ==, +0 differs from -0 and a NaN matches itself).
template <class T>
bool same_bytes(const std::vector<T>& x, const std::vector<T>& y) {
  return x.size() == y.size() && (x.empty() || std::memcmp(x.data(), y.data(), x.size() * sizeof(T)) == 0);
}

/// Every output element is summed by one thread in a fixed order.
TEST(HOST_KERNEL_SUITE, ResultsAreBitwiseTheSameForEveryThreadCount) {
  const Batch<float> batch(make_shape(4, 2, 8), {9, 30, 2}, 5);
  HostAttentionKernel one({1, 4, 8}), four({4, 4, 8});
  for (const AttentionMask& mask : {AttentionMask::causal(), AttentionMask::sliding_window(5)}) {
    const auto a = run_kernel(one, batch, mask), b = run_kernel(four, batch, mask), c = run_kernel(four, batch, mask);
    for (const auto* r : {&b, &c}) {
      const char* which = r == &b ? "four threads" : "four threads, again";
      EXPECT_TRUE(same_bytes(a.out, r->out)) << which;
      EXPECT_TRUE(same_bytes(a.lse, r->lse)) << which;
      EXPECT_TRUE(same_bytes(a.dq, r->dq)) << which;
      EXPECT_TRUE(same_bytes(a.dk, r->dk)) << which;
      EXPECT_TRUE(same_bytes(a.dv, r->dv)) << which;
    }
  }
  // Entries sharing rows: each row's entries are folded in index order, whatever thread takes the row.
  const EntryCall call(make_shape(4, 2, 8), 18, 18, 79);
  std::mt19937 rng(83);
  for (const auto& entries : {shared_prefix_entries(), random_entries(rng, 18, 18), random_entries(rng, 18, 18)}) {
    const auto a = call.run(one, entries), b = call.run(four, entries), c = call.run(four, entries);
    for (const auto* r : {&b, &c}) {
      const char* which = r == &b ? "shared rows, four threads" : "shared rows, four threads, again";
      EXPECT_TRUE(same_bytes(a.out, r->out)) << which;
      EXPECT_TRUE(same_bytes(a.lse, r->lse)) << which;
      EXPECT_TRUE(same_bytes(a.dq, r->dq)) << which;
      EXPECT_TRUE(same_bytes(a.dk, r->dk)) << which;
      EXPECT_TRUE(same_bytes(a.dv, r->dv)) << which;
    }
  }
}


/// The straightforward 16-bit computation (as a framework without a fused
/// kernel does it): scores, probabilities, output and every gradient product
/// rounded to E, sums in fp32. Its error against the double reference is the
/// yardstick for the kernel's in E.
template <class E>
struct Straightforward {
  static float r(float x) { return static_cast<float>(to_element<E>(x)); }

  static Results<E> run(const Batch<E>& b, const AttentionMask& mask) {
    const AttentionShape& s = b.shape;
    const std::int64_t T = b.tokens(), D = s.head_dim, group = s.heads_q / s.heads_kv;
    std::vector<float> out(b.q.size(), 0.0f), dq(b.q.size(), 0.0f), dk(b.k.size(), 0.0f), dv(b.k.size(), 0.0f);
    std::vector<float> lse(static_cast<std::size_t>(s.heads_q * T), -INFINITY);
    auto at = [](const std::vector<E>& x, std::int64_t i) { return static_cast<float>(x[static_cast<std::size_t>(i)]); };
    for (std::size_t doc = 0; doc + 1 < b.cu.size(); ++doc) {
      const std::int64_t first = b.cu[doc], L = b.cu[doc + 1] - first;
      for (std::int64_t h = 0; h < s.heads_q; ++h) {
        const std::int64_t g = h / group;
        for (std::int64_t p = 0; p < L; ++p) {
          const std::int64_t qi = ((first + p) * s.heads_q + h) * D;
          std::vector<float> prob(static_cast<std::size_t>(L), 0.0f), dprob(static_cast<std::size_t>(L), 0.0f);
          float m = -INFINITY;
          for (std::int64_t t = 0; t < L; ++t) {
            if (!mask.sees(p, t)) continue;
            float dot = 0;
            for (std::int64_t d = 0; d < D; ++d) dot += at(b.q, qi + d) * at(b.k, ((first + t) * s.heads_kv + g) * D + d);
            prob[static_cast<std::size_t>(t)] = r(dot * s.softmax_scale);
            m = std::max(m, prob[static_cast<std::size_t>(t)]);
          }
          if (m == -INFINITY) continue;
          float sum = 0;
          for (std::int64_t t = 0; t < L; ++t) sum += mask.sees(p, t) ? std::exp(prob[static_cast<std::size_t>(t)] - m) : 0.0f;
          lse[static_cast<std::size_t>(h * T + first + p)] = m + std::log(sum);
          for (std::int64_t t = 0; t < L; ++t) {
            auto& x = prob[static_cast<std::size_t>(t)];
            x = mask.sees(p, t) ? r(std::exp(x - m) / sum) : 0.0f;
          }
          std::vector<float> o(static_cast<std::size_t>(D), 0.0f);
          for (std::int64_t t = 0; t < L; ++t) {
            for (std::int64_t d = 0; d < D; ++d) {
              o[static_cast<std::size_t>(d)] += prob[static_cast<std::size_t>(t)] * at(b.v, ((first + t) * s.heads_kv + g) * D + d);
            }
          }
          float delta = 0;
          for (std::int64_t d = 0; d < D; ++d) {
            out[static_cast<std::size_t>(qi + d)] = r(o[static_cast<std::size_t>(d)]);
            delta += out[static_cast<std::size_t>(qi + d)] * at(b.dout, qi + d);
          }
          for (std::int64_t t = 0; t < L; ++t) {
            const std::int64_t ki = ((first + t) * s.heads_kv + g) * D;
            float dp = 0;
            for (std::int64_t d = 0; d < D; ++d) dp += at(b.dout, qi + d) * at(b.v, ki + d);
            const float pt = prob[static_cast<std::size_t>(t)];
            const float ds = r(pt * (r(dp) - delta));
            for (std::int64_t d = 0; d < D; ++d) {
              dv[static_cast<std::size_t>(ki + d)] += pt * at(b.dout, qi + d);
              dq[static_cast<std::size_t>(qi + d)] += ds * at(b.k, ki + d) * s.softmax_scale;
              dk[static_cast<std::size_t>(ki + d)] += ds * at(b.q, qi + d) * s.softmax_scale;
            }
          }
        }
      }
    }
    auto round_all = [](const std::vector<float>& x) {
      std::vector<E> y(x.size());
      for (std::size_t i = 0; i < x.size(); ++i) y[i] = to_element<E>(x[i]);
      return y;
    };
    return {round_all(out), round_all(dq), round_all(dk), round_all(dv), lse};
  }
};

/// flash-attention's rule for 16-bit types: the kernel's error against the
/// double reference (on the same rounded inputs) is at most twice the
/// straightforward 16-bit computation's, plus 1e-6 of the largest magnitude
/// for tensors the straightforward computation happens to get exact.
template <class E>
void expect_within_twice_the_straightforward_error() {
  for (const Config& c : float_configs()) {
    HostAttentionKernel kernel(c.options);
    const Batch<E> batch(c.shape, c.lengths, 19);
    for (const AttentionMask& mask : all_masks()) {
      SCOPED_TRACE(to_string(mask) + ", heads " + std::to_string(c.shape.heads_q) + "/" + std::to_string(c.shape.heads_kv));
      const auto got = run_kernel(kernel, batch, mask);
      const auto plain = Straightforward<E>::run(batch, mask);
      for (std::size_t d = 0; d + 1 < batch.cu.size(); ++d) {
        const auto e = document_errors(batch, got, mask, d), p = document_errors(batch, plain, mask, d);
        EXPECT_TRUE(within_twice(e.out, p.out)) << "out of document " << d;
        EXPECT_TRUE(within_twice(e.lse, p.lse)) << "lse of document " << d;
        EXPECT_TRUE(within_twice(e.dq, p.dq)) << "dq of document " << d;
        EXPECT_TRUE(within_twice(e.dk, p.dk)) << "dk of document " << d;
        EXPECT_TRUE(within_twice(e.dv, p.dv)) << "dv of document " << d;
      }
    }
  }
}

TEST(HOST_KERNEL_SUITE, Bfloat16WithinTwiceTheStraightforwardError) { expect_within_twice_the_straightforward_error<bfloat16>(); }
TEST(HOST_KERNEL_SUITE, Float16WithinTwiceTheStraightforwardError) { expect_within_twice_the_straightforward_error<float16>(); }

/// Scratch is grown to fit and kept: once a call of some sizes has run, calls
/// of those sizes or smaller allocate nothing (the op's replan relies on it).
TEST(HOST_KERNEL_SUITE, RepeatedCallsAllocateNothing) {
  const Batch<bfloat16> big(make_shape(4, 2, 8), {20, 13}, 3), small(make_shape(4, 2, 8), {6, 9}, 4);
  HostAttentionKernel kernel({3, 4, 8});
  auto r = run_kernel(kernel, big, AttentionMask::causal());
  std::vector<bfloat16> out(small.q.size()), dq(small.q.size()), dk(small.k.size()), dv(small.k.size());
  std::vector<float> lse(static_cast<std::size_t>(4 * small.tokens()));
  const auto entries = small.entries(AttentionMask::sliding_window(3));
  const auto used = counting_allocator::count([&] {
    for (int step = 0; step < 3; ++step) {
      kernel.forward<bfloat16>(small.shape, entries, small.q, small.k, small.v, out, lse);
      kernel.backward<bfloat16>(small.shape, entries, small.q, small.k, small.v, out, lse, small.dout, dq, dk, dv);
    }
  });
  EXPECT_EQ(used.total, 0u);
  EXPECT_FALSE(r.out.empty());
}

/// Every broken rule is an invalid_input naming the field.
TEST(HOST_KERNEL_SUITE, BadInputIsRefusedWithTheFieldNamed) {
  const Batch<float> b(make_shape(4, 2, 4), {6}, 1);
  HostAttentionKernel kernel({1, 4, 4});
  std::vector<float> out(b.q.size()), lse(4 * 6), dq(b.q.size()), dk(b.k.size()), dv(b.k.size());
  const auto entries = b.entries(AttentionMask::causal());
  auto forward = [&](AttentionShape s, std::vector<AttentionEntry> e, std::size_t out_size) {
    std::vector<float> o(out_size);
    kernel.forward<float>(s, e, b.q, b.k, b.v, o, lse);
  };
  using ::testing::HasSubstr;
  auto expect_refused = [](auto&& call, const std::string& what) {
    try {
      call();
      ADD_FAILURE() << "no error; expected one naming " << what;
    } catch (const invalid_input& e) {
      EXPECT_THAT(e.what(), HasSubstr(what));
    }
  };
  const Band causal{Band::unbounded_lo, 0};
  const std::int64_t beyond = (std::int64_t{1} << 62) + 1;
  expect_refused([&] { forward(make_shape(4, 3, 4), entries, out.size()); }, "heads_kv");
  expect_refused([&] { forward(make_shape(4, 2, 0), entries, out.size()); }, "head_dim");
  expect_refused([&] { forward(AttentionShape{4, 2, 4, NAN}, entries, out.size()); }, "softmax_scale");
  expect_refused([&] { layout_entries(b.cu, b.cu, AttentionMask{MaskType::sliding_window, 0}); }, "mask.window");
  expect_refused([&] { forward(b.shape, entries, out.size() - 1); }, "out");
  expect_refused([&] { forward(b.shape, {{0, 7, 0, 6, causal}}, out.size()); }, "entries[0] has query rows");
  expect_refused([&] { forward(b.shape, {{0, 6, 2, 5, causal}}, out.size()); }, "entries[0] has key-value rows");
  expect_refused([&] { forward(b.shape, {{0, 3, 0, 3, {Band::unbounded_lo, beyond}}}, out.size()); }, "entries[0].band.hi");
  expect_refused([&] { forward(b.shape, {{0, 3, 0, 3, {-beyond, 0}}}, out.size()); }, "entries[0].band.lo");
  // Entries that share rows are the concept's own; a kernel that cannot fold them refuses them by this check.
  cpdispatch::detail::attention::CallCheck separate;
  expect_refused([&] { separate.separate_rows("K", "forward", std::vector<AttentionEntry>{{0, 3, 0, 3, causal}, {2, 3, 3, 3, causal}}); },
                 "share query rows");
  expect_refused([&] { separate.separate_rows("K", "forward", std::vector<AttentionEntry>{{0, 3, 0, 3, causal}, {3, 3, 2, 3, causal}}); },
                 "share key-value rows");
  EXPECT_NO_THROW(forward(b.shape, {{0, 3, 0, 3, causal}, {2, 3, 3, 3, causal}}, out.size()));
  EXPECT_NO_THROW(forward(b.shape, {{0, 3, 0, 3, {5, 2}}}, out.size()));  // an empty band: the entry sees nothing
  expect_refused([&] { kernel.backward<float>(b.shape, entries, b.q, b.k, b.v, out, lse, b.dout, dq, dk, std::span<float>(dv).first(3)); }, "dv");
  expect_refused([&] { kernel.backward<float>(b.shape, entries, b.q, b.k, b.v, out, std::span<const float>(lse).first(3), b.dout, dq, dk, dv); }, "lse");
  expect_refused([&] { HostAttentionKernel k2({-1, 4, 4}); }, "threads");
  expect_refused([&] { HostAttentionKernel k2({1, 0, 4}); }, "block_q");
}

}  // namespace
}  // namespace cpdispatch::testing
