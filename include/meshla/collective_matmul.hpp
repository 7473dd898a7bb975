// Collective matmul for tensor parallelism: the communication of a tensor-parallel linear layer
// fused with its GEMM so that one hides behind the other.
//
//   all_gather_matmul      a [m/tp, k] on each rank, b [k, n] -> out [m, n] = all_gather(a) @ b
//   matmul_reduce_scatter  a [m, k] (k: local slice), b [k, n] -> out [m/tp, n], this rank's rows
//                                                                 of the sum over ranks
//   matmul_all_reduce      the same product                    -> out [m, n], the whole sum
//
// fp8 (float8_e4m3fn or float8_e5m2 a and b, not both e5m2; b stored [n, k]) is scaled as
// Matmul's (meshla/matmul.hpp): float32 scales on the device, one each (tensorwise) or one per row
// of a and per column of the product (rowwise; all_gather_matmul's tensorwise a_scale is the
// whole gathered a's, the same on every rank); the product, the bias and every partial sum are
// in out_dtype (bfloat16, float16 or float32), so reductions never add fp8, while all_gather_matmul
// moves a's fp8 bytes (and its rows' scales). On backends nccl and symmetric.
// A CollectiveMatmul is a plan: built once per shape (collectively, by every rank of the group),
// it owns the side stream and the events. Its buffers (staging, peer memory) and cuBLASLt
// workspace are its group's, shared by the group's nccl and symmetric plans, sized by the largest
// of them, grown when a plan needs more and kept while the communicator lives; so those plans'
// executions run one at a time, in call order (cublasmp plans own theirs). A CUDA graph that
// captured runs of a group's plans uses that same memory when it replays: order its replays with
// the group's other work (eager runs, other graphs), as for any captured buffer; one stream does.
// execute() only enqueues work on the caller's stream and forks/joins its side stream there, so it
// can be captured in a CUDA graph; the graph then holds the plan (its state, memory and
// communicator) until the graph and the executable graphs made from it are destroyed, and lets go
// of it on a thread of its own. Except a cublasmp plan, whose NVSHMEM memory is freed collectively,
// in the order the ranks let go of their plans: a graph must not outlive it.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>

#include <cuda_runtime_api.h>

#include "meshla/communicator.hpp"
#include "meshla/export.hpp"
#include "meshla/matmul.hpp"
#include "meshla/tensor.hpp"

namespace meshla {

enum class CollectiveOp { kAllGatherMatmul, kMatmulReduceScatter, kMatmulAllReduce };

// Who moves the data.
enum class Backend {
  kAuto,       // kSymmetric when every pair of the group's GPUs is linked by NVLink (NVML's
               // answer) and the algorithm and shape allow it, kNccl otherwise
  kNccl,       // NCCL collectives and point-to-point: any topology, crosses nodes
  kSymmetric,  // buffers mapped into every rank of the group; copy engines move the blocks and
               // stream memory operations signal their arrival, so no SM works on communication
  kCublasMp,   // NVIDIA cuBLASMp's own AG+GEMM, GEMM+RS and GEMM+AR on the group's NCCL
               // communicator; optional (backend_unavailable_reason), one process per GPU, never
               // chosen by kAuto. Its all-reduce runs unoverlapped (kSequential): cuBLASMp 0.7
               // overlaps that one only with NVLink multicast, which meshla never uses.
};

enum class Algorithm {
  kAuto,        // the fastest supported algorithm for the shape and group
  kSequential,  // the collective, then one GEMM (or the GEMM, then the collective)
  kPipelined,   // rows split into chunks; chunk i's collective overlaps chunk i+1's GEMM
  kRing,        // blocks of a (all-gather) or partial sums (reduce) travel between ranks while
                // the GEMM works on what is there: a ncclSend/ncclRecv ring on kNccl; on
                // kSymmetric each block goes straight to every peer, in ring order
};

MESHLA_API std::string_view collective_op_name(CollectiveOp op);
MESHLA_API std::string_view algorithm_name(Algorithm algorithm);
MESHLA_API std::string_view backend_name(Backend backend);

// Why `backend` cannot run in this process, or "" when it can. kCublasMp needs a build with
// MESHLA_WITH_CUBLASMP and the cuBLASMp library (with its NVSHMEM and the GPU driver) at run time;
// the other backends are always there.
MESHLA_API std::string backend_unavailable_reason(Backend backend);

struct CollectiveMatmulConfig {
  CollectiveOp op = CollectiveOp::kAllGatherMatmul;
  Algorithm algorithm = Algorithm::kAuto;
  Backend backend = Backend::kAuto;
  DType dtype = DType::kBFloat16;  // a's
  // fp8 only: b's dtype where it differs from a's (e4m3 with e5m2), and the product's (out, bias,
  // partial sums: product_dtype(); bfloat16 unless the request names one). Unset: dtype.
  std::optional<DType> b_dtype;
  std::optional<DType> out_dtype;
  MatmulScaling scaling = MatmulScaling::kNone;  // fp8: how a and b are scaled back
  std::int64_t m = 0;    // rows of the full product, summed over ranks for all_gather_matmul
  std::int64_t n = 0;    // columns of the output
  std::int64_t k = 0;    // the contraction this rank computes (the local slice for RS and AR)
  bool trans_b = false;  // b is stored [n, k], as a torch.nn.Linear weight
  bool bias = false;     // a length-n bias is added once to the result
  bool return_gathered = false;  // all_gather_matmul also writes all_gather(a) to the caller
  // Pipeline depth; 0 picks the default of the algorithm. On kSymmetric: the rounds a
  // reduce-scatter or all-reduce is split into (each rank's rows in `chunks` equal parts);
  // all_gather_matmul moves each rank's block whole.
  int chunks = 0;
  // SMs kept free of GEMM work while it overlaps communication, so that NCCL's kernels start at
  // once instead of queueing behind the GEMM's thread blocks. -1 picks the algorithm's default;
  // sequential never overlaps and uses every SM, and so does kSymmetric, whose transfers take none.
  int comm_sms = -1;
  // Thread blocks NCCL may use for this plan's transfers (0: NCCL's own choice). Set, the plan
  // runs them on its own communicator split off with ncclConfig_t.maxCTAs, so that NCCL's
  // kernels fit in the comm_sms SMs the GEMM leaves free instead of queueing behind it. kNccl only.
  int comm_ctas = 0;
};

// Arguments of one execute(); views left empty (data == nullptr) are absent.
struct CollectiveMatmulArgs {
  TensorView a;
  TensorView b;
  TensorView bias;
  TensorView out;
  TensorView gathered;  // all_gather_matmul with return_gathered: [m, k]
  TensorView a_scale;   // fp8, float32: [1] (tensorwise) or one per row of this rank's a
  TensorView b_scale;   // fp8, float32: [1] (tensorwise) or [n]
};

// One call of a collective matmul checked before anything runs, on its arrays' metadata alone
// (shapes, dtypes, devices; data is neither read nor needed, so a framework can check abstract
// arrays too): the rules that the CUDA plans, the CPU references and every front end share, in the
// same words. `request` gives the op, trans_b, return_gathered, the tuning (algorithm, backend,
// chunks, comm_sms, comm_ctas) and an fp8 call's out_dtype; `tp` is the group's size and `device`
// its GPU (-1: a group of CPU tensors, whose arrays are on the host). args.out and args.gathered
// may be absent (the caller makes them at product_shape() and [m, k]); where given they are checked
// too, and where the views carry data, no output may share memory with an input or the other
// output. Returns `request` with dtype, b_dtype, out_dtype, scaling, m, n, k and bias filled in:
// the config a plan for the call is built with (out_dtype is dtype's but for fp8). Throws
// kInvalidArgument or kNotImplemented, naming the argument and the shapes.
MESHLA_API CollectiveMatmulConfig describe_call(const CollectiveMatmulConfig& request,
                                                const CollectiveMatmulArgs& args, int tp,
                                                int device);

// [rows, cols] of a call's product on each rank: [m/tp, n] for matmul_reduce_scatter, else [m, n].
MESHLA_API std::array<std::int64_t, 2> product_shape(const CollectiveMatmulConfig& config, int tp);

// The dtype of a call's product, bias and partial sums: out_dtype, or dtype where it is unset.
MESHLA_API DType product_dtype(const CollectiveMatmulConfig& config);

class MESHLA_API CollectiveMatmul {
 public:
  // Collective: every rank of `comm` builds the plan with the same config. Throws kInvalidArgument
  // (shapes, chunk counts) or kNotImplemented (an algorithm the shape cannot use).
  CollectiveMatmul(Communicator comm, const CollectiveMatmulConfig& config);
  ~CollectiveMatmul();
  CollectiveMatmul(CollectiveMatmul&&) noexcept;
  CollectiveMatmul& operator=(CollectiveMatmul&&) noexcept;
  CollectiveMatmul(const CollectiveMatmul&) = delete;
  CollectiveMatmul& operator=(const CollectiveMatmul&) = delete;

  // Enqueues the op on `stream`. Every rank must call it, in the same order as its other
  // collective work on this communicator.
  void execute(const CollectiveMatmulArgs& args, cudaStream_t stream);

  const CollectiveMatmulConfig& config() const;  // with backend, algorithm and chunks resolved
  const Communicator& communicator() const;

 private:
  struct Impl;
  std::shared_ptr<Impl> impl_;
};

// all_gather: each rank's rows [rows, cols] -> gathered [tp * rows, cols], rank r's at r * rows.
// NCCL's all-gather on the group's communicator, in the order of the group's nccl and symmetric
// plans' executions (their shared workspace's) and watched like them; what a backward needs to
// gather rows again (all_gather_matmul's weight gradient without keeping the gathered a).
struct AllGatherConfig {
  DType dtype = DType::kBFloat16;
  std::int64_t rows = 0;  // this rank's
  std::int64_t cols = 0;
};

class MESHLA_API AllGather {
 public:
  // Not collective; execute() is.
  AllGather(Communicator comm, const AllGatherConfig& config);
  ~AllGather();
  AllGather(AllGather&&) noexcept;
  AllGather& operator=(AllGather&&) noexcept;
  AllGather(const AllGather&) = delete;
  AllGather& operator=(const AllGather&) = delete;

  // Enqueues the all-gather on `stream`. Every rank must call it, in the same order as its other
  // collective work on this communicator. A CUDA graph capturing it holds the plan, as for
  // CollectiveMatmul.
  void execute(const TensorView& rows, const TensorView& gathered, cudaStream_t stream);

  const AllGatherConfig& config() const;

 private:
  struct Impl;
  std::shared_ptr<Impl> impl_;
};

// The plans of one group, by config: what a front end keeps per group, so that each shape is
// planned once and the group's ranks build their plans in the same order (a plan is built
// collectively). The cache is keyed by every field of the config (describe_call's, as given: two
// configs that resolve to the same plan are still two plans). Plans are kept until clear() or the
// cache goes; a CUDA graph that captured a plan's runs keeps that plan beyond both.
class MESHLA_API CollectivePlans {
 public:
  explicit CollectivePlans(Communicator comm);
  ~CollectivePlans();
  CollectivePlans(CollectivePlans&&) noexcept;
  CollectivePlans& operator=(CollectivePlans&&) noexcept;
  CollectivePlans(const CollectivePlans&) = delete;
  CollectivePlans& operator=(const CollectivePlans&) = delete;

  // The group's plan for `config`, built on first use (collectively: every rank asks for the same
  // configs in the same order). The reference stays valid until clear() or the cache goes.
  CollectiveMatmul& matmul(const CollectiveMatmulConfig& config);
  AllGather& all_gather(const AllGatherConfig& config);

  // Lets go of every plan; each waits for its last execution (see ~CollectiveMatmul).
  void clear();
  std::size_t size() const;
  const Communicator& communicator() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace meshla
