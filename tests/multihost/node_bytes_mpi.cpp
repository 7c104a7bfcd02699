// The bytes a KV exchange puts on the links between nodes, measured.
// run_multihost.sh runs it over network namespaces ("nodes"), e.g. 2 nodes x
// 2 ranks; $CPD_NETNS_DEVICE names each namespace's link to the others. One
// plan, whose documents span nodes so that several ranks of a remote node need
// the same KV shard, goes through the deduplicated exchange (KvWireDispatcher:
// one copy per destination rank) and the node-level one (NodeWireDispatcher:
// one copy per destination node), forward and reverse. Around each exchange
// the first rank of every node reads its namespace's byte counters; rank 0
// checks, per exchange, the bytes sent between nodes against the plan's
// inter-node KV tokens (node_token_counts) times the token bytes:
//   planned <= measured <= planned * 1.10 + 64 KiB + 1514 B x segments resent
// The share covers the frames' headers: without segmentation offload each
// 1448-byte TCP segment carries 66 bytes of Ethernet, IPv4 and TCP headers
// and may draw a 66-byte ACK, 9.1%; with it (veth) the overhead is far
// smaller. The 64 KiB cover Open MPI's message headers and rendezvous
// handshakes, the barriers and stray frames (ARP, IPv6 neighbour discovery).
// On a loaded machine TCP sends some segments again (the namespaces'
// RetransSegs, loopback's included): each is at most one full frame, 1514 bytes.
// Rank 0 also checks that the bytes between ranks of one node went over
// loopback, not over the link between nodes.
// Exit status: 0 when every check passes, 1 when one fails, 2 on an error.

#include <mpi.h>
#include <sys/stat.h>

#include <array>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <fstream>
#include <functional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "cpdispatch/execute/kv_wire.hpp"
#include "cpdispatch/execute/node_wire.hpp"
#include "cpdispatch/plan/kv_wire.hpp"
#include "cpdispatch/plan/node_wire.hpp"
#include "cpdispatch/plan/plan.hpp"
#include "cpdispatch/transports/mpi.hpp"
#include "cpdispatch/transports/mpi_topology.hpp"

namespace {

using cpdispatch::MpiTransport;
using cpdispatch::Topology;
using Bytes = std::vector<std::byte>;

constexpr std::int64_t kShardTokens = 512;
constexpr std::size_t kTokenBytes = 4096;  // K and V of one token: 2 x 8 heads x 128 x 2 bytes
constexpr double kHeaderShare = 0.10;
constexpr std::uint64_t kAllowance = 64 * 1024;
constexpr std::uint64_t kFrameBytes = 1514;  // MTU 1500 and the Ethernet header

std::vector<std::int64_t> ranks_of(const Topology& t, std::int64_t node) {
  std::vector<std::int64_t> out;
  for (std::int64_t r = 0; r < t.world_size(); ++r)
    if (t.node_of(r) == node) out.push_back(r);
  return out;
}

/// For every ordered pair of nodes (a, b): a causal document whose first
/// shard lives and attends on a's first rank, then one shard on each rank of
/// b. Every rank of b needs the first shard's KV: the deduplicated exchange
/// sends it to b once per rank there, the node-level exchange once.
cpdispatch::QkvDocumentsPlan spanning_plan(const Topology& t) {
  cpdispatch::QkvDocumentsPlan plan;
  plan.world_size = t.world_size();
  for (std::int64_t a = 0; a < t.num_nodes(); ++a) {
    for (std::int64_t b = 0; b < t.num_nodes(); ++b) {
      if (a == b) continue;
      const std::int64_t head = ranks_of(t, a).front();
      cpdispatch::PackedDocument doc;
      doc.shards.push_back({head, kShardTokens, head});
      for (std::int64_t r : ranks_of(t, b)) doc.shards.push_back({r, kShardTokens, r});
      plan.documents.push_back(doc);
    }
  }
  return plan;
}

/// Wire slots of the deduplicated exchange between two ranks of one node.
std::int64_t dedup_inside_tokens(const cpdispatch::Metadata& kv_fwd, const cpdispatch::KvWireMetadata& wire, const Topology& t) {
  std::int64_t total = 0;
  const auto W = static_cast<std::size_t>(t.world_size());
  for (std::size_t r = 0; r < W; ++r)
    for (std::size_t g = 0; g < kv_fwd.max_seqs(); ++g)
      for (std::size_t u = 0; u < kv_fwd.num_copies(); ++u) {
        const std::int64_t d = wire.dispatch(r, g, u);
        const auto home = static_cast<std::int64_t>(r);
        if (d >= 0 && d != home && t.same_node(d, home)) total += kv_fwd.seq_len(r, g);
      }
  return total;
}

/// One interface's byte counter in this process's network namespace.
std::uint64_t counter(const std::string& device, const char* name) {
  const std::string path = "/sys/class/net/" + device + "/statistics/" + name;
  std::ifstream in(path);
  std::uint64_t v = 0;
  if (!(in >> v)) throw std::runtime_error("cannot read " + path);
  return v;
}

/// This namespace's TCP segments sent again (RetransSegs of /proc/net/snmp).
std::uint64_t retransmitted_segments() {
  std::ifstream in("/proc/net/snmp");
  std::string line, names;
  while (std::getline(in, line)) {
    if (line.rfind("Tcp:", 0) != 0) continue;
    if (names.empty()) { names = line; continue; }
    std::istringstream n(names), v(line);
    std::string name, value;
    while (n >> name && v >> value)
      if (name == "RetransSegs") return std::stoull(value);
  }
  throw std::runtime_error("no Tcp RetransSegs in /proc/net/snmp");
}

// Bytes sent and received on the link between nodes, bytes sent on loopback,
// frames sent on the link, TCP segments sent again.
using Counters = std::array<std::uint64_t, 5>;

Counters read_counters(const std::string& device) {
  return {counter(device, "tx_bytes"), counter(device, "rx_bytes"), counter("lo", "tx_bytes"), counter(device, "tx_packets"), retransmitted_segments()};
}

/// All ranks quiet, then a pause so late TCP acknowledgements land before a reading.
void settle(MPI_Comm comm) {
  MPI_Barrier(comm);
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
}

/// The counters' growth over one exchange made by every rank at once.
template <class F>
Counters measure(MPI_Comm comm, const std::string& device, F&& exchange) {
  settle(comm);
  const Counters before = read_counters(device);
  MPI_Barrier(comm);  // no rank sends before every node has read
  exchange();
  settle(comm);
  const Counters after = read_counters(device);
  Counters d{};
  for (std::size_t i = 0; i < d.size(); ++i) d[i] = after[i] - before[i];
  return d;
}

/// The namespace of each rank must be its node: ranks share one exactly when
/// mpi_topology puts them on one node.
void check_namespaces(MPI_Comm comm, const Topology& t) {
  struct stat st {};
  if (stat("/proc/self/ns/net", &st) != 0) throw std::runtime_error("cannot stat /proc/self/ns/net");
  unsigned long long mine = st.st_ino;
  std::vector<unsigned long long> all(static_cast<std::size_t>(t.world_size()));
  MPI_Allgather(&mine, 1, MPI_UNSIGNED_LONG_LONG, all.data(), 1, MPI_UNSIGNED_LONG_LONG, comm);
  for (std::int64_t a = 0; a < t.world_size(); ++a)
    for (std::int64_t b = 0; b < t.world_size(); ++b)
      if (t.same_node(a, b) != (all[static_cast<std::size_t>(a)] == all[static_cast<std::size_t>(b)])) {
        throw std::runtime_error("ranks " + std::to_string(a) + " and " + std::to_string(b) + " disagree on node and network namespace");
      }
}

Bytes pattern(std::size_t bytes, int rank, int salt) {
  std::vector<std::int32_t> v(bytes / sizeof(std::int32_t));
  for (std::size_t i = 0; i < v.size(); ++i) v[i] = static_cast<std::int32_t>((i * 7 + static_cast<std::size_t>(rank) * 131 + static_cast<std::size_t>(salt)) % 1000) - 500;
  Bytes b(bytes);
  if (bytes) std::memcpy(b.data(), v.data(), bytes);
  return b;
}

struct Planned {
  Topology topology;
  cpdispatch::QkvMetadata meta;
  cpdispatch::KvWireMetadata wire;
  cpdispatch::NodeTokenCounts counts;
  std::int64_t dedup_inside = 0;
  explicit Planned(const Topology& t)
      : topology(t),
        meta(cpdispatch::plan_qkv(spanning_plan(t))),
        wire(cpdispatch::plan_kv_wire(meta)),
        counts(cpdispatch::node_token_counts(meta.kv_fwd, t)),
        dedup_inside(dedup_inside_tokens(meta.kv_fwd, wire, t)) {}
};

enum Exchange { dedup_forward, node_forward, dedup_reverse, node_reverse, num_exchanges };
constexpr const char* kNames[num_exchanges] = {"dedup forward", "node-level forward", "dedup reverse", "node-level reverse"};

struct RankRun {
  std::array<Counters, num_exchanges> bytes{};
  bool same_results = false;  // node-level attention layout and gradient == the deduplicated exchange's
};

/// Both exchanges, forward and reverse: once to open every connection and
/// compare results, then once more, each measured.
RankRun run_rank(MpiTransport& t, const Planned& p, const std::string& device) {
  const auto r = static_cast<std::size_t>(t.rank());
  cpdispatch::KvWireDispatcher<MpiTransport> dedup(t, p.wire, kTokenBytes);
  cpdispatch::NodeWireDispatcher<MpiTransport> node(t, p.wire.fan[r], cpdispatch::plan_node_wire_for_rank(p.meta.kv_fwd, p.topology, t.rank()), kTokenBytes);
  const auto sizes = dedup.required_bytes();
  const Bytes mlp = pattern(sizes.mlp_bytes, t.rank(), 1), dattn = pattern(sizes.attention_bytes, t.rank(), 2);
  Bytes attn_d(sizes.attention_bytes), attn_n(sizes.attention_bytes), wire(sizes.wire_bytes), replica(sizes.replica_bytes);
  Bytes grad_d(sizes.mlp_bytes), grad_n(sizes.mlp_bytes);
  const auto type = cpdispatch::ElementType::int32;
  const std::array<std::function<void()>, num_exchanges> calls = {
      [&] { dedup.forward(mlp, attn_d); }, [&] { node.forward(mlp, attn_n); },
      [&] { dedup.reverse_combine(dattn, wire, replica, grad_d, type); }, [&] { node.reverse_combine(dattn, grad_n, type); }};
  std::vector<int> one(static_cast<std::size_t>(t.world_size())), got(one.size());
  MPI_Alltoall(one.data(), 1, MPI_INT, got.data(), 1, MPI_INT, t.comm());  // connects every pair of ranks
  for (const auto& call : calls) call();
  RankRun out;
  out.same_results = attn_n == attn_d && grad_n == grad_d;
  for (int e = 0; e < num_exchanges; ++e) out.bytes[static_cast<std::size_t>(e)] = measure(t.comm(), device, calls[static_cast<std::size_t>(e)]);
  return out;
}

struct Row {
  std::uint64_t planned = 0, sent = 0, received = 0, loopback = 0, planned_inside = 0, frames = 0, resent = 0;
};

bool check_row(const char* name, const Row& row) {
  const auto most = static_cast<std::uint64_t>(static_cast<double>(row.planned) * (1.0 + kHeaderShare)) + kAllowance + row.resent * kFrameBytes;
  const bool between_ok = row.sent >= row.planned && row.sent <= most;
  const bool inside_ok = row.loopback >= row.planned_inside;
  std::printf("%-20s %12llu %12llu %8llu %6llu %12llu %8.4f %12llu %12llu  %s\n", name, static_cast<unsigned long long>(row.planned),
              static_cast<unsigned long long>(row.sent), static_cast<unsigned long long>(row.frames), static_cast<unsigned long long>(row.resent), static_cast<unsigned long long>(row.received),
              row.planned ? static_cast<double>(row.sent) / static_cast<double>(row.planned) : 0.0, static_cast<unsigned long long>(row.planned_inside),
              static_cast<unsigned long long>(row.loopback), between_ok && inside_ok ? "ok" : "FAIL");
  if (!between_ok) std::printf("  %s: %llu bytes between nodes, planned %llu (allowed up to %llu)\n", name, static_cast<unsigned long long>(row.sent),
                               static_cast<unsigned long long>(row.planned), static_cast<unsigned long long>(most));
  if (!inside_ok) std::printf("  %s: only %llu bytes on loopback, but %llu planned between ranks of one node\n", name,
                              static_cast<unsigned long long>(row.loopback), static_cast<unsigned long long>(row.planned_inside));
  return between_ok && inside_ok;
}

/// Rank 0: sums each node's first rank's readings and checks them.
bool report(const Planned& p, const std::vector<RankRun>& runs) {
  const Topology& t = p.topology;
  const auto tb = static_cast<std::uint64_t>(kTokenBytes);
  std::printf("node bytes: %lld nodes, %lld ranks, %lld-token shards of %zu-byte tokens\n", static_cast<long long>(t.num_nodes()),
              static_cast<long long>(t.world_size()), static_cast<long long>(kShardTokens), kTokenBytes);
  std::printf("inter-node KV tokens: flat %lld, dedup %lld, node-level %lld (inside nodes: dedup %lld, node-level %lld)\n",
              static_cast<long long>(p.counts.flat), static_cast<long long>(p.counts.dedup), static_cast<long long>(p.counts.node_level),
              static_cast<long long>(p.dedup_inside), static_cast<long long>(p.counts.inside));
  std::printf("%-20s %12s %12s %8s %6s %12s %8s %12s %12s\n", "exchange", "planned B", "sent B", "frames", "resent", "received B", "ratio", "inside B", "loopback B");
  const std::array<std::int64_t, num_exchanges> between = {p.counts.dedup, p.counts.node_level, p.counts.dedup, p.counts.node_level};
  const std::array<std::int64_t, num_exchanges> inside = {p.dedup_inside, p.counts.inside, p.dedup_inside, p.counts.inside};
  std::array<Row, num_exchanges> rows{};
  bool ok = true;
  for (std::size_t e = 0; e < num_exchanges; ++e) {
    rows[e].planned = static_cast<std::uint64_t>(between[e]) * tb;
    rows[e].planned_inside = static_cast<std::uint64_t>(inside[e]) * tb;
    for (std::int64_t n = 0; n < t.num_nodes(); ++n) {
      const Counters& c = runs[static_cast<std::size_t>(ranks_of(t, n).front())].bytes[e];
      rows[e].sent += c[0];
      rows[e].received += c[1];
      rows[e].loopback += c[2];
      rows[e].frames += c[3];
      rows[e].resent += c[4];
    }
    ok = check_row(kNames[e], rows[e]) && ok;
  }
  for (std::size_t e : {std::size_t{0}, std::size_t{2}}) {
    if (rows[e + 1].sent >= rows[e].sent) {
      std::printf("  %s sent %llu bytes between nodes, not fewer than %s's %llu\n", kNames[e + 1], static_cast<unsigned long long>(rows[e + 1].sent), kNames[e],
                  static_cast<unsigned long long>(rows[e].sent));
      ok = false;
    }
  }
  return ok;
}

int run(MpiTransport& t) {
  const char* device = std::getenv("CPD_NETNS_DEVICE");
  if (!device || !*device) throw std::runtime_error("CPD_NETNS_DEVICE (the link between nodes) is not set: run it with tests/multihost/run_multihost.sh");
  const Topology topology = cpdispatch::mpi_topology(t.comm());
  check_namespaces(t.comm(), topology);
  const Planned p(topology);
  if (p.counts.node_level >= p.counts.dedup) throw std::runtime_error("needs at least 2 nodes and a node with 2 ranks: the plan saves nothing between nodes");
  const RankRun mine = run_rank(t, p, device);
  std::vector<RankRun> runs(static_cast<std::size_t>(t.world_size()));
  MPI_Gather(&mine, sizeof(RankRun), MPI_BYTE, runs.data(), sizeof(RankRun), MPI_BYTE, 0, t.comm());
  int ok = 1;
  if (t.rank() == 0) {
    for (std::size_t r = 0; r < runs.size(); ++r) {
      if (!runs[r].same_results) std::printf("  rank %zu: the node-level exchange's results differ from the deduplicated exchange's\n", r);
      ok = ok && runs[r].same_results;
    }
    ok = report(p, runs) && ok;
    std::printf("%s\n", ok ? "PASS" : "FAIL");
  }
  MPI_Bcast(&ok, 1, MPI_INT, 0, t.comm());
  return ok ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int status = 0;
  try {
    MpiTransport t = MpiTransport::duplicate(MPI_COMM_WORLD);
    status = run(t);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "node_bytes_mpi: %s\n", e.what());
    MPI_Abort(MPI_COMM_WORLD, 2);  // other ranks may wait in a collective
  }
  MPI_Finalize();
  return status;
}
