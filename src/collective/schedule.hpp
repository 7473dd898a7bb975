// Schedule: the pure host-side order of GEMMs and transfers of one collective matmul on one rank.
//
// An executor replays it on two streams: GEMMs in order on the compute stream (the caller's),
// communication tasks in order on the communication stream, each task optionally waiting for one
// task of the other stream. Every buffer region is written at most once per execution, so the
// only hazards are read-after-write ones and the explicit waits cover them. Unit tests simulate
// all ranks of a schedule on the CPU to prove this, with no GPU.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "meshla/collective_matmul.hpp"

namespace meshla::collective {

// Row-major buffers an executor binds. Row widths: kInput and kGathered hold rows of a (width k);
// kPartial and kOutput hold rows of the product (width n).
enum class Buffer { kInput, kGathered, kPartial, kOutput };

std::string_view buffer_name(Buffer buffer);

struct Rows {
  Buffer buffer = Buffer::kInput;
  std::int64_t begin = 0;  // first row
};

// batch products: rows of a at a.begin + i * a_stride -> rows of d at d.begin + i * d_stride.
struct GemmTask {
  Rows a;
  Rows d;
  std::int64_t rows = 0;
  int batch = 1;
  std::int64_t a_stride = 0;
  std::int64_t d_stride = 0;
  bool bias = false;
  bool has_addend = false;  // d = product + addend rows (same count, packed, batch 1)
  Rows addend;
  int wait_comm = -1;  // index of the comm task that must finish first, or -1
  // Whether a communication kernel (one that needs SMs: not a copy) can run while this GEMM
  // does. Only such GEMMs leave SMs free for it: capping a GEMM that runs alone costs up to 10%
  // (bench/results/overlap_probe_h100_2026-11-22.txt).
  bool overlaps_comm = false;
};

enum class CommKind {
  kCopy,           // local copy src -> dst of `rows` rows
  kSendRecv,       // grouped point-to-point sends and receives
  kAllGather,      // every rank's `rows` rows at src -> dst block of each rank, in rank order
  kReduceScatter,  // tp * rows rows at src, summed over ranks; this rank's block -> dst
  kAllReduce,      // rows at src, summed over ranks -> dst
};

std::string_view comm_kind_name(CommKind kind);

struct Transfer {
  int peer = 0;
  Rows at;
  std::int64_t rows = 0;
};

struct CommTask {
  CommKind kind = CommKind::kCopy;
  Rows src;
  Rows dst;
  std::int64_t rows = 0;
  std::vector<Transfer> sends;  // kSendRecv only
  std::vector<Transfer> recvs;
  int wait_gemm = -1;  // index of the GEMM task that must finish first, or -1
};

struct ScheduleParams {
  CollectiveOp op = CollectiveOp::kAllGatherMatmul;
  Algorithm algorithm = Algorithm::kSequential;  // resolved, never kAuto
  int tp = 1;
  int rank = 0;
  std::int64_t m = 0;  // rows of the full product
  int chunks = 1;
  bool bias = false;
  bool return_gathered = false;
};

struct Schedule {
  ScheduleParams params;
  std::vector<GemmTask> gemms;
  std::vector<CommTask> comms;
  std::int64_t gathered_rows = 0;  // rows the executor must provide for each buffer
  std::int64_t partial_rows = 0;
  std::int64_t input_rows = 0;
  std::int64_t output_rows = 0;
};

// Rows this rank holds of a (all_gather_matmul) or of the output (reduce-scatter).
std::int64_t rows_per_rank(const ScheduleParams& params);

// Bounds of chunk `index` of `count` chunks over `rows` rows; sizes differ by at most one.
std::int64_t chunk_begin(std::int64_t rows, int count, int index);

// Checks the params (throws kInvalidArgument / kNotImplemented naming the shapes) and builds the
// schedule.
Schedule make_schedule(const ScheduleParams& params);

// The algorithm and chunk count used when the caller leaves them to meshla.
Algorithm default_algorithm(CollectiveOp op, int tp, std::int64_t m);
int default_chunks(CollectiveOp op, Algorithm algorithm, int tp, std::int64_t m);
int default_comm_sms(CollectiveOp op, Algorithm algorithm);

}  // namespace meshla::collective
