#include "collective/schedule.hpp"

#include <string>

#include "core/checks.hpp"

namespace meshla::collective {

std::string_view buffer_name(Buffer buffer) {
  switch (buffer) {
    case Buffer::kInput:
      return "input";
    case Buffer::kGathered:
      return "gathered";
    case Buffer::kPartial:
      return "partial";
    case Buffer::kOutput:
      return "output";
  }
  return "unknown";
}

std::string_view comm_kind_name(CommKind kind) {
  switch (kind) {
    case CommKind::kCopy:
      return "copy";
    case CommKind::kSendRecv:
      return "send_recv";
    case CommKind::kAllGather:
      return "all_gather";
    case CommKind::kReduceScatter:
      return "reduce_scatter";
    case CommKind::kAllReduce:
      return "all_reduce";
  }
  return "unknown";
}

std::int64_t rows_per_rank(const ScheduleParams& params) { return params.m / params.tp; }

std::int64_t chunk_begin(std::int64_t rows, int count, int index) {
  // Balanced split: chunk sizes differ by at most one row.
  return rows / count * index + std::min<std::int64_t>(index, rows % count);
}

namespace {

std::int64_t chunk_size(std::int64_t rows, int count, int index) {
  return chunk_begin(rows, count, index + 1) - chunk_begin(rows, count, index);
}

int wrap(int value, int tp) { return ((value % tp) + tp) % tp; }

// The rows that chunks split: each rank's block, except for an all-reduce that is not a ring,
// which splits (or, sequential, computes) all rows, fewer than tp included.
std::int64_t rows_split_into_chunks(CollectiveOp op, Algorithm algorithm, int tp, std::int64_t m) {
  return op == CollectiveOp::kMatmulAllReduce && algorithm != Algorithm::kRing ? m : m / tp;
}

void validate(const ScheduleParams& p) {
  const std::string_view op = collective_op_name(p.op);
  MESHLA_CHECK_ARG(p.tp >= 1, op << ": tp_size=" << p.tp << " must be at least 1");
  MESHLA_CHECK_ARG(p.rank >= 0 && p.rank < p.tp,
                   op << ": rank=" << p.rank << " is outside [0, tp_size=" << p.tp << ")");
  MESHLA_CHECK_ARG(p.m >= 1, op << ": m=" << p.m << " must be at least 1");
  MESHLA_CHECK_ARG(p.algorithm != Algorithm::kAuto,
                   op << ": the schedule needs a resolved algorithm, not auto");
  MESHLA_CHECK_ARG(p.chunks >= 1, op << ": chunks=" << p.chunks << " must be at least 1");
  MESHLA_CHECK_ARG(p.algorithm != Algorithm::kSequential || p.chunks == 1,
                   op << ": algorithm sequential runs one chunk, got chunks=" << p.chunks);
  MESHLA_CHECK_ARG(!p.return_gathered || p.op == CollectiveOp::kAllGatherMatmul,
                   op << ": only all_gather_matmul can return the gathered input");

  const bool needs_equal_blocks = p.op != CollectiveOp::kMatmulAllReduce;
  if (needs_equal_blocks) {
    MESHLA_CHECK_ARG(p.m % p.tp == 0, op << ": m=" << p.m << " rows are not divisible by tp_size="
                                         << p.tp << " (every rank holds an equal row block)");
  } else if (p.algorithm == Algorithm::kRing && p.m % p.tp != 0) {
    MESHLA_THROW(kNotImplemented,
                 op << ": algorithm ring needs m divisible by tp_size, got m=" << p.m
                    << ", tp_size=" << p.tp << "; use pipelined or sequential");
  }

  const std::int64_t split_rows = rows_split_into_chunks(p.op, p.algorithm, p.tp, p.m);
  MESHLA_CHECK_ARG(p.chunks <= split_rows, op << ": chunks=" << p.chunks << " exceeds the "
                                              << split_rows << " rows it splits (m=" << p.m
                                              << ", tp_size=" << p.tp << ")");
}

// A group of one rank's whole product, from its rows in place into the output.
GemmTask gemm_in_place(const ScheduleParams& p) {
  return {.a = {Buffer::kInput, 0}, .d = {Buffer::kOutput, 0}, .rows = p.m, .bias = p.bias};
}

Schedule all_gather_sequential(const ScheduleParams& p, Schedule s) {
  if (p.tp == 1) {
    // Nothing to gather: the GEMM reads the rows in place, and they are copied out beside it
    // only where the gathered rows are asked for. (NCCL's all-gather over one rank is a copy,
    // whose host time made the whole call 1.2 to 4.5 times the GEMM's 46 us on an H100.)
    s.gemms.push_back(gemm_in_place(p));
    if (p.return_gathered) {
      s.comms.push_back({.kind = CommKind::kCopy,
                         .src = {Buffer::kInput, 0},
                         .dst = {Buffer::kGathered, 0},
                         .rows = p.m});
    } else {
      s.gathered_rows = 0;
    }
    return s;
  }
  const std::int64_t block = rows_per_rank(p);
  s.comms.push_back({.kind = CommKind::kAllGather,
                     .src = {Buffer::kInput, 0},
                     .dst = {Buffer::kGathered, 0},
                     .rows = block});
  s.gemms.push_back({.a = {Buffer::kGathered, 0},
                     .d = {Buffer::kOutput, 0},
                     .rows = p.m,
                     .bias = p.bias,
                     .wait_comm = 0});
  return s;
}

Schedule all_gather_pipelined(const ScheduleParams& p, Schedule s) {
  const std::int64_t block = rows_per_rank(p);
  // The own block goes into the gathered buffer first so that every chunk is one batched GEMM
  // over all ranks' blocks at a fixed stride.
  s.comms.push_back({.kind = CommKind::kCopy,
                     .src = {Buffer::kInput, 0},
                     .dst = {Buffer::kGathered, p.rank * block},
                     .rows = block});
  for (int j = 0; j < p.chunks; ++j) {
    const std::int64_t begin = chunk_begin(block, p.chunks, j);
    const std::int64_t rows = chunk_size(block, p.chunks, j);
    if (p.tp > 1) {
      CommTask exchange{.kind = CommKind::kSendRecv};
      // Start with the next rank so that the ranks' first transfers go to distinct peers.
      for (int step = 1; step < p.tp; ++step) {
        const int peer = wrap(p.rank + step, p.tp);
        const int source = wrap(p.rank - step, p.tp);
        exchange.sends.push_back({peer, {Buffer::kInput, begin}, rows});
        exchange.recvs.push_back({source, {Buffer::kGathered, source * block + begin}, rows});
      }
      s.comms.push_back(std::move(exchange));
    }
    s.gemms.push_back({.a = {Buffer::kGathered, begin},
                       .d = {Buffer::kOutput, begin},
                       .rows = rows,
                       .batch = p.tp,
                       .a_stride = block,
                       .d_stride = block,
                       .bias = p.bias,
                       .wait_comm = static_cast<int>(s.comms.size()) - 1});
  }
  return s;
}

// Ring all-gather: every block travels once around the ring, rank to next rank, while this rank
// multiplies its own block. The received blocks are then multiplied in at most two GEMMs over the
// contiguous row ranges below and above the own block: one GEMM per block would leave a partial
// last wave of thread blocks each time (measured ~25% slower on H200 at M=8192, tp=4), while the
// whole ring pass takes about as long as the own block's GEMM.
Schedule all_gather_ring(const ScheduleParams& p, Schedule s) {
  const std::int64_t block = rows_per_rank(p);
  const int next = wrap(p.rank + 1, p.tp);
  const int prev = wrap(p.rank - 1, p.tp);
  std::vector<int> delivered(p.tp, -1);  // comm task after which each block is complete
  for (int t = 0; t + 1 < p.tp; ++t) {
    // Pass t forwards the block of rank (rank - t) and receives that of rank (rank - t - 1).
    const int owner = wrap(p.rank - t, p.tp);
    const int incoming = wrap(owner - 1, p.tp);
    for (int j = 0; j < p.chunks; ++j) {
      const std::int64_t begin = chunk_begin(block, p.chunks, j);
      const std::int64_t rows = chunk_size(block, p.chunks, j);
      const Rows held =
          t == 0 ? Rows{Buffer::kInput, begin} : Rows{Buffer::kGathered, owner * block + begin};
      CommTask pass{.kind = CommKind::kSendRecv};
      pass.sends.push_back({next, held, rows});
      pass.recvs.push_back({prev, {Buffer::kGathered, incoming * block + begin}, rows});
      s.comms.push_back(std::move(pass));
    }
    delivered[incoming] = static_cast<int>(s.comms.size()) - 1;
  }
  s.gemms.push_back({.a = {Buffer::kInput, 0},
                     .d = {Buffer::kOutput, p.rank * block},
                     .rows = block,
                     .bias = p.bias});
  // Blocks below the own one arrive first (block 0 last among them), then those above.
  const std::pair<int, int> ranges[] = {{0, p.rank}, {p.rank + 1, p.tp}};
  for (const auto& [first, last] : ranges) {
    if (first == last) continue;
    int wait = -1;
    for (int b = first; b < last; ++b) wait = std::max(wait, delivered[b]);
    s.gemms.push_back({.a = {Buffer::kGathered, first * block},
                       .d = {Buffer::kOutput, first * block},
                       .rows = (last - first) * block,
                       .bias = p.bias,
                       .wait_comm = wait});
  }
  if (p.return_gathered) {
    s.comms.push_back({.kind = CommKind::kCopy,
                       .src = {Buffer::kInput, 0},
                       .dst = {Buffer::kGathered, p.rank * block},
                       .rows = block});
  }
  return s;
}

// Only one rank's partial carries the bias, so the reduction adds it once.
bool partial_bias(const ScheduleParams& p) { return p.bias && p.rank == 0; }

Schedule reduce_sequential(const ScheduleParams& p, Schedule s) {
  if (p.tp == 1) {
    // The sum over one rank is its own product (see all_gather_sequential).
    s.gemms.push_back(gemm_in_place(p));
    return s;
  }
  s.gemms.push_back(
      {.a = {Buffer::kInput, 0}, .d = {Buffer::kPartial, 0}, .rows = p.m, .bias = partial_bias(p)});
  const bool scatter = p.op == CollectiveOp::kMatmulReduceScatter;
  s.comms.push_back({.kind = scatter ? CommKind::kReduceScatter : CommKind::kAllReduce,
                     .src = {Buffer::kPartial, 0},
                     .dst = {Buffer::kOutput, 0},
                     .rows = scatter ? rows_per_rank(p) : p.m,
                     .wait_gemm = 0});
  s.partial_rows = p.m;
  return s;
}

Schedule reduce_scatter_pipelined(const ScheduleParams& p, Schedule s) {
  const std::int64_t block = rows_per_rank(p);
  // Chunk j covers rows [begin, begin + rows) of every rank's block; its partials are packed
  // rank-major so that one reduce-scatter delivers each rank its part.
  for (int j = 0; j < p.chunks; ++j) {
    const std::int64_t begin = chunk_begin(block, p.chunks, j);
    const std::int64_t rows = chunk_size(block, p.chunks, j);
    s.gemms.push_back({.a = {Buffer::kInput, begin},
                       .d = {Buffer::kPartial, p.tp * begin},
                       .rows = rows,
                       .batch = p.tp,
                       .a_stride = block,
                       .d_stride = rows,
                       .bias = partial_bias(p)});
    s.comms.push_back({.kind = CommKind::kReduceScatter,
                       .src = {Buffer::kPartial, p.tp * begin},
                       .dst = {Buffer::kOutput, begin},
                       .rows = rows,
                       .wait_gemm = j});
  }
  s.partial_rows = p.m;
  return s;
}

Schedule all_reduce_pipelined(const ScheduleParams& p, Schedule s) {
  for (int j = 0; j < p.chunks; ++j) {
    const std::int64_t begin = chunk_begin(p.m, p.chunks, j);
    const std::int64_t rows = chunk_size(p.m, p.chunks, j);
    s.gemms.push_back({.a = {Buffer::kInput, begin},
                       .d = {Buffer::kPartial, begin},
                       .rows = rows,
                       .bias = partial_bias(p)});
    s.comms.push_back({.kind = CommKind::kAllReduce,
                       .src = {Buffer::kPartial, begin},
                       .dst = {Buffer::kOutput, begin},
                       .rows = rows,
                       .wait_gemm = j});
  }
  s.partial_rows = p.m;
  return s;
}

// Ring reduce-scatter: the partial sum of each block travels once around the ring, each rank
// adding its own product in the GEMM epilogue, and ends at the block's owner. Blocks are split
// into sub-chunks so that a sub-chunk travels while the next one is computed.
Schedule reduce_ring(const ScheduleParams& p, Schedule s) {
  const std::int64_t block = rows_per_rank(p);
  const int next = wrap(p.rank + 1, p.tp);
  const int prev = wrap(p.rank - 1, p.tp);
  const bool all_reduce = p.op == CollectiveOp::kMatmulAllReduce;
  // Partial rows: send slots for steps 0..tp-2, then receive slots for steps 1..tp-1.
  const std::int64_t recv_base = static_cast<std::int64_t>(p.tp - 1) * block;
  std::vector<int> comm_of_chunk(p.chunks, -1);
  std::vector<int> final_gemm(p.chunks, -1);
  for (int t = 0; t < p.tp; ++t) {
    const int target = wrap(p.rank - 1 - t, p.tp);  // block whose sum this step extends
    const bool last = t + 1 == p.tp;
    for (int j = 0; j < p.chunks; ++j) {
      const std::int64_t begin = chunk_begin(block, p.chunks, j);
      const std::int64_t rows = chunk_size(block, p.chunks, j);
      GemmTask gemm{.a = {Buffer::kInput, target * block + begin}, .rows = rows, .bias = false};
      if (last) {
        gemm.d = {Buffer::kOutput, (all_reduce ? p.rank * block : 0) + begin};
        gemm.bias = p.bias;
      } else {
        gemm.d = {Buffer::kPartial, t * block + begin};
      }
      if (t > 0) {
        gemm.has_addend = true;
        gemm.addend = {Buffer::kPartial, recv_base + (t - 1) * block + begin};
        gemm.wait_comm = comm_of_chunk[j];
      }
      s.gemms.push_back(gemm);
      const int gemm_index = static_cast<int>(s.gemms.size()) - 1;
      if (last) {
        final_gemm[j] = gemm_index;
        continue;
      }
      CommTask pass{.kind = CommKind::kSendRecv, .wait_gemm = gemm_index};
      pass.sends.push_back({next, gemm.d, rows});
      pass.recvs.push_back({prev, {Buffer::kPartial, recv_base + t * block + begin}, rows});
      s.comms.push_back(std::move(pass));
      comm_of_chunk[j] = static_cast<int>(s.comms.size()) - 1;
    }
  }
  if (all_reduce && p.tp > 1) {
    // Each finished sub-chunk of the own block goes straight to every other rank.
    for (int j = 0; j < p.chunks; ++j) {
      const std::int64_t begin = chunk_begin(block, p.chunks, j);
      const std::int64_t rows = chunk_size(block, p.chunks, j);
      CommTask spread{.kind = CommKind::kSendRecv, .wait_gemm = final_gemm[j]};
      for (int step = 1; step < p.tp; ++step) {
        const int peer = wrap(p.rank + step, p.tp);
        const int source = wrap(p.rank - step, p.tp);
        spread.sends.push_back({peer, {Buffer::kOutput, p.rank * block + begin}, rows});
        spread.recvs.push_back({source, {Buffer::kOutput, source * block + begin}, rows});
      }
      s.comms.push_back(std::move(spread));
    }
  }
  s.partial_rows = 2 * recv_base;
  return s;
}

// Marks the GEMMs that an SM-using comm task can run beside. Comm tasks up to `before` finish
// before the GEMM starts (its waits and those of earlier GEMMs); those from `after` on start after
// it ends (the first comm task that waits for it or a later GEMM, and all behind it).
void mark_overlapping_gemms(Schedule& s) {
  int before = -1;
  for (std::size_t g = 0; g < s.gemms.size(); ++g) {
    before = std::max(before, s.gemms[g].wait_comm);
    std::size_t after = s.comms.size();
    for (std::size_t c = 0; c < s.comms.size(); ++c) {
      if (s.comms[c].wait_gemm >= static_cast<int>(g)) {
        after = c;
        break;
      }
    }
    for (std::size_t c = static_cast<std::size_t>(before + 1); c < after; ++c) {
      if (s.comms[c].kind != CommKind::kCopy) s.gemms[g].overlaps_comm = true;
    }
  }
}

Schedule with_overlap_marked(Schedule s) {
  mark_overlapping_gemms(s);
  return s;
}

}  // namespace

Algorithm default_algorithm(CollectiveOp, int tp, std::int64_t m) {
  // Measured on 4xH200 (bench/results/collective_matmul_h200x4_2026-11-22.md): with NCCL's
  // kernels sharing the SMs, overlap pays only for large blocks at tp >= 4 (pipelined 1.01-1.05x
  // at M=16384, tp=4); elsewhere every overlapped algorithm was at best even with sequential.
  constexpr std::int64_t kPipelinedRowsPerRank = 4096;
  if (tp >= 4 && m / tp >= kPipelinedRowsPerRank) return Algorithm::kPipelined;
  return Algorithm::kSequential;
}

int default_chunks(CollectiveOp op, Algorithm algorithm, int tp, std::int64_t m) {
  std::int64_t wanted = 1;
  const std::int64_t split_rows = rows_split_into_chunks(op, algorithm, tp, m);
  switch (algorithm) {
    case Algorithm::kAuto:
    case Algorithm::kSequential:
      return 1;
    case Algorithm::kPipelined:
      wanted = 4;
      break;
    case Algorithm::kRing:
      // Reduction rings need two sub-chunks to overlap a transfer with the next product.
      wanted = op == CollectiveOp::kAllGatherMatmul ? 1 : 2;
      break;
  }
  return static_cast<int>(std::max<std::int64_t>(1, std::min(wanted, split_rows)));
}

int default_comm_sms(CollectiveOp, Algorithm algorithm) {
  // Measured on 4xH200 (bench/results): 8 SMs carry NCCL's point-to-point traffic at NVLink
  // speed; more take compute from the GEMM, none leaves NCCL queued behind it.
  return algorithm == Algorithm::kSequential ? 0 : 8;
}

Schedule make_schedule(const ScheduleParams& p) {
  validate(p);
  Schedule s{.params = p};
  const std::int64_t block = rows_per_rank(p);
  // One rank has nothing to move, whatever the algorithm asked (and validated above, as on more
  // ranks): its GEMM alone, sequential's one-rank schedule. Pipelined would copy the rows and
  // make NCCL calls over one rank for nothing.
  const Algorithm algorithm = p.tp == 1 ? Algorithm::kSequential : p.algorithm;
  switch (p.op) {
    case CollectiveOp::kAllGatherMatmul:
      s.input_rows = block;
      s.output_rows = p.m;
      s.gathered_rows = p.m;
      switch (algorithm) {
        case Algorithm::kSequential:
          return with_overlap_marked(all_gather_sequential(p, std::move(s)));
        case Algorithm::kPipelined:
          return with_overlap_marked(all_gather_pipelined(p, std::move(s)));
        default:
          return with_overlap_marked(all_gather_ring(p, std::move(s)));
      }
    case CollectiveOp::kMatmulReduceScatter:
      s.input_rows = p.m;
      s.output_rows = block;
      switch (algorithm) {
        case Algorithm::kSequential:
          return with_overlap_marked(reduce_sequential(p, std::move(s)));
        case Algorithm::kPipelined:
          return with_overlap_marked(reduce_scatter_pipelined(p, std::move(s)));
        default:
          return with_overlap_marked(reduce_ring(p, std::move(s)));
      }
    case CollectiveOp::kMatmulAllReduce:
      s.input_rows = p.m;
      s.output_rows = p.m;
      switch (algorithm) {
        case Algorithm::kSequential:
          return with_overlap_marked(reduce_sequential(p, std::move(s)));
        case Algorithm::kPipelined:
          return with_overlap_marked(all_reduce_pipelined(p, std::move(s)));
        default:
          return with_overlap_marked(reduce_ring(p, std::move(s)));
      }
  }
  MESHLA_THROW(kInternal, "make_schedule: unknown op");
}

}  // namespace meshla::collective
