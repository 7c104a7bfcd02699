// cpdispatch-plan: reads a dispatch plan (JSON, docs/plan-format.md section 3)
// and writes its metadata as JSON, or a per-rank summary.
//
// Exit status: 0 success; 2 invalid input or usage (one line on stderr, nothing
// on stdout); 1 any other failure (out of memory, stdout not writable).
//
// Layout: main() picks a subcommand from argv[1] and runs it under
// run_guarded(), which turns exceptions into the exit status and the one
// stderr line. Plan mode (run_plan) is the default when no subcommand name
// matches.

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <iomanip>
#include <iostream>
#include <limits>
#include <new>
#include <optional>
#include <span>
#include <sstream>
#include <string>
#include <string_view>
#include <type_traits>
#include <variant>
#include <vector>

#include "balance_command.hpp"
#include "cpdispatch/io/json.hpp"
#include "cpdispatch/plan/node_wire.hpp"
#include "cpdispatch/model/step_model.hpp"

namespace {

constexpr std::string_view program = "cpdispatch-plan";
constexpr int exit_invalid = 2;
constexpr int exit_failure = 1;
/// What one integer of the output costs beyond the metadata's own 8 bytes:
/// a 16-byte JSON value and its text (up to 20 digits and a separator).
constexpr std::uint64_t json_bytes_per_integer = 40;

using Args = std::span<const std::string_view>;

constexpr std::string_view plan_usage = R"(Usage: cpdispatch-plan [FILE|-] [--summary | --rank R] [--svg FILE] [--compact]
       cpdispatch-plan balance [FILE|-] [...]   (choose a balanced plan: balance --help)
       cpdispatch-plan simulate [FILE|-] [...]  (model one layer's time on a cluster: simulate --help)

Reads a dispatch plan as JSON from FILE (standard input when FILE is - or
absent) and writes its metadata as JSON to standard output.

Plans ("kind" is optional: "ranks" or "documents" mean qkv, "seq_len" query):
  {"kind": "qkv", "world_size": W, "max_cp_degree": C,
   "ranks": [{"docs": [{"shard_len": [...], "dst": [...]}, ...]}, ...]}
  {"kind": "qkv", "world_size": W, "max_cp_degree": C,
   "documents": [{"shards": [{"rank": r, "len": n, "dst": d}, ...]}, ...]}
  {"kind": "query", "world_size": W, "seq_len": [[...]], "dispatch": [[...]] or [[[...]]]}
A qkv plan has "ranks" (each document on one rank) or "documents" (each
shard with its home rank "rank", so a document may span ranks), never both.
It may have "mask": {"type": "causal"} (the default), {"type": "full"} or
{"type": "sliding_window", "window": w} (a query sees itself and the w - 1
keys before it); the mask decides which KV shards each query needs, and the
output carries it as attn.mask. A document of the documents form may also
have "slices": [{"q": [qa, qb], "k": [ka, kb], "type": "causal"}, ...]
(types full, causal, inv_causal, bi_causal; docs/plan-format.md section
2e): its mask as rectangles of (query, key) positions, no pair in two of
them; then each query shard needs a set of KV shards, and "attn" gains
"entries" ([q0, q1, k0, k1, lo, hi] per query shard, null = unbounded).
"max_cp_degree" defaults to the most query shards that need one KV shard.
Unknown keys are errors, so a misspelt optional key is never ignored.
Output: {"q_fwd", "q_rev", "kv_fwd", "kv_rev", "attn"} for a qkv plan,
{"fwd", "rev"} for a query plan; each metadata object has dst_rank,
dst_offset, seq_len, num_recv_tokens, num_seqs, seq_recv_mask, recv_seq_lens.

Options:
  --summary   instead of JSON, a per-rank table (shards, tokens, query tokens
              sent off-rank and received, KV tokens received; for a qkv plan
              also the attention cost, in (query, key) pairs the mask lets
              through, and KV tokens as the mask sends them (a mask other
              than causal is named in the first line); for a plan in
              documents form also "spanning": the rank's shards that belong
              to documents continuing on other ranks, and in the documents
              line how many documents have slices, with their slices and
              attention entries) and the max/mean imbalance of received
              tokens and of attention cost
  --rank R    only rank R's share, planned without the global metadata:
              {"rank": R, "q_fwd", "q_rev", "kv_fwd", "kv_rev": slice, "attn"}
              ({"rank", "fwd", "rev"} for a query plan); a slice is rank R's
              row of each metadata object, without padding, "attn" its
              seqlens_q/kv, cu_seqlens_q/kv, max_seqlen_q/kv and mask
  --svg FILE  also write a picture of a qkv plan to FILE (SVG): tokens sent
              between ranks, and attention cost per rank (and with every
              document at home, when that differs)
  --compact   JSON on one line instead of pretty-printed
  --max-memory SIZE
              refuse, before allocating it, a plan whose metadata (and JSON
              output) would take more than SIZE bytes (suffixes K, M, G, T:
              powers of 1024); default: the smaller of 4G and half the
              available memory
  --dedup     (qkv plans; also "dedup": true in the plan) the deduplicated KV
              exchange: the output gains "kv_wire_fwd" and "kv_wire_rev"
              (each KV shard sent once per destination rank; with --rank R
              rank R's slices of them), --summary a line with the KV tokens
              sent off-rank without and with it
  With "ranks_per_node": n or "nodes": [node of each rank] in the plan
  (docs/node-exchange.md), --summary also prints the tokens that cross
  between nodes: "inter-node KV tokens: flat X, dedup Y, node-level Z" (qkv
  plans) and "inter-node query tokens: Q"
  -h, --help  this help

Exit status: 0 success, 2 invalid input or usage (one line on standard error
naming the field), 1 other failures.
)";

/// Messages go out as one line, whatever the input put into them.
std::string single_line(std::string_view message) {
  std::string out(message);
  for (char& c : out) {
    if (c == '\n' || c == '\r') c = ' ';
  }
  return out;
}

/// The planners prefix their messages with their own name; here the message
/// is about the user's file, so the JSON path alone reads better.
std::string_view without_planner_prefix(std::string_view message) {
  for (std::string_view prefix : {"plan_qkv: ", "plan_query: ", "plan_qkv_for_rank: ", "plan_query_for_rank: ", "plan_kv_wire_for_rank: "}) {
    if (message.starts_with(prefix)) return message.substr(prefix.size());
  }
  return message;
}

/// The whole of FILE, or of standard input for "-"; an input larger than
/// `max_bytes` is refused as soon as that much has been read.
std::string read_input(const std::string& path, std::size_t max_bytes) {
  std::FILE* in = path == "-" ? stdin : std::fopen(path.c_str(), "rb");
  if (in == nullptr) cpdispatch::detail::fail("cannot open '", path, "': ", std::strerror(errno));
  std::string text;
  char buffer[1 << 16];
  std::size_t n = 0;
  while (text.size() <= max_bytes && (n = std::fread(buffer, 1, sizeof buffer, in)) > 0) text.append(buffer, n);
  if (text.size() > max_bytes) {
    if (in != stdin) std::fclose(in);
    cpdispatch::detail::fail("'", path == "-" ? "standard input" : path, "' is larger than ", max_bytes,
                             " bytes, the most JSON text --max-memory allows");
  }
  const bool failed = std::ferror(in) != 0;
  const int read_errno = errno;
  if (in != stdin) std::fclose(in);
  if (failed) {
    cpdispatch::detail::fail("cannot read '", path == "-" ? "standard input" : path, "': ", std::strerror(read_errno));
  }
  return text;
}

/// Writes `text` to standard output; a failure is not invalid input (exit 1).
void write_output(std::string_view text) {
  if (std::fwrite(text.data(), 1, text.size(), stdout) != text.size() || std::fflush(stdout) != 0) {
    throw std::runtime_error(cpdispatch::detail::concat("cannot write the output: ", std::strerror(errno)));
  }
}

// ---------------------------------------------------------------- summary

/// Right-aligned columns, two spaces apart.
std::string format_table(const std::vector<std::vector<std::string>>& rows) {
  std::vector<std::size_t> width;
  for (const auto& row : rows) {
    width.resize(std::max(width.size(), row.size()), 0);
    for (std::size_t c = 0; c < row.size(); ++c) width[c] = std::max(width[c], row[c].size());
  }
  std::string out;
  for (const auto& row : rows) {
    for (std::size_t c = 0; c < row.size(); ++c) {
      out += std::string(c ? 2 : 0, ' ') + std::string(width[c] - row[c].size(), ' ') + row[c];
    }
    out += '\n';
  }
  return out;
}

/// "1.412 (max 12, mean 8.5)" for the tokens each rank receives (column W of
/// num_recv_tokens).
std::string imbalance(const cpdispatch::Metadata& m) {
  const auto W = static_cast<std::size_t>(m.world_size);
  std::int64_t max = 0;
  double sum = 0;
  for (std::size_t r = 0; r < W; ++r) {
    max = std::max(max, m.num_recv_tokens(r, W));
    sum += static_cast<double>(m.num_recv_tokens(r, W));
  }
  const double mean = sum / static_cast<double>(W);
  if (max == 0) return "n/a (no tokens)";
  return cpdispatch_cli::max_over_mean_text(max, mean);
}

/// The (query, key) pairs `entries` (section 2e) of rank d let through.
std::int64_t entry_pairs_of(const std::vector<cpdispatch::AttentionEntry>& entries, std::size_t d) {
  std::int64_t total = 0;
  for (const cpdispatch::AttentionEntry& e : entries) {
    const std::int64_t pairs = cpdispatch::band_pairs(e.q_start, e.q_start + e.q_len, e.kv_start, e.kv_start + e.kv_len, e.band);
    if (__builtin_add_overflow(total, pairs, &total)) cpdispatch::detail::fail("summary: attention cost of rank ", d, " overflows 64 bits");
  }
  return total;
}

/// `pairs` more on rank d's attention cost.
void add_pairs(std::vector<std::int64_t>& cost, std::size_t d, std::int64_t pairs) {
  if (__builtin_add_overflow(cost[d], pairs, &cost[d])) cpdispatch::detail::fail("summary: attention cost of rank ", d, " overflows 64 bits");
}

/// Each rank's share of its group's head-parallel documents (section 2f):
/// it attends 1/u of the heads, so 1/u of each one's pairs, as plan_cost counts them.
void add_head_parallel_pairs(const cpdispatch::HeadParallelLayout& hp, std::vector<std::int64_t>& cost) {
  if (hp.empty()) return;
  for (std::size_t d = 0; d < cost.size(); ++d) {
    for (std::size_t i = 0; i < hp.seqlens[d].size(); ++i) {
      const std::int64_t len = hp.seqlens[d][i];
      const std::int64_t pairs = hp.entries.empty() ? cpdispatch::entry_pairs(hp.mask, len, len) : entry_pairs_of(hp.entries[d][i], d);
      add_pairs(cost, d, cpdispatch::detail::cost::head_parallel_share(pairs, hp.degree, hp.group_rank[d]));
    }
  }
}

/// Token pairs each destination attends, from its attention layout: its
/// entries where the plan has slices, else its KV groups under the mask;
/// and its share of the head-parallel documents.
std::vector<std::int64_t> attention_per_rank(const cpdispatch::QkvMetadata& qkv) {
  const cpdispatch::AttentionLayout& attn = qkv.attn;
  std::vector<std::int64_t> cost(attn.seqlens_q.size(), 0);
  for (std::size_t d = 0; d < cost.size(); ++d) {
    if (!attn.entries.empty()) {
      for (const auto& shard : attn.entries[d]) add_pairs(cost, d, entry_pairs_of(shard, d));
    } else {
      for (std::size_t i = 0; i < attn.seqlens_q[d].size(); ++i) add_pairs(cost, d, cpdispatch::entry_pairs(attn.mask, attn.seqlens_q[d][i], attn.seqlens_kv[d][i]));
    }
  }
  add_head_parallel_pairs(qkv.hp_attn, cost);
  return cost;
}

/// Per home rank: its shards that belong to documents with shards on other ranks.
std::vector<std::int64_t> spanning_shards(const cpdispatch::QkvDocumentsPlan& plan) {
  std::vector<std::int64_t> count(static_cast<std::size_t>(plan.world_size), 0);
  for (const cpdispatch::PackedDocument& doc : plan.documents) {
    bool spans = false;
    for (const cpdispatch::DocumentShard& s : doc.shards) spans = spans || s.rank != doc.shards.front().rank;
    if (!spans) continue;
    for (const cpdispatch::DocumentShard& s : doc.shards) ++count[static_cast<std::size_t>(s.rank)];
  }
  return count;
}

/// ", 1 with slices (5 slices, 6 attention entries)" for a plan whose
/// documents have slices (section 2e); empty otherwise, so other plans'
/// summaries read as they always have.
std::string slices_part(const cpdispatch::QkvDocumentsPlan& plan, const cpdispatch::QkvMetadata* qkv) {
  std::size_t documents = 0, slices = 0, entries = 0;
  for (const cpdispatch::PackedDocument& doc : plan.documents) {
    documents += doc.slices.empty() ? 0 : 1;
    slices += doc.slices.size();
  }
  if (documents == 0) return {};
  if (qkv) {
    for (const auto& rank : qkv->attn.entries)
      for (const auto& shard : rank) entries += shard.size();
  }
  return ", " + std::to_string(documents) + " with slices (" + std::to_string(slices) + " slices, " + std::to_string(entries) +
         " attention entries)";
}

/// ", 1 head-parallel (head_parallel_degree 2, up to 5 tokens a rank)" for a
/// plan with head-parallel documents (section 2f); empty otherwise.
std::string head_parallel_part(const cpdispatch::QkvDocumentsPlan& plan, const cpdispatch::QkvMetadata* qkv) {
  const auto documents = std::count_if(plan.documents.begin(), plan.documents.end(), [](const auto& doc) { return doc.head_parallel; });
  if (documents == 0 || !qkv) return {};
  std::int64_t most = 0;
  for (const auto& row : qkv->hp_attn.cu_seqlens) most = std::max(most, row.back());
  return ", " + std::to_string(documents) + " head-parallel (head_parallel_degree " + std::to_string(qkv->hp_attn.degree) + ", up to " +
         std::to_string(most) + " tokens a rank)";
}

/// "documents: 3, 1 spanning ranks" for a plan in documents form.
std::string documents_line(const cpdispatch::QkvDocumentsPlan& plan, const cpdispatch::QkvMetadata* qkv) {
  std::size_t spanning = 0;
  for (const cpdispatch::PackedDocument& doc : plan.documents) {
    for (const cpdispatch::DocumentShard& s : doc.shards) {
      if (s.rank == doc.shards.front().rank) continue;
      ++spanning;
      break;
    }
  }
  return "documents: " + std::to_string(plan.documents.size()) + ", " + std::to_string(spanning) + " spanning ranks" + slices_part(plan, qkv) +
         head_parallel_part(plan, qkv) + "\n";
}

std::string summary_head(const cpdispatch::Metadata& q, const cpdispatch::QkvMetadata* qkv) {
  std::ostringstream head;
  const auto W = static_cast<std::size_t>(q.world_size);
  if (qkv) {
    head << "qkv plan: world_size " << W << ", max_cp_degree " << qkv->kv_fwd.num_copies();
    // The causal default goes unsaid, so the summaries of causal plans read as they always have.
    if (qkv->attn.mask != cpdispatch::AttentionMask::causal()) head << ", mask " << cpdispatch::to_string(qkv->attn.mask);
    head << '\n';
  } else if (q.has_copies()) {
    head << "query plan: world_size " << W << ", dispatch [W][S][C] with C = " << q.num_copies() << '\n';
  } else {
    head << "query plan: world_size " << W << ", dispatch [W][S]\n";
  }
  return head.str();
}

/// Per rank: its shards and tokens (MLP layout), query tokens it sends to
/// other ranks and query (and KV) tokens it receives, and for a qkv plan the
/// attention cost ((query, key) pairs the mask lets through) and, in documents form, its shards of
/// documents that span ranks; then the imbalance.
std::string summary(const cpdispatch::PlanMetadata& planned, const cpdispatch::Plan& plan) {
  const auto* qkv = std::get_if<cpdispatch::QkvMetadata>(&planned);
  const auto* documents = std::get_if<cpdispatch::QkvDocumentsPlan>(&plan);
  const cpdispatch::Metadata& q = qkv ? qkv->q_fwd : std::get<cpdispatch::QueryMetadata>(planned).fwd;
  const auto W = static_cast<std::size_t>(q.world_size);
  const std::vector<std::int64_t> cost = qkv ? attention_per_rank(*qkv) : std::vector<std::int64_t>{};
  const std::vector<std::int64_t> spanning = documents ? spanning_shards(*documents) : std::vector<std::int64_t>{};
  std::vector<std::vector<std::string>> rows = {{"rank", "shards", "tokens", "q_sent_off_rank", "q_recv"}};
  if (qkv) rows[0].insert(rows[0].end(), {"kv_recv", "attn_cost"});
  if (documents) rows[0].push_back("spanning");
  for (std::size_t r = 0; r < W; ++r) {
    std::int64_t sent_off_rank = 0;
    for (std::size_t d = 0; d < W; ++d) sent_off_rank += d == r ? 0 : q.num_recv_tokens(d, r);
    rows.push_back({std::to_string(r), std::to_string(q.num_seqs(r)), std::to_string(q.send_tokens(static_cast<std::int64_t>(r))),
                    std::to_string(sent_off_rank), std::to_string(q.num_recv_tokens(r, W))});
    if (qkv) rows.back().insert(rows.back().end(), {std::to_string(qkv->kv_fwd.num_recv_tokens(r, W)), std::to_string(cost[r])});
    if (documents) rows.back().push_back(std::to_string(spanning[r]));
  }
  std::string out = summary_head(q, qkv) + (documents ? documents_line(*documents, qkv) : std::string()) + format_table(rows);
  out += "imbalance (max/mean of tokens received): q " + imbalance(q);
  if (qkv) out += ", kv " + imbalance(qkv->kv_fwd);
  out += '\n';
  std::int64_t max = 0;
  double total = 0;
  for (std::int64_t c : cost) {
    max = std::max(max, c);
    total += static_cast<double>(c);
  }
  if (total > 0) {
    out += "imbalance of attention cost (max/mean): " + cpdispatch_cli::max_over_mean_text(max, total / static_cast<double>(W)) + '\n';
  }
  return out;
}

/// --dedup's summary line: KV tokens that cross between ranks, without and with deduplication.
std::string dedup_line(const cpdispatch::Metadata& kv_fwd, const cpdispatch::KvWireMetadata& wire) {
  const std::int64_t plain = cpdispatch::off_rank_tokens(kv_fwd), dedup = cpdispatch::off_rank_tokens(wire.fwd);
  std::ostringstream line;
  line << "kv tokens sent off-rank: " << plain << ", deduplicated " << dedup;
  if (plain > 0) line << " (" << std::fixed << std::setprecision(3) << static_cast<double>(dedup) / static_cast<double>(plain) << "x)";
  line << '\n';
  return line.str();
}

/// With a topology, --summary's lines of tokens that cross between nodes.
std::string node_lines(const cpdispatch::PlanMetadata& planned, const std::optional<cpdispatch::Topology>& topology) {
  if (!topology) return {};
  std::ostringstream lines;
  const auto* qkv = std::get_if<cpdispatch::QkvMetadata>(&planned);
  const cpdispatch::Metadata& q = qkv ? qkv->q_fwd : std::get<cpdispatch::QueryMetadata>(planned).fwd;
  if (qkv) {
    const cpdispatch::NodeTokenCounts kv = cpdispatch::node_token_counts(qkv->kv_fwd, *topology);
    lines << "inter-node KV tokens: flat " << kv.flat << ", dedup " << kv.dedup << ", node-level " << kv.node_level << '\n';
  }
  lines << "inter-node query tokens: " << cpdispatch::inter_node_tokens(q, *topology) << '\n';
  return lines.str();
}

// ---------------------------------------------------------------- plan mode

struct PlanOptions {
  std::string input = "-";
  std::string svg;  // --svg FILE
  std::optional<std::int64_t> rank;  // --rank R
  std::uint64_t max_memory = 0;      // --max-memory SIZE; 0: the default
  bool summary = false;
  bool compact = false;
  bool dedup = false;
  bool help = false;
};

/// The R of --rank R: a whole decimal number.
std::int64_t parse_rank(std::string_view text) {
  const std::string s(text);
  char* end = nullptr;
  errno = 0;
  const long long value = std::strtoll(s.c_str(), &end, 10);
  if (s.empty() || end != s.c_str() + s.size() || errno == ERANGE) cpdispatch::detail::fail("--rank needs a rank number, got '", text, "'");
  return value;
}

/// The SIZE of --max-memory SIZE: a whole number of bytes, optionally with
/// K, M, G or T (powers of 1024, "KiB" etc. also accepted).
std::uint64_t parse_size(std::string_view text) {
  std::string s(text);
  std::uint64_t scale = 1;
  for (const std::string_view suffix : {"iB", "B"}) {
    if (s.size() > suffix.size() && std::string_view(s).ends_with(suffix)) {
      s.resize(s.size() - suffix.size());
      break;
    }
  }
  if (!s.empty()) {
    const std::string_view units = "KMGT";
    if (const auto u = units.find(static_cast<char>(std::toupper(static_cast<unsigned char>(s.back())))); u != std::string_view::npos) {
      scale = std::uint64_t{1} << (10 * (u + 1));
      s.pop_back();
    }
  }
  char* end = nullptr;
  errno = 0;
  const unsigned long long value = std::strtoull(s.c_str(), &end, 10);
  if (s.empty() || s.front() == '-' || end != s.c_str() + s.size() || errno == ERANGE || value == 0 ||
      value > std::numeric_limits<std::uint64_t>::max() / scale) {
    cpdispatch::detail::fail("--max-memory needs a positive size in bytes (e.g. 512M or 2G), got '", text, "'");
  }
  return value * scale;
}

/// Half the memory the system reports available (MemAvailable), 0 when unknown.
std::uint64_t half_available_memory() {
  std::FILE* f = std::fopen("/proc/meminfo", "r");
  if (f == nullptr) return 0;
  char line[256];
  unsigned long long kib = 0;
  while (std::fgets(line, sizeof line, f) != nullptr) {
    if (std::sscanf(line, "MemAvailable: %llu kB", &kib) == 1) break;
  }
  std::fclose(f);
  return kib * 1024 / 2;
}

/// The limits planning runs under: --max-memory, or the smaller of 4 GiB and
/// half the available memory. JSON output keeps a second and third copy of
/// every integer (the JSON tree, 16 bytes, and its text), so each costs more.
cpdispatch::PlanLimits plan_limits(const PlanOptions& options, bool json_output) {
  cpdispatch::PlanLimits limits;
  if (options.max_memory > 0) {
    limits.max_bytes = options.max_memory;
  } else if (const std::uint64_t half = half_available_memory(); half > 0) {
    limits.max_bytes = std::min(limits.max_bytes, half);
  }
  if (json_output) limits.bytes_per_element += json_bytes_per_integer;
  return limits;
}

/// The most JSON text the limits let a command read.
std::size_t max_input_bytes(const cpdispatch::PlanLimits& limits) {
  const cpdispatch::PlanFootprint per_byte = cpdispatch::footprint::json_document(1);
  return static_cast<std::size_t>(limits.max_bytes / cpdispatch::footprint_bytes(per_byte, limits));
}

PlanOptions parse_plan_options(Args args) {
  using cpdispatch::detail::fail;
  PlanOptions options;
  bool have_input = false, options_done = false;
  for (std::size_t i = 0; i < args.size(); ++i) {
    const std::string_view arg = args[i];
    if (!options_done && arg.size() > 1 && arg.front() == '-') {
      if (arg == "--") options_done = true;
      else if (arg == "--summary") options.summary = true;
      else if (arg.starts_with("--svg=")) options.svg = std::string(arg.substr(6));
      else if (arg == "--svg" && i + 1 < args.size()) options.svg = std::string(args[++i]);
      else if (arg == "--svg") fail("--svg needs a file name (--svg FILE)");
      else if (arg.starts_with("--rank=")) options.rank = parse_rank(arg.substr(7));
      else if (arg == "--rank" && i + 1 < args.size()) options.rank = parse_rank(args[++i]);
      else if (arg == "--rank") fail("--rank needs a rank number (--rank R)");
      else if (arg == "--compact") options.compact = true;
      else if (arg.starts_with("--max-memory=")) options.max_memory = parse_size(arg.substr(13));
      else if (arg == "--max-memory" && i + 1 < args.size()) options.max_memory = parse_size(args[++i]);
      else if (arg == "--max-memory") fail("--max-memory needs a size (--max-memory SIZE)");
      else if (arg == "--dedup") options.dedup = true;
      else if (arg == "--help" || arg == "-h") options.help = true;
      else fail("unknown option '", arg, "' (see --help)");
      continue;
    }
    if (have_input) fail("more than one input file ('", options.input, "' and '", arg, "')");
    options.input = std::string(arg);
    have_input = true;
  }
  if (options.summary && options.compact) fail("--compact applies to the JSON output, not to --summary");
  if (options.summary && options.rank) fail("--rank prints one rank's JSON; it does not combine with --summary");
  return options;
}

void write_json(const nlohmann::json& j, bool compact) {
  write_output((compact ? j.dump() : cpdispatch::to_pretty_string(j)) + '\n');
}

/// --svg FILE: the picture of a qkv plan, bytes weighed at q_bytes and
/// kv_bytes per token.
void write_svg(const PlanOptions& options, const cpdispatch::Plan& plan, std::int64_t q_bytes, std::int64_t kv_bytes,
               const cpdispatch::PlanLimits& limits) {
  if (options.svg.empty()) return;
  if (const auto* documents = std::get_if<cpdispatch::QkvDocumentsPlan>(&plan)) {
    if (cpdispatch::detail::has_head_parallel(*documents)) {
      cpdispatch::detail::fail("--svg does not draw head-parallel documents (docs/plan-format.md, section 2f) yet");
    }
    return cpdispatch_cli::write_file(options.svg, cpdispatch_cli::plan_picture(*documents, q_bytes, kv_bytes, limits));
  }
  const auto* qkv = std::get_if<cpdispatch::QkvPlan>(&plan);
  if (!qkv) cpdispatch::detail::fail("--svg draws qkv plans (documents); this is a query plan");
  cpdispatch_cli::write_file(options.svg, cpdispatch_cli::plan_picture(*qkv, q_bytes, kv_bytes, limits));
}

int run_plan(Args args) {
  const PlanOptions options = parse_plan_options(args);
  if (options.help) {
    write_output(plan_usage);
    return 0;
  }
  const cpdispatch::PlanLimits reading = plan_limits(options, false);
  const nlohmann::json input = cpdispatch::parse_json(read_input(options.input, max_input_bytes(reading)), reading);
  const cpdispatch::Plan plan = cpdispatch::plan_from_json(input);
  const std::optional<cpdispatch::Topology> topology =
      cpdispatch::topology_from_json(input, std::visit([](const auto& p) { return p.world_size; }, plan));
  const bool dedup = options.dedup || cpdispatch::dedup_requested(input);
  if (dedup && plan.index() == 0) cpdispatch::detail::fail("--dedup applies to qkv plans (key-value copies); this is a query plan");
  cpdispatch::PlanLimits limits = plan_limits(options, !options.summary);
  if (options.rank) {
    const nlohmann::json mine = dedup ? cpdispatch::rank_share_with_wire_to_json(plan, *options.rank, limits)
                                      : cpdispatch::rank_metadata_to_json(cpdispatch::plan_metadata_for_rank(plan, *options.rank, limits));
    write_svg(options, plan, 1, 1, reading);
    write_json(mine, options.compact);
    return 0;
  }
  if (dedup) limits.bytes_per_element += limits.bytes_per_element / 2;  // the wire metadata repeats half of the KV shapes and more
  const cpdispatch::PlanMetadata planned = cpdispatch::plan_metadata(plan, limits);  // invalid plans stop here
  const auto* qkv = std::get_if<cpdispatch::QkvMetadata>(&planned);
  const std::optional<cpdispatch::KvWireMetadata> wire = dedup ? std::optional(cpdispatch::plan_kv_wire(*qkv)) : std::nullopt;
  write_svg(options, plan, 1, 1, reading);
  if (options.summary) {
    write_output(summary(planned, plan) + (wire ? dedup_line(qkv->kv_fwd, *wire) : std::string()) + node_lines(planned, topology));
  } else {
    nlohmann::json out = cpdispatch::metadata_to_json(planned);
    if (wire) cpdispatch::add_kv_wire(out, *wire);
    write_json(out, options.compact);
  }
  return 0;
}

// ---------------------------------------------------------------- balance mode

std::int64_t parse_count(std::string_view name, std::string_view text);

/// --grid G: a whole number in [1, 2^40].
std::int64_t parse_grid(std::string_view text) {
  const std::int64_t grid = parse_count("--grid", text);
  if (grid > cpdispatch::max_grid) cpdispatch::detail::fail("--grid needs a whole number at most 2^40 (1: no grid), got '", text, "'");
  return grid;
}

/// balance's own flags (head-parallel choice, grid), which override the input's keys.
struct BalanceFlags {
  std::optional<cpdispatch::HeadParallel> mode;
  std::optional<std::int64_t> heads_q, heads_kv, degree, grid;
  void apply(cpdispatch::BalanceOptions& o) const {
    o.head_parallel = mode.value_or(o.head_parallel);
    o.heads_q = heads_q.value_or(o.heads_q);
    o.heads_kv = heads_kv.value_or(o.heads_kv);
    o.head_parallel_degree = degree.value_or(o.head_parallel_degree);
    o.grid = grid.value_or(o.grid);
  }
};

/// Takes --head-parallel off|auto, --heads-q H, --heads-kv H,
/// --head-parallel-degree U and --grid G (each also as --flag=V) into
/// `flags`; the other arguments are returned.
std::vector<std::string_view> take_balance_flags(Args args, BalanceFlags& flags) {
  std::vector<std::string_view> rest;
  for (std::size_t i = 0; i < args.size(); ++i) {
    const std::string_view arg = args[i];
    const std::string_view name = arg.substr(0, arg.find('='));
    if (name != "--head-parallel" && name != "--heads-q" && name != "--heads-kv" && name != "--head-parallel-degree" && name != "--grid") {
      rest.push_back(arg);
      continue;
    }
    if (name == arg && i + 1 >= args.size()) cpdispatch::detail::fail(name, " needs a value");
    const std::string_view value = name == arg ? args[++i] : arg.substr(name.size() + 1);
    if (name == "--head-parallel") flags.mode = cpdispatch::head_parallel_from_string(value, name);
    else if (name == "--heads-q") flags.heads_q = parse_count(name, value);
    else if (name == "--heads-kv") flags.heads_kv = parse_count(name, value);
    else if (name == "--grid") flags.grid = parse_grid(value);
    else flags.degree = parse_count(name, value);
  }
  return rest;
}

/// `balance`: documents in, the balanced qkv plan out (as JSON, or as plan
/// mode's --summary followed by a comparison with the unbalanced plan).
int run_balance(Args all_args) {
  BalanceFlags flags;
  const std::vector<std::string_view> args = take_balance_flags(all_args, flags);
  const PlanOptions options = parse_plan_options(args);
  if (options.help) {
    write_output(cpdispatch_cli::balance_usage);
    return 0;
  }
  if (options.rank) cpdispatch::detail::fail("--rank applies to plan mode, not to balance");
  const cpdispatch::PlanLimits reading = plan_limits(options, false);
  const nlohmann::json input = cpdispatch::parse_json(read_input(options.input, max_input_bytes(reading)), reading);
  const cpdispatch::BalanceProblem problem = cpdispatch::balance_problem_from_json(input);
  cpdispatch::BalanceOptions balancing = cpdispatch::balance_options_from_json(input);
  balancing.dedup = balancing.dedup || options.dedup;
  flags.apply(balancing);
  const std::optional<cpdispatch::Topology> topology = cpdispatch::topology_from_json(input, problem.world_size, "input");
  const double ratio = cpdispatch::inter_node_ratio_from_json(input);
  const cpdispatch::QkvDocumentsPlan balanced = topology ? cpdispatch::plan_balanced(problem, balancing, *topology, ratio, reading)
                                                         : cpdispatch::plan_balanced(problem, balancing, reading);
  // A packed batch gets the documents form back, documents per rank the per-rank form.
  const cpdispatch::Plan plan = problem.docs.empty() ? cpdispatch::Plan(balanced) : cpdispatch::Plan(cpdispatch::to_rank_plan(balanced));
  write_svg(options, plan, problem.q_bytes, problem.kv_bytes, reading);
  if (options.summary) {
    const cpdispatch::PlanMetadata planned = cpdispatch::plan_metadata(plan, reading);
    const auto& kv_fwd = std::get<cpdispatch::QkvMetadata>(planned).kv_fwd;
    write_output(summary(planned, plan) + cpdispatch_cli::balance_report(problem, balancing, balanced, reading) +
                 (balancing.dedup ? dedup_line(kv_fwd, cpdispatch::plan_kv_wire(kv_fwd)) : std::string()) + node_lines(planned, topology));
  } else {
    nlohmann::json out = cpdispatch::balanced_plan_to_json(plan, balancing.dedup);
    if (topology) out["nodes"] = topology->nodes();  // the plan keeps its network's shape
    write_json(out, options.compact);
  }
  return 0;
}

// ---------------------------------------------------------------- simulate mode

constexpr std::string_view simulate_usage = R"(Usage: cpdispatch-plan simulate [FILE|-] [--cluster h100|h200] [--ranks-per-node N]
                                [--heads H] [--heads-kv H] [--head-dim D] [--stages S]

Reads a qkv plan (JSON) and prints the modelled time of one attention layer's
forward and backward on a cluster (docs/node-exchange.md, "Step-time model"):
the plan with its flat, deduplicated and node-level KV exchanges, and the
zig-zag ring (Transformer Engine p2p), Ulysses and Transformer Engine's
a2a+p2p on the same documents. Times in milliseconds, bytes in MB (10^6);
"n/a" where a scheme cannot run the shape (heads not divisible).

  --cluster         h100 (default: ~400 TFLOP/s attention, NVLink 450 GB/s,
                    InfiniBand 50 GB/s per GPU) or h200
  --ranks-per-node  N ranks a node (default: the plan's "ranks_per_node" /
                    "nodes", else 8)
  --heads, --head-dim, --stages  the layer (default 32, 128, 4); bf16 elements
  --heads-kv        key-value heads (grouped-query attention; default: --heads)
)";

struct SimulateOptions {
  std::string input = "-";
  cpdispatch::ClusterModel cluster = cpdispatch::ClusterModel::h100_ib();
  std::optional<std::int64_t> ranks_per_node;
  cpdispatch::LayerShape shape;
  bool help = false;
};

/// A whole number at least 1 for option `name`.
std::int64_t parse_count(std::string_view name, std::string_view text) {
  const std::string s(text);
  char* end = nullptr;
  errno = 0;
  const long long value = std::strtoll(s.c_str(), &end, 10);
  if (s.empty() || end != s.c_str() + s.size() || errno == ERANGE || value < 1) {
    cpdispatch::detail::fail(name, " needs a whole number at least 1, got '", text, "'");
  }
  return value;
}

SimulateOptions parse_simulate_options(Args args) {
  using cpdispatch::detail::fail;
  SimulateOptions o;
  bool have_input = false;
  for (std::size_t i = 0; i < args.size(); ++i) {
    const std::string_view arg = args[i];
    if (arg == "--help" || arg == "-h") {
      o.help = true;
    } else if (arg == "--cluster" || arg == "--ranks-per-node" || arg == "--heads" || arg == "--heads-kv" || arg == "--head-dim" || arg == "--stages") {
      if (i + 1 >= args.size()) fail(arg, " needs a value");
      const std::string_view v = args[++i];
      if (arg == "--cluster") {
        if (v == "h100") o.cluster = cpdispatch::ClusterModel::h100_ib();
        else if (v == "h200") o.cluster = cpdispatch::ClusterModel::h200_ib();
        else fail("--cluster is h100 or h200, got '", v, "'");
      } else if (arg == "--ranks-per-node") o.ranks_per_node = parse_count(arg, v);
      else if (arg == "--heads") o.shape.heads_q = parse_count(arg, v);
      else if (arg == "--heads-kv") o.shape.heads_kv = parse_count(arg, v);
      else if (arg == "--head-dim") o.shape.head_dim = parse_count(arg, v);
      else o.shape.stages = parse_count(arg, v);
    } else if (arg.size() > 1 && arg.front() == '-') {
      fail("unknown option '", arg, "' (see simulate --help)");
    } else {
      if (have_input) fail("more than one input file ('", o.input, "' and '", arg, "')");
      o.input = std::string(arg);
      have_input = true;
    }
  }
  return o;
}

std::string milliseconds(double seconds) {
  std::ostringstream s;
  s << std::fixed << std::setprecision(3) << seconds * 1e3;
  return s.str();
}

std::string step_table(const std::vector<cpdispatch::StepTime>& rows) {
  std::vector<std::vector<std::string>> table = {
      {"scheme", "fwd compute", "fwd comm", "forward", "bwd compute", "bwd comm", "backward", "step", "inter-node MB"}};
  for (const cpdispatch::StepTime& t : rows) {
    if (!t.feasible) {
      table.push_back({t.scheme, "n/a", "n/a", "n/a", "n/a", "n/a", "n/a", "n/a", "n/a"});
      continue;
    }
    std::ostringstream mb;
    mb << std::fixed << std::setprecision(1) << t.inter_node_bytes / 1e6;
    table.push_back({t.scheme, milliseconds(t.forward_compute), milliseconds(t.forward_comm), milliseconds(t.forward),
                     milliseconds(t.backward_compute), milliseconds(t.backward_comm), milliseconds(t.backward),
                     milliseconds(t.step), mb.str()});
  }
  return format_table(table);
}

/// `simulate`: a qkv plan in, the step-time model's table out.
int run_simulate(Args args) {
  SimulateOptions o = parse_simulate_options(args);
  if (o.help) {
    write_output(simulate_usage);
    return 0;
  }
  PlanOptions reading_options;
  const cpdispatch::PlanLimits reading = plan_limits(reading_options, false);
  const nlohmann::json input = cpdispatch::parse_json(read_input(o.input, max_input_bytes(reading)), reading);
  const cpdispatch::Plan plan = cpdispatch::plan_from_json(input);
  if (plan.index() == 0) cpdispatch::detail::fail("simulate models qkv plans (documents); this is a query plan");
  const std::int64_t W = std::visit([](const auto& p) { return p.world_size; }, plan);
  std::optional<cpdispatch::Topology> topology = cpdispatch::topology_from_json(input, W);
  if (o.ranks_per_node) topology = cpdispatch::Topology::uniform(W, *o.ranks_per_node);
  if (!topology) topology = cpdispatch::Topology::uniform(W, o.cluster.ranks_per_node);
  o.cluster.ranks_per_node = W / topology->num_nodes() + (W % topology->num_nodes() ? 1 : 0);  // the peers' node size
  const cpdispatch::PlanMetadata planned = cpdispatch::plan_metadata(plan, reading);
  const auto& qkv = std::get<cpdispatch::QkvMetadata>(planned);
  const cpdispatch::PlanCost cost = std::visit([&](const auto& p) -> cpdispatch::PlanCost {
    if constexpr (std::is_same_v<std::decay_t<decltype(p)>, cpdispatch::QueryPlan>) return {};
    else return cpdispatch::plan_cost(p, 1, 1, reading);
  }, plan);
  const std::vector<std::int64_t> docs = std::visit([](const auto& p) -> std::vector<std::int64_t> {
    if constexpr (std::is_same_v<std::decay_t<decltype(p)>, cpdispatch::QueryPlan>) return {};
    else return cpdispatch::document_lengths(p);
  }, plan);
  const std::vector<std::vector<cpdispatch::AttentionSlice>> slices = std::visit([](const auto& p) {
    if constexpr (std::is_same_v<std::decay_t<decltype(p)>, cpdispatch::QueryPlan>) return std::vector<std::vector<cpdispatch::AttentionSlice>>{};
    else return cpdispatch::document_slices(p);
  }, plan);
  std::ostringstream head;
  head << "world_size " << W << ", nodes " << topology->num_nodes() << ", heads " << o.shape.heads_q << ", key-value heads " << o.shape.kv_heads() << ", head_dim "
       << o.shape.head_dim << ", stages " << o.shape.stages << " (times in ms)\n";
  write_output(head.str() + step_table(cpdispatch::model_step(qkv, cost, docs, *topology, o.cluster, o.shape, slices)));
  return 0;
}

// ---------------------------------------------------------------- dispatch

int report(std::string_view message, int status) {
  std::string line = single_line(message);
  // The library names its own knob; here the user sets --max-memory.
  if (const auto at = line.find("(PlanLimits::max_bytes)"); at != std::string::npos) line.replace(at, 23, "(--max-memory)");
  std::cerr << program << ": " << line << std::endl;
  return status;
}

/// Runs a subcommand: invalid input exits 2, anything else that escapes 1,
/// each with one line on stderr.
int run_guarded(int (*run)(Args), Args args) {
  try {
    return run(args);
  } catch (const cpdispatch::invalid_input& e) {
    return report(without_planner_prefix(e.what()), exit_invalid);
  } catch (const std::bad_alloc&) {
    return report("out of memory (is the plan this large on purpose?)", exit_failure);
  } catch (const std::exception& e) {
    return report(e.what(), exit_failure);
  }
}

}  // namespace

int main(int argc, char** argv) {
  const std::vector<std::string_view> args(argv + 1, argv + argc);
  // Subcommands, chosen by the first argument.
  if (!args.empty() && args[0] == "balance") return run_guarded(run_balance, Args(args).subspan(1));
  if (!args.empty() && args[0] == "simulate") return run_guarded(run_simulate, Args(args).subspan(1));
  return run_guarded(run_plan, args);
}
