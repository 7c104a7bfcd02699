// MpiTransport under mpiexec (any number of ranks; CTest runs 2 and 4).
#include <cpdispatch/transports/mpi.hpp>

#include <gtest/gtest.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <ostream>
#include <string>
#include <type_traits>
#include <vector>

namespace cpdispatch {
namespace {

using namespace std::chrono_literals;

static_assert(Transport<MpiTransport>);
static_assert(MpiTransport::memory_space == MemorySpace::host);
static_assert(std::is_base_of_v<backend_error, mpi_error> && std::is_base_of_v<error, mpi_error>);
static_assert(std::is_base_of_v<backend_error, timeout_error>);
static_assert(!std::is_copy_constructible_v<MpiTransport> && std::is_nothrow_move_constructible_v<MpiTransport>);

/// The option sets every data-moving test runs under.
struct Config {
  const char* name;
  MpiTransportOptions options;
};

MpiTransportOptions options_with(std::size_t max_count, MpiAllToAll all_to_all, std::chrono::milliseconds timeout) {
  MpiTransportOptions o;
  o.max_count = max_count;
  o.all_to_all = all_to_all;
  o.timeout = timeout;
  return o;
}

void PrintTo(const Config& c, std::ostream* os) { *os << c.name; }

const std::vector<Config>& configs() {
  static const std::vector<Config> all = {
      {"alltoallv", options_with(INT_MAX, MpiAllToAll::alltoallv, 0ms)},
      {"point_to_point", options_with(INT_MAX, MpiAllToAll::point_to_point, 0ms)},
      // Everything above 5 bytes / elements takes the large-count path:
      // derived datatypes, chunked reductions, point-to-point all-to-all.
      {"max_count_5", options_with(5, MpiAllToAll::alltoallv, 0ms)},
      // Non-blocking collectives and the MPI_Test loop.
      {"timeout", options_with(INT_MAX, MpiAllToAll::alltoallv, 60s)},
      {"max_count_5_timeout", options_with(5, MpiAllToAll::alltoallv, 60s)},
  };
  return all;
}

std::byte pattern(int src, int dst, std::size_t i) {
  return static_cast<std::byte>((src * 31 + dst * 17 + static_cast<int>(i % 251) * 7 + 1) & 0xff);
}

class MpiTransportP : public ::testing::TestWithParam<Config> {
 protected:
  MpiTransport t = MpiTransport::duplicate(MPI_COMM_WORLD, GetParam().options);
  int me = t.rank();
  int W = t.world_size();
};

INSTANTIATE_TEST_SUITE_P(Options, MpiTransportP, ::testing::ValuesIn(configs()),
                         [](const ::testing::TestParamInfo<Config>& info) { return std::string(info.param.name); });

// ---- all_to_all_v ------------------------------------------------------------

/// Bytes rank s sends rank d: uneven, zero for some pairs (self included).
std::size_t bytes_between(int s, int d) { return static_cast<std::size_t>((s * 7 + d * 3 + 1) % 5) * 13; }

TEST_P(MpiTransportP, AllToAllVMovesUnevenCountsWithGapsAndSelf) {
  const auto Wu = static_cast<std::size_t>(W);
  // Send segments in reverse destination order with 2-byte gaps; receive
  // segments in source order with 3-byte gaps that must stay untouched.
  std::vector<std::size_t> sc(Wu), sd(Wu), rc(Wu), rd(Wu);
  std::size_t at = 0;
  for (int d = W - 1; d >= 0; --d) {
    const auto du = static_cast<std::size_t>(d);
    sc[du] = bytes_between(me, d);
    sd[du] = at;
    at += sc[du] + 2;
  }
  std::vector<std::byte> send(at, std::byte{0x55});
  for (int d = 0; d < W; ++d) {
    const auto du = static_cast<std::size_t>(d);
    for (std::size_t i = 0; i < sc[du]; ++i) send[sd[du] + i] = pattern(me, d, i);
  }
  at = 3;
  for (int s = 0; s < W; ++s) {
    const auto su = static_cast<std::size_t>(s);
    rc[su] = bytes_between(s, me);
    rd[su] = at;
    at += rc[su] + 3;
  }
  std::vector<std::byte> recv(at, std::byte{0xEE});

  t.all_to_all_v(send.data(), sc, sd, recv.data(), rc, rd);

  std::vector<std::byte> expected(at, std::byte{0xEE});
  for (int s = 0; s < W; ++s) {
    const auto su = static_cast<std::size_t>(s);
    for (std::size_t i = 0; i < rc[su]; ++i) expected[rd[su] + i] = pattern(s, me, i);
  }
  EXPECT_EQ(recv, expected);
}

/// One byte from every rank to every rank arrives where it belongs; a
/// transport left with stray or half-done messages fails this.
::testing::AssertionResult one_byte_each_arrives(MpiTransport& t) {
  const int me = t.rank();
  const auto Wu = static_cast<std::size_t>(t.world_size());
  std::vector<std::size_t> ones(Wu, 1), displs(Wu);
  std::vector<std::byte> out(Wu), in(Wu, std::byte{0xEE}), want(Wu);
  for (std::size_t i = 0; i < Wu; ++i) {
    displs[i] = i;
    out[i] = pattern(me, static_cast<int>(i), 0);
    want[i] = pattern(static_cast<int>(i), me, 0);
  }
  t.all_to_all_v(out.data(), ones, displs, in.data(), ones, displs);
  for (std::size_t s = 0; s < Wu; ++s) {
    if (in[s] != want[s]) {
      return ::testing::AssertionFailure() << "rank " << me << ": the byte from rank " << s << " is " << static_cast<int>(in[s])
                                           << ", expected " << static_cast<int>(want[s]);
    }
  }
  return ::testing::AssertionSuccess();
}

TEST_P(MpiTransportP, AllToAllVWithNothingToMove) {
  const auto Wu = static_cast<std::size_t>(W);
  const std::vector<std::size_t> zeros(Wu, 0);
  ASSERT_NO_THROW(t.all_to_all_v(nullptr, zeros, zeros, nullptr, zeros, zeros));
  // With buffers and displacements inside them, nothing is written either.
  std::vector<std::size_t> displs(Wu);
  for (std::size_t i = 0; i < Wu; ++i) displs[i] = i;
  const std::vector<std::byte> send(Wu, std::byte{0x55});
  std::vector<std::byte> recv(Wu, std::byte{0xEE});
  ASSERT_NO_THROW(t.all_to_all_v(send.data(), zeros, displs, recv.data(), zeros, displs));
  EXPECT_EQ(recv, std::vector<std::byte>(Wu, std::byte{0xEE}));
  // And the empty exchanges left nothing behind for a later one to match.
  EXPECT_TRUE(one_byte_each_arrives(t));
}

TEST_P(MpiTransportP, AllToAllVSelfOnly) {
  const auto Wu = static_cast<std::size_t>(W), meu = static_cast<std::size_t>(me);
  std::vector<std::size_t> counts(Wu, 0), displs(Wu, 0);
  counts[meu] = 17;
  std::vector<std::byte> send(17), recv(17, std::byte{0});
  for (std::size_t i = 0; i < 17; ++i) send[i] = pattern(me, me, i);
  t.all_to_all_v(send.data(), counts, displs, recv.data(), counts, displs);
  EXPECT_EQ(recv, send);
}

TEST_P(MpiTransportP, AllToAllVRejectsSpansOfTheWrongSize) {
  const std::vector<std::size_t> good(static_cast<std::size_t>(W), 0), bad(static_cast<std::size_t>(W) + 1, 0);
  try {
    t.all_to_all_v(nullptr, good, good, nullptr, bad, good);
    FAIL() << "no exception";
  } catch (const invalid_input& e) {
    EXPECT_NE(std::string(e.what()).find("recv_counts has " + std::to_string(W + 1) + " entries, world_size is " +
                                         std::to_string(W)),
              std::string::npos)
        << e.what();
  }
}

// ---- isend / irecv / wait ----------------------------------------------------

TEST_P(MpiTransportP, PointToPointMessagesOfAPairMatchInPostingOrderWhateverTheTags) {
  // Every rank sends every rank (itself included) three messages on tag 5,
  // of 4, 0 and 11 bytes, then one on tag 1 and one on tag 2.
  const std::size_t sizes[3] = {4, 0, 11};
  const auto Wu = static_cast<std::size_t>(W);
  std::vector<std::vector<std::byte>> out(Wu * 5), in(Wu * 5);
  std::vector<Request> recvs, sends;
  for (int p = 0; p < W; ++p) {
    const auto pu = static_cast<std::size_t>(p);
    for (std::size_t k = 0; k < 3; ++k) {
      in[pu * 5 + k].assign(sizes[k], std::byte{0});
      recvs.push_back(t.irecv(in[pu * 5 + k].data(), sizes[k], p, 5));
    }
    // Receives labelled 2 then 1 get the messages labelled 1 then 2: tags
    // take no part in matching (the point-to-point contract, transport.hpp).
    in[pu * 5 + 3].assign(6, std::byte{0});
    recvs.push_back(t.irecv(in[pu * 5 + 3].data(), 6, p, 2));
    in[pu * 5 + 4].assign(6, std::byte{0});
    recvs.push_back(t.irecv(in[pu * 5 + 4].data(), 6, p, 1));
  }
  for (int p = 0; p < W; ++p) {
    const auto pu = static_cast<std::size_t>(p);
    for (std::size_t k = 0; k < 5; ++k) {
      const std::size_t n = k < 3 ? sizes[k] : 6;
      out[pu * 5 + k].resize(n);
      for (std::size_t i = 0; i < n; ++i) out[pu * 5 + k][i] = pattern(me, p, i + 100 * k);
    }
    for (std::size_t k = 0; k < 3; ++k) sends.push_back(t.isend(out[pu * 5 + k].data(), sizes[k], p, 5));
    sends.push_back(t.isend(out[pu * 5 + 3].data(), 6, p, 1));
    sends.push_back(t.isend(out[pu * 5 + 4].data(), 6, p, 2));
  }
  // Waiting in reverse order changes nothing.
  for (auto it = recvs.rbegin(); it != recvs.rend(); ++it) t.wait(*it);
  for (Request r : sends) t.wait(r);
  for (int p = 0; p < W; ++p) {
    const auto pu = static_cast<std::size_t>(p);
    for (std::size_t k = 0; k < 5; ++k) {
      std::vector<std::byte> expected(in[pu * 5 + k].size());
      for (std::size_t i = 0; i < expected.size(); ++i) expected[i] = pattern(p, me, i + 100 * k);
      EXPECT_EQ(in[pu * 5 + k], expected) << "message " << k << " from rank " << p;
    }
  }
}

TEST_P(MpiTransportP, RequestIdsAreReusedButStaleOnesAreRejected) {
  std::byte a{1}, b{0};
  const Request r1 = t.irecv(&b, 1, me, 9);
  t.wait(t.isend(&a, 1, me, 9));
  t.wait(r1);
  EXPECT_EQ(b, a);
  EXPECT_THROW(t.wait(r1), invalid_input);  // already waited for
  const Request r2 = t.irecv(&b, 1, me, 9);  // reuses r1's slot, new generation
  EXPECT_NE(r2, r1);
  EXPECT_THROW(t.wait(r1), invalid_input);
  t.wait(t.isend(&a, 1, me, 9));
  t.wait(r2);
  EXPECT_THROW(t.wait(Request{}), invalid_input);
  EXPECT_THROW(t.wait(Request{12345}), invalid_input);
}

// ---- broadcast (barrier: see MpiTimeout) ---------------------------------------

TEST_P(MpiTransportP, BroadcastFromEveryRoot) {
  for (std::size_t bytes : {std::size_t{0}, std::size_t{1}, std::size_t{13}, std::size_t{1000}}) {
    for (int root = 0; root < W; ++root) {
      std::vector<std::byte> buf(bytes, std::byte{0});
      if (me == root)
        for (std::size_t i = 0; i < bytes; ++i) buf[i] = pattern(root, 0, i);
      t.broadcast(buf.data(), bytes, root);
      std::vector<std::byte> expected(bytes);
      for (std::size_t i = 0; i < bytes; ++i) expected[i] = pattern(root, 0, i);
      EXPECT_EQ(buf, expected) << bytes << " bytes from root " << root;
    }
  }
}

// ---- typed collectives: every ElementType, exact values ---------------------------

template <class T>
struct Element;
template <>
struct Element<std::int8_t> {
  static constexpr ElementType type = ElementType::int8;
};
template <>
struct Element<std::uint8_t> {
  static constexpr ElementType type = ElementType::uint8;
};
template <>
struct Element<std::int32_t> {
  static constexpr ElementType type = ElementType::int32;
};
template <>
struct Element<std::int64_t> {
  static constexpr ElementType type = ElementType::int64;
};
template <>
struct Element<float> {
  static constexpr ElementType type = ElementType::float32;
};
template <>
struct Element<double> {
  static constexpr ElementType type = ElementType::float64;
};
template <>
struct Element<bfloat16> {
  static constexpr ElementType type = ElementType::bfloat16;
};
template <>
struct Element<float16> {
  static constexpr ElementType type = ElementType::float16;
};

template <class T>
constexpr bool is_floating = std::is_floating_point_v<T> || std::is_same_v<T, bfloat16> || std::is_same_v<T, float16>;

/// Element i of rank r's input: small values whose sums over <= 8 ranks, in
/// any order, are exact in every type (bfloat16 has 8 significant bits).
template <class T>
double input_value(int r, std::size_t i) {
  double v = static_cast<double>(static_cast<int>(i % 7) * (r + 1));
  if constexpr (!std::is_same_v<T, std::uint8_t>) v -= 3.0 * (r + 1);
  if constexpr (is_floating<T>) v += 0.5;
  return v;
}

template <class T>
T to_element(double v) {
  if constexpr (std::is_same_v<T, bfloat16> || std::is_same_v<T, float16>) {
    return T(static_cast<float>(v));
  } else {
    return static_cast<T>(v);
  }
}

template <class T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0);
}

template <class T>
std::vector<double> as_doubles(const std::vector<T>& v) {
  std::vector<double> out;
  for (const T& x : v) out.push_back(static_cast<double>(static_cast<float>(x)));
  return out;
}

template <class T>
class MpiCollectives : public ::testing::Test {};
using ElementTypes = ::testing::Types<std::int8_t, std::uint8_t, std::int32_t, std::int64_t, float, double, bfloat16, float16>;
struct ElementNames {
  template <class T>
  static std::string GetName(int) {
    return element_name(Element<T>::type);
  }
};
TYPED_TEST_SUITE(MpiCollectives, ElementTypes, ElementNames);

TYPED_TEST(MpiCollectives, AllReduceSumsInPlace) {
  using T = TypeParam;
  for (const Config& config : configs()) {
    MpiTransport t = MpiTransport::duplicate(MPI_COMM_WORLD, config.options);
    const int W = t.world_size();
    for (std::size_t count : {std::size_t{0}, std::size_t{1}, std::size_t{23}}) {
      std::vector<T> buf(count), expected(count);
      for (std::size_t i = 0; i < count; ++i) {
        buf[i] = to_element<T>(input_value<T>(t.rank(), i));
        double sum = 0;
        for (int r = 0; r < W; ++r) sum += input_value<T>(r, i);
        expected[i] = to_element<T>(sum);
      }
      t.all_reduce(buf.data(), count, Element<T>::type, ReduceOp::sum);
      EXPECT_TRUE(same_bits(buf, expected)) << config.name << ", " << count << " elements: got "
                                            << ::testing::PrintToString(as_doubles(buf)) << ", expected "
                                            << ::testing::PrintToString(as_doubles(expected));
    }
  }
}

TYPED_TEST(MpiCollectives, AllGatherConcatenatesByRank) {
  using T = TypeParam;
  for (const Config& config : configs()) {
    MpiTransport t = MpiTransport::duplicate(MPI_COMM_WORLD, config.options);
    const auto W = static_cast<std::size_t>(t.world_size()), me = static_cast<std::size_t>(t.rank());
    for (std::size_t count : {std::size_t{0}, std::size_t{1}, std::size_t{9}}) {
      std::vector<T> send(count), expected(W * count);
      for (std::size_t i = 0; i < count; ++i) send[i] = to_element<T>(input_value<T>(t.rank(), i));
      for (std::size_t r = 0; r < W; ++r)
        for (std::size_t i = 0; i < count; ++i) expected[r * count + i] = to_element<T>(input_value<T>(static_cast<int>(r), i));
      std::vector<T> recv(W * count, to_element<T>(99));
      t.all_gather(send.data(), recv.data(), count, Element<T>::type);
      EXPECT_TRUE(same_bits(recv, expected)) << config.name << ", " << count << " elements";
      // In place: this rank's block already sits in recv.
      std::vector<T> in_place(W * count, to_element<T>(99));
      std::copy(send.begin(), send.end(), in_place.begin() + static_cast<std::ptrdiff_t>(me * count));
      t.all_gather(in_place.data() + me * count, in_place.data(), count, Element<T>::type);
      EXPECT_TRUE(same_bits(in_place, expected)) << config.name << ", in place, " << count << " elements";
    }
  }
}

TYPED_TEST(MpiCollectives, ReduceScatterSumsEachRanksBlock) {
  using T = TypeParam;
  for (const Config& config : configs()) {
    MpiTransport t = MpiTransport::duplicate(MPI_COMM_WORLD, config.options);
    const auto W = static_cast<std::size_t>(t.world_size()), me = static_cast<std::size_t>(t.rank());
    for (std::size_t count : {std::size_t{0}, std::size_t{1}, std::size_t{7}, std::size_t{12}}) {
      std::vector<T> send(W * count), expected(count);
      for (std::size_t i = 0; i < W * count; ++i) send[i] = to_element<T>(input_value<T>(t.rank(), i));
      for (std::size_t i = 0; i < count; ++i) {
        double sum = 0;
        for (std::size_t r = 0; r < W; ++r) sum += input_value<T>(static_cast<int>(r), me * count + i);
        expected[i] = to_element<T>(sum);
      }
      std::vector<T> recv(count, to_element<T>(99));
      t.reduce_scatter(send.data(), recv.data(), count, Element<T>::type, ReduceOp::sum);
      EXPECT_TRUE(same_bits(recv, expected)) << config.name << ", " << count << " elements: got "
                                             << ::testing::PrintToString(as_doubles(recv)) << ", expected "
                                             << ::testing::PrintToString(as_doubles(expected));
    }
  }
}

TEST(MpiCollectives16Bit, SumsRoundInFp32AfterEachAddition) {
  // 256 + 1 is not a bfloat16 (rounds to even: 256); 2048 + 1 not a float16.
  MpiTransport t = MpiTransport::duplicate(MPI_COMM_WORLD);
  const int W = t.world_size();
  std::vector<bfloat16> b = {bfloat16(t.rank() == 0 ? 256.0f : 1.0f), bfloat16(0.5f)};
  std::vector<float16> h = {float16(t.rank() == 0 ? 2048.0f : 1.0f), float16(0.25f)};
  t.all_reduce(b.data(), b.size(), ElementType::bfloat16, ReduceOp::sum);
  t.all_reduce(h.data(), h.size(), ElementType::float16, ReduceOp::sum);
  // Each +1 alone is lost to rounding; but for W >= 3 the order decides,
  // so only the exactly representable element is checked for every W.
  if (W == 2) {
    EXPECT_EQ(static_cast<float>(b[0]), 256.0f);
    EXPECT_EQ(static_cast<float>(h[0]), 2048.0f);
  }
  EXPECT_EQ(static_cast<float>(b[1]), 0.5f * static_cast<float>(W));
  EXPECT_EQ(static_cast<float>(h[1]), 0.25f * static_cast<float>(W));
}

// ---- the large-count path --------------------------------------------------------

TEST(MpiLargeCount, DerivedTypeCoversBytesBeyondIntMax) {
  // The datatype arithmetic for > 2 GiB messages, without the memory.
  for (std::size_t bytes : {std::size_t{INT_MAX} + 1, std::size_t{1} << 31 | 3, (std::size_t{5} << 30) + 7,
                            std::size_t{2} * INT_MAX}) {
    const detail::MpiMessage m = detail::mpi_message(bytes, INT_MAX);
    ASSERT_EQ(m.count, 1);
    ASSERT_NE(m.type, MPI_BYTE);
    MPI_Count size = 0, lb = -1, extent = 0;
    ASSERT_EQ(MPI_Type_size_x(m.type, &size), MPI_SUCCESS);
    ASSERT_EQ(MPI_Type_get_extent_x(m.type, &lb, &extent), MPI_SUCCESS);
    EXPECT_EQ(static_cast<std::size_t>(size), bytes);
    EXPECT_EQ(lb, 0);
    EXPECT_EQ(static_cast<std::size_t>(extent), bytes);
  }
}

TEST(MpiLargeCount, SmallChunkLimitArithmetic) {
  struct Case {
    std::size_t bytes, max_count;
  };
  for (const Case c : {Case{5, 5}, Case{6, 5}, Case{15, 5}, Case{17, 5}, Case{1, 1}, Case{1000003, 4096}}) {
    const detail::MpiMessage m = detail::mpi_message(c.bytes, c.max_count);
    MPI_Count size = 0, lb = -1, extent = 0;
    ASSERT_EQ(MPI_Type_size_x(m.type, &size), MPI_SUCCESS);
    ASSERT_EQ(MPI_Type_get_extent_x(m.type, &lb, &extent), MPI_SUCCESS);
    EXPECT_EQ(static_cast<std::size_t>(size) * static_cast<std::size_t>(m.count), c.bytes) << c.bytes << " / " << c.max_count;
    EXPECT_EQ(static_cast<std::size_t>(extent) * static_cast<std::size_t>(m.count), c.bytes);
    EXPECT_EQ(m.type == MPI_BYTE, c.bytes <= c.max_count);
  }
  // More blocks than an int counts.
  EXPECT_THROW(detail::mpi_message(std::size_t{1} << 32, 1), invalid_input);
}

TEST(MpiLargeCount, MessagesSplitIntoManyBlocksArriveIntact) {
  // 1 MiB + 3 bytes in 4 KiB blocks, a ring: each rank sends its successor.
  MpiTransportOptions options;
  options.max_count = 4096;
  MpiTransport t = MpiTransport::duplicate(MPI_COMM_WORLD, options);
  const int me = t.rank(), W = t.world_size();
  const int next = (me + 1) % W, prev = (me + W - 1) % W;
  const std::size_t bytes = (std::size_t{1} << 20) + 3;
  std::vector<std::byte> out(bytes), in(bytes, std::byte{0});
  for (std::size_t i = 0; i < bytes; ++i) out[i] = pattern(me, next, i);
  const Request r = t.irecv(in.data(), bytes, prev, 0);
  t.wait(t.isend(out.data(), bytes, next, 0));
  t.wait(r);
  std::vector<std::byte> expected(bytes);
  for (std::size_t i = 0; i < bytes; ++i) expected[i] = pattern(prev, me, i);
  EXPECT_EQ(in, expected);
  // A short message into a large-count receive: MPI's rules still hold.
  std::vector<std::byte> small_in(bytes, std::byte{0});
  const Request r2 = t.irecv(small_in.data(), bytes, prev, 1);
  t.wait(t.isend(out.data(), 10, next, 1));
  t.wait(r2);
  EXPECT_TRUE(std::equal(small_in.begin(), small_in.begin() + 10, expected.begin()));
  EXPECT_EQ(small_in[10], std::byte{0});
}

// ---- errors ------------------------------------------------------------------------

/// Runs `f`, expecting mpi_error of MPI error class `error_class` whose
/// message names `call` and carries MPI's own text for the code.
template <class F>
void expect_mpi_error(F&& f, int error_class, const std::string& call) {
  try {
    f();
    ADD_FAILURE() << "no exception, expected " << detail::mpi_error_string(error_class);
  } catch (const mpi_error& e) {
    int cls = -1;
    MPI_Error_class(e.code(), &cls);
    EXPECT_EQ(cls, error_class) << e.what();
    const std::string what = e.what();
    EXPECT_NE(what.find(call + " failed on rank "), std::string::npos) << what;
    EXPECT_NE(what.find(detail::mpi_error_string(e.code())), std::string::npos) << what;
  }
}

TEST(MpiErrors, InvalidRootOrPeerBecomesMpiError) {
  for (const Config& config : configs()) {
    MpiTransport t = MpiTransport::duplicate(MPI_COMM_WORLD, config.options);
    const int W = t.world_size();
    const bool nonblocking = config.options.timeout.count() > 0;
    std::byte buf[8] = {};
    expect_mpi_error([&] { t.broadcast(buf, 8, W); }, MPI_ERR_ROOT, nonblocking ? "MPI_Ibcast" : "MPI_Bcast");
    expect_mpi_error([&] { t.broadcast(buf, 8, -3); }, MPI_ERR_ROOT, nonblocking ? "MPI_Ibcast" : "MPI_Bcast");
    expect_mpi_error([&] { t.isend(buf, 8, W, 0); }, MPI_ERR_RANK, "MPI_Isend");
    expect_mpi_error([&] { t.irecv(buf, 8, W + 5, 0); }, MPI_ERR_RANK, "MPI_Irecv");
    // The transport is still usable afterwards: collectives and an
    // exchange whose bytes all arrive.
    EXPECT_NO_THROW(t.barrier()) << config.name;
    std::byte root_bytes[8];
    for (std::size_t i = 0; i < 8; ++i) root_bytes[i] = t.rank() == W - 1 ? pattern(W - 1, 0, i) : std::byte{0xEE};
    t.broadcast(root_bytes, 8, W - 1);
    for (std::size_t i = 0; i < 8; ++i) EXPECT_EQ(root_bytes[i], pattern(W - 1, 0, i)) << config.name << " broadcast byte " << i;
    EXPECT_TRUE(one_byte_each_arrives(t)) << config.name;
  }
}

TEST(MpiErrors, MessageNamesCallRankOperationAndMpiText) {
  MpiTransport t = MpiTransport::duplicate(MPI_COMM_WORLD);
  std::byte buf[4] = {};
  try {
    t.broadcast(buf, 4, t.world_size());
    FAIL() << "no exception";
  } catch (const backend_error& e) {
    const std::string expected = "MPI_Bcast failed on rank " + std::to_string(t.rank()) + " in broadcast(4 bytes, root " +
                                 std::to_string(t.world_size()) + "): " + detail::mpi_error_string(e.code());
    EXPECT_EQ(std::string(e.what()), expected);
  }
}

TEST(MpiErrors, TruncatedReceiveFailsInWait) {
  MpiTransport t = MpiTransport::duplicate(MPI_COMM_WORLD);
  const int me = t.rank(), W = t.world_size();
  if (W < 2) GTEST_SKIP() << "Open MPI 4.1 does not report truncation of a message a rank sends itself";
  std::byte out[8] = {}, in[4] = {};
  const Request r = t.irecv(in, 4, (me + W - 1) % W, 3);
  const Request s = t.isend(out, 8, (me + 1) % W, 3);
  expect_mpi_error([&] { t.wait(r); }, MPI_ERR_TRUNCATE, "MPI_Wait");
  EXPECT_THROW(t.wait(r), invalid_input);  // consumed by the error
  t.wait(s);
}

TEST(MpiErrors, BadArgumentsAreInvalidInput) {
  MpiTransport t = MpiTransport::duplicate(MPI_COMM_WORLD);
  std::byte buf[4] = {};
  EXPECT_THROW(t.all_reduce(buf, 1, static_cast<ElementType>(99), ReduceOp::sum), invalid_input);
  EXPECT_THROW(t.set_timeout(-1ms), invalid_input);
  EXPECT_THROW(MpiTransport(MPI_COMM_NULL), invalid_input);
  MpiTransportOptions zero;
  zero.max_count = 0;
  EXPECT_THROW(MpiTransport(MPI_COMM_WORLD, zero), invalid_input);
  MpiTransportOptions too_big;
  too_big.max_count = std::size_t{INT_MAX} + 1;
  EXPECT_THROW(MpiTransport(MPI_COMM_WORLD, too_big), invalid_input);
}

TEST(MpiErrors, BorrowedCommunicatorGetsItsErrorHandlerBack) {
  MPI_Comm comm = MPI_COMM_NULL;
  ASSERT_EQ(MPI_Comm_dup(MPI_COMM_WORLD, &comm), MPI_SUCCESS);
  auto handler_is = [&](MPI_Errhandler expected) {
    MPI_Errhandler h = MPI_ERRHANDLER_NULL;
    MPI_Comm_get_errhandler(comm, &h);
    const bool same = h == expected;
    MPI_Errhandler_free(&h);
    return same;
  };
  EXPECT_TRUE(handler_is(MPI_ERRORS_ARE_FATAL));
  {
    MpiTransportOptions borrow;
    borrow.communicator = MpiCommunicator::borrow;
    MpiTransport t(comm, borrow);
    EXPECT_EQ(t.comm(), comm);
    EXPECT_TRUE(handler_is(MPI_ERRORS_RETURN));
    MpiTransport moved(std::move(t));  // one owner, one restore
    EXPECT_EQ(moved.comm(), comm);
    EXPECT_EQ(t.comm(), MPI_COMM_NULL);  // NOLINT(bugprone-use-after-move): the moved-from state is specified
  }
  EXPECT_TRUE(handler_is(MPI_ERRORS_ARE_FATAL));
  MPI_Comm_free(&comm);
}

TEST(MpiErrors, ByDefaultTheCallersCommunicatorIsDuplicatedAndLeftAlone) {
  MPI_Comm comm = MPI_COMM_NULL;
  ASSERT_EQ(MPI_Comm_dup(MPI_COMM_WORLD, &comm), MPI_SUCCESS);
  MPI_Errhandler h = MPI_ERRHANDLER_NULL;
  {
    MpiTransport t(comm);
    EXPECT_NE(t.comm(), comm);
    int result = MPI_UNEQUAL;
    MPI_Comm_compare(t.comm(), comm, &result);
    EXPECT_EQ(result, MPI_CONGRUENT);  // same ranks, another context: no message meets the caller's
    MPI_Comm_get_errhandler(comm, &h);
    EXPECT_EQ(h, MPI_ERRORS_ARE_FATAL);  // untouched
    MPI_Errhandler_free(&h);
    std::int32_t x = 1;
    t.all_reduce(&x, 1, ElementType::int32, ReduceOp::sum);
    EXPECT_EQ(x, t.world_size());
  }
  MPI_Comm_free(&comm);
}

// ---- timeouts ----------------------------------------------------------------------

// No sleeps: the late rank waits for a message that the early one sends only
// after its call has timed out, so the timeout is certain.

TEST(MpiTimeout, AllReduceThatDoesNotCompleteRaisesAllReduceTimeout) {
  MpiTransportOptions options;
  options.timeout = 60s;  // on every rank: non-blocking collectives only match their like
  MpiTransport t = MpiTransport::duplicate(MPI_COMM_WORLD, options);
  MpiTransport side(MPI_COMM_WORLD);  // for the go-ahead: t is unusable on rank 0 after its timeout
  const int me = t.rank(), W = t.world_size();
  if (W < 2) GTEST_SKIP() << "needs a second rank to be late";
  std::byte go{1};
  if (me == 0) {
    static std::int32_t x;  // static: the abandoned all-reduce writes into it after this test returns
    x = 1;
    t.set_timeout(200ms);
    try {
      t.all_reduce(&x, 1, ElementType::int32, ReduceOp::sum);
      ADD_FAILURE() << "no timeout";
    } catch (const timeout_error& e) {
      EXPECT_EQ(e.code(), 0);
      EXPECT_EQ(std::string(e.what()),
                "All-reduce timeout on rank 0 in all_reduce(1 int32 elements): not complete after 200 ms "
                "(MpiTransportOptions::timeout)");
    }
    // The abandoned all-reduce may still read and write: every later call is refused.
    EXPECT_TRUE(t.broken());
    try {
      (void)t.irecv(&go, 1, 0, 11);
      ADD_FAILURE() << "a broken transport accepted irecv";
    } catch (const timeout_error& e) {
      EXPECT_NE(std::string(e.what()).find("MpiTransport::irecv on rank 0: the transport is unusable"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("All-reduce timeout on rank 0"), std::string::npos) << e.what();
    }
    EXPECT_THROW(t.barrier(), timeout_error);
    EXPECT_THROW(t.all_reduce(&x, 1, ElementType::int32, ReduceOp::sum), timeout_error);
    for (int p = 1; p < W; ++p) side.wait(side.isend(&go, 1, p, 11));
  } else {
    side.wait(side.irecv(&go, 1, 0, 11));
    std::int32_t x = 1;
    t.all_reduce(&x, 1, ElementType::int32, ReduceOp::sum);  // meets rank 0's abandoned all-reduce
    EXPECT_EQ(x, W);
    EXPECT_FALSE(t.broken());
  }
  side.barrier();
}

TEST(MpiTimeout, BarrierDoesNotCompleteBeforeTheLastRankEnters) {
  MpiTransportOptions options;
  options.timeout = 60s;
  MpiTransport t = MpiTransport::duplicate(MPI_COMM_WORLD, options);
  MpiTransport side(MPI_COMM_WORLD);  // t is unusable on rank 0 after its timeout
  const int me = t.rank(), W = t.world_size(), last = W - 1;
  if (W < 2) GTEST_SKIP() << "needs a last rank other than rank 0";
  std::byte go{1};
  if (me == 0) {
    t.set_timeout(100ms);
    try {
      t.barrier();
      ADD_FAILURE() << "the barrier completed before rank " << last << " entered it";
    } catch (const timeout_error& e) {
      EXPECT_NE(std::string(e.what()).find("Barrier timeout on rank 0 in barrier()"), std::string::npos) << e.what();
    }
    side.wait(side.isend(&go, 1, last, 12));  // now the last rank may enter
  } else if (me == last) {
    side.wait(side.irecv(&go, 1, 0, 12));
    t.barrier();  // completes rank 0's abandoned barrier
  } else {
    t.barrier();
  }
  side.barrier();
}

TEST(MpiTimeout, TimedOutWaitLeavesTheRequestPending) {
  MpiTransportOptions options;
  options.timeout = 30s;
  MpiTransport t = MpiTransport::duplicate(MPI_COMM_WORLD, options);
  if (t.world_size() < 2) GTEST_SKIP() << "needs a second rank";
  std::int64_t value = 0;
  if (t.rank() == 1) {
    const Request r = t.irecv(&value, sizeof value, 0, 4);
    t.set_timeout(100ms);
    try {
      t.wait(r);
      ADD_FAILURE() << "no timeout";
    } catch (const timeout_error& e) {
      EXPECT_NE(std::string(e.what()).find("Wait timeout on rank 1 in wait(Request{"), std::string::npos) << e.what();
    }
    EXPECT_FALSE(t.broken());  // a timed-out wait abandons nothing
    t.set_timeout(30s);
    t.barrier();
    t.wait(r);  // the same request, now sent
    EXPECT_EQ(value, 42);
  } else {
    t.barrier();
    if (t.rank() == 0) {
      value = 42;
      t.wait(t.isend(&value, sizeof value, 1, 4));
    }
  }
}

// ---- the outcome agreement (MpiTransportOptions::agree) ------------------------

MpiTransportOptions point_to_point_options(bool agree, std::chrono::milliseconds timeout) {
  MpiTransportOptions o;
  o.all_to_all = MpiAllToAll::point_to_point;  // a rank waits only for the ranks that send it bytes
  o.agree = agree;
  o.timeout = timeout;
  return o;
}

// The last rank's call fails before it moves a byte; the others exchange no
// bytes with it, so only the agreement can tell them.
TEST(MpiAgreement, ARankThatFailsIsNamedOnEveryRank) {
  MpiTransport t = MpiTransport::duplicate(MPI_COMM_WORLD, point_to_point_options(true, 0ms));
  const int me = t.rank(), W = t.world_size(), faulty = W - 1;
  if (W < 2) GTEST_SKIP() << "needs a second rank";
  std::vector<std::size_t> zeros(static_cast<std::size_t>(W), 0), self(zeros);
  self[static_cast<std::size_t>(faulty)] = 1;
  std::byte buf[1]{};
  try {
    t.all_to_all_v(buf, me == faulty ? self : zeros, zeros, buf, zeros, zeros);  // the faulty rank sends itself 1 byte, expects 0
    ADD_FAILURE() << "rank " << me << " completed";
  } catch (const invalid_input& e) {
    EXPECT_EQ(me, faulty) << e.what();
  } catch (const backend_error& e) {
    EXPECT_NE(me, faulty);
    EXPECT_FALSE(dynamic_cast<const timeout_error*>(&e)) << e.what();
    EXPECT_NE(std::string(e.what()).find(detail::concat("All-to-all agreement on rank ", me, " in all_to_all_v(0 bytes out, 0 bytes in): exchange #0 "
                                                "completed here but rank ", faulty, " failed: all_to_all_v: rank ", faulty,
                                                " sends 1 bytes to itself but expects 0")),
              std::string::npos)
        << e.what();
    EXPECT_TRUE(t.broken());
  }
  MpiTransport(MPI_COMM_WORLD).barrier();
}

// Every rank's call fails on its own arguments: each still takes its full
// part in the agreement, so no outcome is left over to be matched by a later
// exchange (the tags repeat every MpiAgreement::tags exchanges), and the
// transport stays usable.
TEST(MpiAgreement, AFailureOfEveryRanksOwnLeavesNothingForLaterExchanges) {
  MpiTransport t = MpiTransport::duplicate(MPI_COMM_WORLD, point_to_point_options(true, 30s));
  const int W = t.world_size();
  if (W < 2) GTEST_SKIP() << "needs a second rank";
  std::vector<std::size_t> zeros(static_cast<std::size_t>(W), 0), self(zeros);
  self[static_cast<std::size_t>(t.rank())] = 1;
  std::byte buf[1]{};
  EXPECT_THROW(t.all_to_all_v(buf, self, zeros, buf, zeros, zeros), invalid_input);
  EXPECT_FALSE(t.broken());
  const std::vector<std::size_t> ones(static_cast<std::size_t>(W), 1);
  std::vector<std::size_t> displs(static_cast<std::size_t>(W));
  for (std::size_t i = 0; i < displs.size(); ++i) displs[i] = i;
  std::vector<std::uint8_t> out(displs.size(), static_cast<std::uint8_t>(t.rank())), in(displs.size());
  for (int round = 0; round < detail::MpiAgreement::tags + 2; ++round) {
    t.all_to_all_v(out.data(), ones, displs, in.data(), ones, displs);
    for (std::size_t s = 0; s < in.size(); ++s) ASSERT_EQ(in[s], s) << "round " << round;
  }
}

// The last rank never calls: the others, whose exchange completed, name it at
// the deadline (plus the grace).
TEST(MpiAgreement, ASilentRankIsNamedAtTheDeadline) {
  MpiTransport t = MpiTransport::duplicate(MPI_COMM_WORLD, point_to_point_options(true, 300ms));
  const int me = t.rank(), W = t.world_size(), silent = W - 1;
  if (W < 2) GTEST_SKIP() << "needs a second rank";
  const std::vector<std::size_t> zeros(static_cast<std::size_t>(W), 0);
  std::byte buf[1]{};
  if (me != silent) {
    try {
      t.all_to_all_v(buf, zeros, zeros, buf, zeros, zeros);
      ADD_FAILURE() << "rank " << me << " completed without rank " << silent;
    } catch (const timeout_error& e) {
      EXPECT_NE(std::string(e.what()).find(detail::concat("exchange #0 completed here but rank(s) ", silent, " reported no outcome in time")),
                std::string::npos)
          << e.what();
    }
  }
  MpiTransport(MPI_COMM_WORLD).barrier();
}

TEST(MpiAgreement, HealthyExchangesAgreeSilently) {
  MpiTransport t = MpiTransport::duplicate(MPI_COMM_WORLD, point_to_point_options(true, 30s));
  const int W = t.world_size();
  const std::vector<std::size_t> ones(static_cast<std::size_t>(W), 1);
  std::vector<std::size_t> displs(static_cast<std::size_t>(W));
  for (std::size_t i = 0; i < displs.size(); ++i) displs[i] = i;
  std::vector<std::uint8_t> out(displs.size(), static_cast<std::uint8_t>(t.rank())), in(displs.size());
  for (int round = 0; round < 2 * detail::MpiAgreement::tags + 3; ++round) {  // past the agreement's tag cycle
    t.all_to_all_v(out.data(), ones, displs, in.data(), ones, displs);
    for (std::size_t s = 0; s < in.size(); ++s) ASSERT_EQ(in[s], s);
    const Request r = t.post_all_to_all_v(out.data(), ones, displs, in.data(), ones, displs);
    t.wait(r);
  }
  EXPECT_FALSE(t.broken());
}

// Every rank waits in the same order, which is not the posting order: the
// agreements match by the exchange's number.
TEST(MpiAgreement, PostedExchangesMayBeWaitedForInAnyOrderTheRanksShare) {
  MpiTransport t = MpiTransport::duplicate(MPI_COMM_WORLD, point_to_point_options(true, 30s));
  const int W = t.world_size();
  const std::vector<std::size_t> ones(static_cast<std::size_t>(W), 1);
  std::vector<std::size_t> displs(static_cast<std::size_t>(W));
  for (std::size_t i = 0; i < displs.size(); ++i) displs[i] = i;
  std::vector<std::uint8_t> out1(displs.size(), 1), out2(displs.size(), 2), in1(displs.size()), in2(displs.size());
  const Request first = t.post_all_to_all_v(out1.data(), ones, displs, in1.data(), ones, displs);
  const Request second = t.post_all_to_all_v(out2.data(), ones, displs, in2.data(), ones, displs);
  t.wait(second);
  t.wait(first);
  EXPECT_EQ(in1, out1);
  EXPECT_EQ(in2, out2);
  EXPECT_FALSE(t.broken());
}

TEST(MpiAgreement, WithoutItPostedExchangesMayBeWaitedForInAnyOrder) {
  MpiTransport t = MpiTransport::duplicate(MPI_COMM_WORLD, point_to_point_options(false, 30s));
  const std::vector<std::size_t> zeros(static_cast<std::size_t>(t.world_size()), 0);
  std::byte buf[1]{};
  const Request first = t.post_all_to_all_v(buf, zeros, zeros, buf, zeros, zeros);
  const Request second = t.post_all_to_all_v(buf, zeros, zeros, buf, zeros, zeros);
  t.wait(second);
  t.wait(first);
  EXPECT_FALSE(t.broken());
}

}  // namespace
}  // namespace cpdispatch
