#pragma once
// An independent brute-force reference of the dispatch planner, written
// straight from the prose of docs/plan-format.md (sections 1 and 2).
// It deliberately shares no code (and no headers) with cpdispatch: plain
// nested vectors, quadratic scans, each field computed from its definition.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <vector>

namespace ref {

using I = std::int64_t;
using Vec = std::vector<I>;
using Mat = std::vector<Vec>;
using Cube = std::vector<Mat>;

/// A row-major array with its shape (1 to 3 dimensions).
struct Arr {
  std::vector<std::size_t> shape;
  Vec v;
};

inline Arr arr(const Vec& x) { return {{x.size()}, x}; }
inline Arr arr(const Mat& x, std::size_t cols) {
  Arr a{{x.size(), cols}, {}};
  for (const Vec& row : x) a.v.insert(a.v.end(), row.begin(), row.end());
  return a;
}
inline Arr arr(const Cube& x, std::size_t s, std::size_t c) {
  Arr a{{x.size(), s, c}, {}};
  for (const Mat& m : x)
    for (const Vec& row : m) a.v.insert(a.v.end(), row.begin(), row.end());
  return a;
}

struct Meta {
  Arr dst_rank, dst_offset, seq_len, num_recv_tokens, num_seqs;
  std::optional<Arr> seq_recv_mask, recv_seq_lens;
};

struct Query {
  Meta fwd, rev;
};

struct Doc {
  Vec len, dst;
};

struct Plan {
  I W = 0;
  std::optional<I> C;
  std::vector<std::vector<Doc>> ranks;
};

struct Attn {
  Mat seqlens_q, seqlens_kv, cu_seqlens_q, cu_seqlens_kv;
  Vec max_seqlen_q, max_seqlen_kv;
};

struct Qkv {
  Meta q_fwd, q_rev, kv_fwd, kv_rev;
  Attn attn;
};

/// Adds column W (the row total) to a [W][W] count matrix.
inline Mat with_totals(Mat m) {
  for (Vec& row : m) {
    I t = 0;
    for (I x : row) t += x;
    row.push_back(t);
  }
  return m;
}

/// Section 1. `dispatch` is [W][S][C] (C given, as S may be 0); `three_d`
/// says whether the caller's dispatch was 3-D (otherwise C == 1 and 2-D
/// shapes are produced).
inline Query plan_query(const Mat& seq_len, const Cube& dispatch, std::size_t C, bool three_d) {
  const std::size_t W = seq_len.size();
  const std::size_t S = W ? seq_len[0].size() : 0;

  // P_r(j): sum of the lengths of shards 0..j-1 on r; T_r: all of them.
  auto P = [&](std::size_t r, std::size_t j) {
    I p = 0;
    for (std::size_t i = 0; i < j; ++i) p += seq_len[r][i];
    return p;
  };
  auto T = [&](std::size_t r) { return P(r, S); };

  // All entries in global order: (r, j, k) lexicographic, those with a destination.
  struct Entry {
    std::size_t r, j, k;
    I d, len;
  };
  std::vector<Entry> order;
  for (std::size_t r = 0; r < W; ++r)
    for (std::size_t j = 0; j < S; ++j)
      for (std::size_t k = 0; k < C; ++k)
        if (dispatch[r][j][k] >= 0) order.push_back({r, j, k, dispatch[r][j][k], seq_len[r][j]});

  Query q;
  // ---- fwd
  Cube off(W, Mat(S, Vec(C, 0)));
  for (std::size_t e = 0; e < order.size(); ++e) {
    I sum = 0;  // lengths of the earlier entries that go to the same destination
    for (std::size_t f = 0; f < e; ++f)
      if (order[f].d == order[e].d) sum += order[f].len;
    off[order[e].r][order[e].j][order[e].k] = sum;
  }
  Mat recv(W, Vec(W, 0));
  for (const Entry& e : order) recv[static_cast<std::size_t>(e.d)][e.r] += e.len;
  Vec num_seqs(W, 0);
  for (std::size_t r = 0; r < W; ++r)
    for (std::size_t j = 0; j < S; ++j) num_seqs[r] += seq_len[r][j] > 0 ? 1 : 0;

  if (three_d) {
    q.fwd.dst_rank = arr(dispatch, S, C);
    q.fwd.dst_offset = arr(off, S, C);
  } else {
    Mat d2(W, Vec(S)), o2(W, Vec(S));
    for (std::size_t r = 0; r < W; ++r)
      for (std::size_t j = 0; j < S; ++j) {
        d2[r][j] = dispatch[r][j][0];
        o2[r][j] = off[r][j][0];
      }
    q.fwd.dst_rank = arr(d2, S);
    q.fwd.dst_offset = arr(o2, S);
  }
  q.fwd.seq_len = arr(seq_len, S);
  q.fwd.num_recv_tokens = arr(with_totals(recv), W + 1);
  q.fwd.num_seqs = arr(num_seqs);

  // ---- rev: destination d numbers what it received m = 0.. in global order
  std::vector<std::vector<Entry>> got(W);
  for (const Entry& e : order) got[static_cast<std::size_t>(e.d)].push_back(e);
  std::size_t M = 0;
  for (const auto& g : got) M = std::max(M, g.size());
  Mat rr(W, Vec(M, -1)), ro(W, Vec(M, 0)), rl(W, Vec(M, 0));
  Vec rn(W, 0);
  for (std::size_t d = 0; d < W; ++d) {
    for (std::size_t m = 0; m < got[d].size(); ++m) {
      const Entry& e = got[d][m];
      rr[d][m] = static_cast<I>(e.r);
      rl[d][m] = e.len;
      ro[d][m] = static_cast<I>(e.k) * T(e.r) + P(e.r, e.j);
    }
    rn[d] = static_cast<I>(got[d].size());
  }
  Mat back(W, Vec(W, 0));
  for (std::size_t r = 0; r < W; ++r)
    for (std::size_t d = 0; d < W; ++d) back[r][d] = recv[d][r];
  q.rev.dst_rank = arr(rr, M);
  q.rev.dst_offset = arr(ro, M);
  q.rev.seq_len = arr(rl, M);
  q.rev.num_recv_tokens = arr(with_totals(back), W + 1);
  q.rev.num_seqs = arr(rn);
  if (three_d) {
    Cube mask(W, Mat(S, Vec(C, 0)));
    for (std::size_t r = 0; r < W; ++r)
      for (std::size_t j = 0; j < S; ++j)
        for (std::size_t k = 0; k < C; ++k) mask[r][j][k] = dispatch[r][j][k] >= 0 ? 1 : 0;
    q.rev.seq_recv_mask = arr(mask, S, C);
    q.rev.recv_seq_lens = arr(seq_len, S);
  }
  return q;
}

/// Section 2.
inline Qkv plan_qkv(const Plan& plan) {
  const std::size_t W = static_cast<std::size_t>(plan.W);
  // The local shard order: documents in order, shards in order.
  struct Shard {
    I len, dst;
    std::size_t doc, k, n;  // document index on the rank, index in the document, shards of the document
    I context;              // summed lengths of shards 0..k-1 of the document
  };
  std::vector<std::vector<Shard>> local(W);
  std::size_t S = 0, most = 0;
  for (std::size_t r = 0; r < W; ++r) {
    for (std::size_t i = 0; i < plan.ranks[r].size(); ++i) {
      const Doc& doc = plan.ranks[r][i];
      for (std::size_t k = 0; k < doc.len.size(); ++k) {
        I ctx = 0;
        for (std::size_t p = 0; p < k; ++p) ctx += doc.len[p];
        local[r].push_back({doc.len[k], doc.dst[k], i, k, doc.len.size(), ctx});
      }
      most = std::max(most, doc.len.size());
    }
    S = std::max(S, local[r].size());
  }
  const std::size_t C = plan.C ? static_cast<std::size_t>(*plan.C) : most;

  Mat seq_len(W, Vec(S, 0));
  Cube qdst(W, Mat(S, Vec(1, -1)));
  for (std::size_t r = 0; r < W; ++r)
    for (std::size_t j = 0; j < local[r].size(); ++j) {
      seq_len[r][j] = local[r][j].len;
      qdst[r][j][0] = local[r][j].dst;
    }
  auto P = [&](std::size_t r, std::size_t j) {
    I p = 0;
    for (std::size_t i = 0; i < j; ++i) p += seq_len[r][i];
    return p;
  };
  auto T = [&](std::size_t r) { return P(r, S); };

  Qkv out;
  Query q = plan_query(seq_len, qdst, 1, false);
  out.q_fwd = q.fwd;
  out.q_rev = q.rev;

  // Arrival order of query shards at each destination: global order (r, j).
  std::vector<std::vector<std::pair<std::size_t, std::size_t>>> arrivals(W);
  for (std::size_t r = 0; r < W; ++r)
    for (std::size_t j = 0; j < local[r].size(); ++j) arrivals[static_cast<std::size_t>(local[r][j].dst)].push_back({r, j});
  // Start of the KV group of query shard (r, j) at its destination: the
  // groups before it there, each context + own length.
  auto group_start = [&](std::size_t r, std::size_t j) {
    const auto& a = arrivals[static_cast<std::size_t>(local[r][j].dst)];
    I start = 0;
    for (auto [rr, jj] : a) {
      if (rr == r && jj == j) return start;
      start += local[rr][jj].context + local[rr][jj].len;
    }
    return I{-999999};  // unreachable
  };

  // ---- kv_fwd
  Cube kd(W, Mat(S, Vec(C, -1))), ko(W, Mat(S, Vec(C, 0)));
  Mat krecv(W, Vec(W, 0));
  Vec kn(W, 0);
  for (std::size_t r = 0; r < W; ++r) {
    kn[r] = static_cast<I>(local[r].size());
    for (std::size_t g = 0; g < local[r].size(); ++g) {
      const Shard& sh = local[r][g];
      // copy c goes to the destination of query shard k + c of the same document
      for (std::size_t c = 0; c < sh.n - sh.k; ++c) {
        const std::size_t qj = g - sh.k + (sh.k + c);
        const I d = local[r][qj].dst;
        kd[r][g][c] = d;
        ko[r][g][c] = group_start(r, qj) + sh.context;
        krecv[static_cast<std::size_t>(d)][r] += sh.len;
      }
    }
  }
  out.kv_fwd.dst_rank = arr(kd, S, C);
  out.kv_fwd.dst_offset = arr(ko, S, C);
  out.kv_fwd.seq_len = arr(seq_len, S);
  out.kv_fwd.num_recv_tokens = arr(with_totals(krecv), W + 1);
  out.kv_fwd.num_seqs = arr(kn);

  // ---- kv_rev: at d, KV groups in order, shards 0..i inside a group
  struct Recv {
    I r, off, len;
  };
  std::vector<std::vector<Recv>> got(W);
  for (std::size_t d = 0; d < W; ++d)
    for (auto [r, j] : arrivals[d]) {
      const std::size_t i = local[r][j].k;
      const std::size_t base = j - i;
      for (std::size_t kk = 0; kk <= i; ++kk) {
        const std::size_t g = base + kk;
        got[d].push_back({static_cast<I>(r), static_cast<I>(i - kk) * T(r) + P(r, g), local[r][g].len});
      }
    }
  std::size_t M = 0;
  for (const auto& g : got) M = std::max(M, g.size());
  Mat rr(W, Vec(M, -1)), ro(W, Vec(M, 0)), rl(W, Vec(M, 0));
  Vec rn(W, 0);
  for (std::size_t d = 0; d < W; ++d) {
    for (std::size_t m = 0; m < got[d].size(); ++m) {
      rr[d][m] = got[d][m].r;
      ro[d][m] = got[d][m].off;
      rl[d][m] = got[d][m].len;
    }
    rn[d] = static_cast<I>(got[d].size());
  }
  Mat back(W, Vec(W, 0));
  for (std::size_t r = 0; r < W; ++r)
    for (std::size_t d = 0; d < W; ++d) back[r][d] = krecv[d][r];
  Cube mask(W, Mat(S, Vec(C, 0)));
  for (std::size_t r = 0; r < W; ++r)
    for (std::size_t g = 0; g < S; ++g)
      for (std::size_t c = 0; c < C; ++c) mask[r][g][c] = kd[r][g][c] >= 0 ? 1 : 0;
  out.kv_rev.dst_rank = arr(rr, M);
  out.kv_rev.dst_offset = arr(ro, M);
  out.kv_rev.seq_len = arr(rl, M);
  out.kv_rev.num_recv_tokens = arr(with_totals(back), W + 1);
  out.kv_rev.num_seqs = arr(rn);
  out.kv_rev.seq_recv_mask = arr(mask, S, C);
  out.kv_rev.recv_seq_lens = arr(seq_len, S);

  // ---- attention layout
  Attn& a = out.attn;
  a.seqlens_q.assign(W, {});
  a.seqlens_kv.assign(W, {});
  a.cu_seqlens_q.assign(W, {});
  a.cu_seqlens_kv.assign(W, {});
  a.max_seqlen_q.assign(W, 0);
  a.max_seqlen_kv.assign(W, 0);
  for (std::size_t d = 0; d < W; ++d) {
    for (auto [r, j] : arrivals[d]) {
      a.seqlens_q[d].push_back(local[r][j].len);
      a.seqlens_kv[d].push_back(local[r][j].context + local[r][j].len);
    }
    // exclusive prefix sums with a leading 0 and the total last
    for (std::size_t i = 0; i <= a.seqlens_q[d].size(); ++i) {
      I sq = 0, skv = 0;
      for (std::size_t p = 0; p < i; ++p) {
        sq += a.seqlens_q[d][p];
        skv += a.seqlens_kv[d][p];
      }
      a.cu_seqlens_q[d].push_back(sq);
      a.cu_seqlens_kv[d].push_back(skv);
    }
    for (I x : a.seqlens_q[d]) a.max_seqlen_q[d] = std::max(a.max_seqlen_q[d], x);
    for (I x : a.seqlens_kv[d]) a.max_seqlen_kv[d] = std::max(a.max_seqlen_kv[d], x);
  }
  return out;
}

}  // namespace ref
