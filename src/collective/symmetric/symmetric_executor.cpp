// The symmetric backend of collective matmul: every rank's buffers are mapped into its peers,
// copy engines move the blocks (cudaMemcpyAsync into peer memory) and stream memory operations
// tell the receiver that a block has landed, so no SM works on communication while the GEMMs
// run. The order of the work is collective/symmetric/peer_plan.hpp's. A float8 product moves a's
// bytes (rowwise: with its rows' scales, pushed ahead of them) and sums partial products in its
// output dtype.
//
// Memory. Every symmetric plan of a group uses the group's GroupWorkspace, laid out per plan as
// symmetric_workspace_sizes says; the workspace runs one execution at a time, of whichever plan.
//
// Flags. Each rank's workspace starts with 32-bit flags that its peers set and it clears:
//   free[q]            rank q may push into this rank's buffers: set by q at the start of each
//                      execution (its previous one has read them), cleared by the pusher before
//                      its first push
//   arrived[round][q]  q's block (or partial product) for `round` has landed here
//   reduced[round][q]  q's summed sub-block of `round` has landed here (all-reduce)
// A flag goes 0 -> 1 -> 0 once per execution, and its next set always follows its clearing in
// stream order, so repeated executions and CUDA-graph replays never see a stale value, and the
// next execution, of this plan or another, finds every flag zero.
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <optional>
#include <string_view>
#include <vector>

#include "collective/executor.hpp"
#include "collective/group_workspace.hpp"
#include "collective/symmetric/peer_plan.hpp"
#include "collective/symmetric/sm90_gathered_gemm.hpp"
#include "collective/symmetric/sum_slots.hpp"
#include "comm/stream_flags.hpp"
#include "core/cuda_checks.hpp"
#include "meshla/matmul.hpp"

namespace meshla::collective {
namespace {

enum class Flag { kFree, kArrived, kReduced };

// all_gather_matmul's GEMM operands: this rank's block, the slots the peers' blocks land in (slot
// q at rank q's rows), b, the bias (or nullptr) and the product; float8: a's scale (tensorwise,
// or the own block's rows'), the slots' rows' scales (rowwise) and b's.
struct GatherOperands {
  const char* own;
  const char* slots;
  const void* b;
  const void* bias;
  char* out;
  const float* own_scale;
  const float* slot_scales;
  const float* b_scale;
};

// all_gather_matmul's batches of received blocks (arrival_batches), or one block per GEMM with
// rowwise scales: Matmul's rowwise kernel runs a batch of 1.
std::vector<std::vector<int>> gather_batches(const CollectiveMatmulConfig& config, int tp,
                                             int rank) {
  if (config.op != CollectiveOp::kAllGatherMatmul) return {};
  if (config.scaling != MatmulScaling::kRowwise) return arrival_batches(tp, rank);
  std::vector<std::vector<int>> singles;
  for (int source : arrival_order(tp, rank)) singles.push_back({source});
  return singles;
}

class SymmetricExecutor final : public Executor {
 public:
  SymmetricExecutor(const Communicator& comm, const CollectiveMatmulConfig& config,
                    std::shared_ptr<collective::GroupWorkspace> workspace)
      : Executor(workspace_order(workspace)),
        config_(config),
        tp_(comm.size()),
        rank_(comm.rank()),
        rounds_(config.op == CollectiveOp::kAllGatherMatmul ? 1 : config.chunks),
        product_dtype_(product_dtype(config)),
        a_element_(static_cast<std::int64_t>(dtype_size(config.dtype))),
        out_element_(static_cast<std::int64_t>(dtype_size(product_dtype_))),
        rowwise_(config.scaling == MatmulScaling::kRowwise),
        peers_(ring_peers(tp_, rank_)),
        batches_(gather_batches(config, tp_, rank_)),
        arrivals_(arrival_order(tp_, rank_)),
        trap_after_(2 * comm.timeout()),
        push_(comm.device(), 1, /*high_priority=*/true),
        collect_(comm.device(), 1, /*high_priority=*/true),
        workspace_(std::move(workspace)) {
    const int device = comm.device();
    gemm_sms_ = overlapped_gemm_sms(config, device);
    if (config.op != CollectiveOp::kAllGatherMatmul) {
      sub_rows_ = config.m / tp_ / rounds_;
      results_offset_ = config.m * config.n * out_element_;  // all-reduce: after the inbox
    }
    for (std::size_t i = 0; i < peers_.size() * static_cast<std::size_t>(rounds_); ++i) {
      product_ready_.emplace_back(device);
    }
    for (int round = 0; round < rounds_; ++round) reduced_ready_.emplace_back(device);
    for (std::size_t i = 0; i < batches_.size(); ++i) arrived_.emplace_back(device);
    prepare_gemms();
    if (config.op == CollectiveOp::kAllGatherMatmul) choose_gather_form();
    if (config.op != CollectiveOp::kAllGatherMatmul) {
      load_sum_slots(product_dtype_);
      sum_targets_.reserve(static_cast<std::size_t>(tp_));  // no allocation per call
    }
    // Last: a growth's exchange is the ranks' final meeting before their first execution, and
    // nothing after it may free device memory (see PeerBuffer).
    workspace_->reserve(*comm.state(), symmetric_workspace_sizes(config, tp_));
  }

  void enqueue(const CollectiveMatmulArgs& args, cudaStream_t stream) override {
    // This rank's buffers are free again: its previous execution, which read them, is behind us
    // on this stream.
    for (int peer : peers_) detail::write_flag(stream, flag(peer, Flag::kFree, 0, rank_), 1);
    push_.fork(stream);
    collect_.fork(stream);
    try {
      if (config_.op == CollectiveOp::kAllGatherMatmul) {
        all_gather_matmul(args, stream);
      } else {
        reduce_matmul(args, stream);
      }
    } catch (...) {
      push_.join_after_failure(stream);
      collect_.join_after_failure(stream);
      throw;
    }
    push_.join(stream);
    collect_.join(stream);
  }

 private:
  std::uint32_t* flag(int owner, Flag kind, int round, int source) const {
    std::int64_t index = source;
    if (kind == Flag::kArrived) index += tp_ * (1 + round);
    if (kind == Flag::kReduced) index += tp_ * (1 + rounds_ + round);
    return reinterpret_cast<std::uint32_t*>(workspace_->signals(owner) + index * 4);
  }

  // Waits on `stream` until the flag is set, then clears it for the next execution.
  static void consume(cudaStream_t stream, std::uint32_t* flag) {
    detail::wait_flag(stream, flag, 1);
    detail::write_flag(stream, flag, 0);
  }

  // Copies `bytes` into peer memory on `stream` and then sets the peer's flag.
  static void push(cudaStream_t stream, void* to, const void* from, std::int64_t bytes,
                   std::uint32_t* landed) {
    MESHLA_CHECK_CUDA(cudaMemcpyAsync(to, from, static_cast<std::size_t>(bytes),
                                      cudaMemcpyDeviceToDevice, stream));
    detail::write_flag(stream, landed, 1);
  }

  // `batch` products of `rows` rows each, their a and d rows `batch_rows` apart.
  MatmulShape shape(std::int64_t rows, bool bias, int batch = 1,
                    std::int64_t batch_rows = 0) const {
    return {.dtype = config_.dtype,
            .b_dtype = config_.b_dtype,
            .out_dtype = config_.out_dtype,
            .scaling = config_.scaling,
            .m = rows,
            .n = config_.n,
            .k = config_.k,
            .trans_b = config_.trans_b,
            .batch = batch,
            .lda = config_.k,
            .ldd = config_.n,
            .batch_stride_a = batch_rows * config_.k,
            .batch_stride_d = batch_rows * config_.n,
            .bias = bias,
            .sm_count = gemm_sms_};
  }

  // all_gather_matmul: the GEMM over one of arrival_batches' batches of received blocks.
  MatmulShape batch_shape(const std::vector<int>& sources) const {
    const std::int64_t block = config_.m / tp_;
    const int count = static_cast<int>(sources.size());
    return shape(block, config_.bias, count, count > 1 ? (sources[1] - sources[0]) * block : 0);
  }

  void prepare_gemms() {
    const std::int64_t block = config_.m / tp_;
    if (config_.op == CollectiveOp::kAllGatherMatmul) {
      workspace_->matmul().prepare(shape(block, config_.bias));
      for (const std::vector<int>& batch : batches_) {
        workspace_->matmul().prepare(batch_shape(batch));
      }
    } else {
      workspace_->matmul().prepare(shape(sub_rows_, /*bias=*/false));
      if (config_.bias) workspace_->matmul().prepare(shape(sub_rows_, /*bias=*/true));
    }
  }

  // a_scale and b_scale: float8 only (nullptr otherwise).
  void gemm(const MatmulShape& shape, const char* a, const float* a_scale, const void* b,
            const float* b_scale, const void* bias, void* d, cudaStream_t stream) {
    workspace_->matmul().run(shape,
                             {.a = a,
                              .b = b,
                              .bias = shape.bias ? bias : nullptr,
                              .d = d,
                              .a_scale = a_scale,
                              .b_scale = b_scale},
                             stream);
  }

  // all_gather_matmul's GEMM in one of two forms (choose_gather_form):
  // - per batch: the own block's GEMM, then one per arrival_batches' batch, each on the stream
  //   after its blocks' flags (cuBLASLt, tuned per shape);
  // - one launch (GatheredGemm): every block's tiles in one persistent kernel, own block first,
  //   then in arrival order, each tile waiting on the device for its block's flag.
  // Each GEMM per batch ends in a partly idle wave, the one launch only once; but the one launch's
  // CUTLASS kernel is up to 3-5% slower than cuBLAS on the same tiles (bench/NOTES.md 37 and 45).
  void gather_gemms(const GatherOperands& ops, char* gathered, cudaStream_t stream) {
    const std::int64_t block = config_.m / tp_;
    const std::int64_t block_bytes = block * config_.k * a_element_;
    const std::int64_t out_block_bytes = block * config_.n * out_element_;
    if (gathered_gemm_ && aligned_for_tma(ops)) {
      GatheredBlock blocks[kMaxGatheredBlocks];
      blocks[0] = {.a = ops.own, .d = ops.out + rank_ * out_block_bytes, .landed = nullptr};
      for (std::size_t i = 0; i < arrivals_.size(); ++i) {
        const int source = arrivals_[i];
        std::uint32_t* landed = flag(rank_, Flag::kArrived, 0, source);
        blocks[i + 1] = {.a = ops.slots + source * block_bytes,
                         .d = ops.out + source * out_block_bytes,
                         .landed = landed};
        if (gathered == nullptr) continue;
        detail::wait_flag(collect_[0], landed, 1);
        MESHLA_CHECK_CUDA(cudaMemcpyAsync(gathered + source * block_bytes,
                                          ops.slots + source * block_bytes, block_bytes,
                                          cudaMemcpyDeviceToDevice, collect_[0]));
      }
      gathered_gemm_->run(blocks, ops.b, ops.bias, trap_after_, stream);
      // Cleared after the kernel and after the copies into `gathered`, which wait for them too.
      if (gathered != nullptr) collect_.join(stream);
      for (int source : arrivals_) {
        detail::write_flag(stream, flag(rank_, Flag::kArrived, 0, source), 0);
      }
      return;
    }
    gemm(shape(block, config_.bias), ops.own, ops.own_scale, ops.b, ops.b_scale, ops.bias,
         ops.out + rank_ * out_block_bytes, stream);
    for (std::size_t i = 0; i < batches_.size(); ++i) {
      const std::vector<int>& sources = batches_[i];
      for (int source : sources) consume(stream, flag(rank_, Flag::kArrived, 0, source));
      const float* a_scale = rowwise_ ? ops.slot_scales + sources[0] * block : ops.own_scale;
      gemm(batch_shape(sources), ops.slots + sources[0] * block_bytes, a_scale, ops.b, ops.b_scale,
           ops.bias, ops.out + sources[0] * out_block_bytes, stream);
      if (gathered == nullptr) continue;
      MESHLA_CHECK_CUDA(cudaEventRecord(arrived_[i].get(), stream));
      MESHLA_CHECK_CUDA(cudaStreamWaitEvent(collect_[0], arrived_[i].get(), 0));
      for (int source : sources) {
        MESHLA_CHECK_CUDA(cudaMemcpyAsync(gathered + source * block_bytes,
                                          ops.slots + source * block_bytes, block_bytes,
                                          cudaMemcpyDeviceToDevice, collect_[0]));
      }
    }
  }

  // TMA reads and writes 16-byte aligned rows from 16-byte aligned starts (n and k are multiples
  // of 8 where GatheredGemm runs); a caller's view at another offset takes the GEMMs per batch.
  static bool aligned_for_tma(const GatherOperands& ops) {
    const auto aligned = [](const void* p) {
      return reinterpret_cast<std::uintptr_t>(p) % 16 == 0;
    };
    return aligned(ops.own) && aligned(ops.b) && aligned(ops.out) &&
           (ops.bias == nullptr || aligned(ops.bias));
  }

  // Takes the one launch where it pays (gathered_gemm_pays). Each rank chooses for itself; both
  // forms read the same slots and flags.
  void choose_gather_form() {
    GatheredGemmShape one_launch{.dtype = config_.dtype,
                                 .blocks = tp_,
                                 .block_rows = config_.m / tp_,
                                 .n = config_.n,
                                 .k = config_.k,
                                 .trans_b = config_.trans_b,
                                 .device = workspace_->matmul().device(),
                                 .sm_count = gemm_sms_};
    if (one_launch.sm_count == 0) {
      MESHLA_CHECK_CUDA(cudaDeviceGetAttribute(&one_launch.sm_count, cudaDevAttrMultiProcessorCount,
                                               one_launch.device));
    }
    // MESHLA_GATHER_GEMM=per_batch or one_launch overrides the rule (where the one launch can
    // run): for tests of each form, and for benchmarks that compare them.
    const char* forced = std::getenv("MESHLA_GATHER_GEMM");
    const std::string_view form = forced == nullptr ? "" : forced;
    MESHLA_CHECK_ARG(form.empty() || form == "per_batch" || form == "one_launch",
                     "MESHLA_GATHER_GEMM=" << form << " is neither per_batch nor one_launch");
    if (form == "per_batch" || !gathered_gemm_unsupported(one_launch).empty()) return;
    if (form == "one_launch" || gathered_gemm_pays(one_launch)) {
      gathered_gemm_.emplace(one_launch);
    }
  }

  // Where the rows' scales of rowwise float8 blocks land in `owner`'s workspace (slot q at rank
  // q's rows).
  float* slot_scales(int owner) const {
    return reinterpret_cast<float*>(workspace_->data(owner) + gathered_scales_offset(config_));
  }

  void all_gather_matmul(const CollectiveMatmulArgs& args, cudaStream_t stream) {
    const std::int64_t block = config_.m / tp_;
    const std::int64_t block_bytes = block * config_.k * a_element_;
    const char* own = static_cast<const char*>(args.a.data);
    const auto* own_scale = static_cast<const float*>(args.a_scale.data);
    char* gathered = static_cast<char*>(args.gathered.data);
    for (int peer : peers_) {
      consume(push_[0], flag(rank_, Flag::kFree, 0, peer));
      // The scales go first on the same stream, so the block's arrival flag covers them too.
      if (rowwise_) {
        MESHLA_CHECK_CUDA(cudaMemcpyAsync(slot_scales(peer) + rank_ * block, own_scale,
                                          sizeof(float) * static_cast<std::size_t>(block),
                                          cudaMemcpyDeviceToDevice, push_[0]));
      }
      push(push_[0], workspace_->data(peer) + rank_ * block_bytes, own, block_bytes,
           flag(peer, Flag::kArrived, 0, rank_));
    }
    if (gathered != nullptr) {
      MESHLA_CHECK_CUDA(cudaMemcpyAsync(gathered + rank_ * block_bytes, own, block_bytes,
                                        cudaMemcpyDeviceToDevice, collect_[0]));
    }
    gather_gemms({.own = own,
                  .slots = workspace_->data(rank_),
                  .b = args.b.data,
                  .bias = config_.bias ? args.bias.data : nullptr,
                  .out = static_cast<char*>(args.out.data),
                  .own_scale = own_scale,
                  .slot_scales = rowwise_ ? slot_scales(rank_) : nullptr,
                  .b_scale = static_cast<const float*>(args.b_scale.data)},
                 gathered, stream);
  }

  void reduce_matmul(const CollectiveMatmulArgs& args, cudaStream_t stream) {
    const std::int64_t sub_count = sub_rows_ * config_.n;
    const std::int64_t sub_bytes = sub_count * out_element_;
    const std::int64_t row_bytes = config_.n * out_element_;
    const bool all_reduce = config_.op == CollectiveOp::kMatmulAllReduce;
    const char* a = static_cast<const char*>(args.a.data);
    const auto* b_scale = static_cast<const float*>(args.b_scale.data);
    char* out = static_cast<char*>(args.out.data);
    // a's rows from `row` on, and their scale (float8: one, or theirs when rowwise).
    const auto a_rows = [&](std::int64_t row) { return a + row * config_.k * a_element_; };
    const auto a_scale = [&](std::int64_t row) {
      const auto* scales = static_cast<const float*>(args.a_scale.data);
      return rowwise_ ? scales + row : scales;
    };
    const auto inbox = [&](int owner, int round, int source) {
      return workspace_->data(owner) + (round * tp_ + source) * sub_bytes;
    };
    const auto row_of = [&](int owner, int round) {
      return sub_block_begin(config_.m, tp_, rounds_, owner, round);
    };
    for (int round = 0; round < rounds_; ++round) {
      for (std::size_t j = 0; j < peers_.size(); ++j) {
        const int peer = peers_[j];
        char* product = workspace_->scratch() + (round * tp_ + peer) * sub_bytes;
        const std::int64_t row = row_of(peer, round);
        gemm(shape(sub_rows_, /*bias=*/false), a_rows(row), a_scale(row), args.b.data, b_scale,
             nullptr, product, stream);
        cudaEvent_t ready = product_ready_[round * peers_.size() + j].get();
        MESHLA_CHECK_CUDA(cudaEventRecord(ready, stream));
        MESHLA_CHECK_CUDA(cudaStreamWaitEvent(push_[0], ready, 0));
        if (round == 0) consume(push_[0], flag(rank_, Flag::kFree, 0, peer));
        push(push_[0], inbox(peer, round, rank_), product, sub_bytes,
             flag(peer, Flag::kArrived, round, rank_));
      }
      const std::int64_t own_row = row_of(rank_, round);
      gemm(shape(sub_rows_, config_.bias), a_rows(own_row), a_scale(own_row), args.b.data, b_scale,
           args.bias.data, inbox(rank_, round, rank_), stream);
      for (int peer : peers_) consume(stream, flag(rank_, Flag::kArrived, round, peer));
      // A reduce-scatter's output holds only this rank's rows; an all-reduce's holds all.
      char* summed = out + (all_reduce ? row_of(rank_, round) : round * sub_rows_) * row_bytes;
      sum_targets_.assign(1, summed);
      const auto result_in = [&](int peer) {
        return workspace_->data(peer) + results_offset_ + row_of(rank_, round) * row_bytes;
      };
      // An all-reduce's last round: the GEMMs are done, so the SMs are free, and the sum stores
      // itself into every peer at once over NVLink, where the copy engine would push it to one
      // peer after another (measured, M=8192 tp=4: 1.64 against 1.70 ms per call). Safe to
      // write: every peer's product of this round has arrived, so each peer has started this
      // execution and has finished reading its results of the last.
      const bool sum_into_peers = all_reduce && round == rounds_ - 1;
      if (sum_into_peers) {
        for (int peer : peers_) sum_targets_.push_back(result_in(peer));
      }
      sum_slots(product_dtype_, inbox(rank_, round, 0), sub_count, tp_, sub_count,
                sum_targets_.data(), static_cast<int>(sum_targets_.size()), stream);
      if (!all_reduce) continue;
      if (sum_into_peers) {
        // The flag's write follows the kernel's stores on this stream, with a memory barrier.
        for (int peer : peers_) {
          detail::write_flag(stream, flag(peer, Flag::kReduced, round, rank_), 1);
        }
      } else {
        MESHLA_CHECK_CUDA(cudaEventRecord(reduced_ready_[round].get(), stream));
        MESHLA_CHECK_CUDA(cudaStreamWaitEvent(push_[0], reduced_ready_[round].get(), 0));
        for (int peer : peers_) {
          push(push_[0], result_in(peer), summed, sub_bytes,
               flag(peer, Flag::kReduced, round, rank_));
        }
      }
      for (int peer : peers_) {
        consume(collect_[0], flag(rank_, Flag::kReduced, round, peer));
        const std::int64_t row = row_of(peer, round);
        // A one-slot sum is a copy. On SMs, between the GEMMs' waves: a local copy on the copy
        // engine ran at about 130 GB/s and held up the pushes queued behind it (measured).
        void* const copy_to[] = {out + row * row_bytes};
        sum_slots(product_dtype_, workspace_->data(rank_) + results_offset_ + row * row_bytes, 0, 1,
                  sub_count, copy_to, 1, collect_[0]);
      }
    }
  }

  CollectiveMatmulConfig config_;
  int tp_;
  int rank_;
  int rounds_;
  DType product_dtype_;  // of the product and the partial sums
  std::int64_t a_element_;
  std::int64_t out_element_;
  bool rowwise_;            // float8 with rowwise scales
  std::vector<int> peers_;  // ring order; push_[0] carries everything sent to peers_[j]
  std::vector<std::vector<int>> batches_;  // all_gather_matmul: gather_batches
  std::vector<int> arrivals_;              // all_gather_matmul: arrival_order
  // The one-launch GEMM's device-side limit on a wait for a peer's block: twice the group's
  // timeout, so that on an eager run the watchdog ends the process first, with a message naming
  // the run (a trap only loses the context). It ends what the watchdog does not watch: replays
  // of captured graphs.
  std::chrono::milliseconds trap_after_;
  // One stream carries every push, in ring order: a GPU's copy engine runs its pushes one after
  // another anyway (measured), and from several streams it took them in any order, so a rank
  // could wait for the block its peer happened to push last.
  SideStreams push_;
  SideStreams collect_;  // copies out of this rank's own buffer into the caller's outputs
  // Flags, the blocks in flight, the partial products (scratch) and the GEMMs, shared with the
  // group's other plans.
  std::shared_ptr<collective::GroupWorkspace> workspace_;
  std::vector<detail::Event> product_ready_;
  std::vector<detail::Event> reduced_ready_;
  std::vector<detail::Event> arrived_;  // all_gather_matmul: batches_[i] has arrived
  std::vector<void*> sum_targets_;      // a round's sum: this rank's output, and the peers' (tp)
  std::int64_t sub_rows_ = 0;
  std::int64_t results_offset_ = 0;  // all-reduce: the summed rows of every rank, in data
  int gemm_sms_ = 0;
  std::optional<GatheredGemm> gathered_gemm_;  // all_gather_matmul's GEMM in one launch, if faster
};

}  // namespace

std::unique_ptr<Executor> make_symmetric_executor(const Communicator& comm,
                                                  const CollectiveMatmulConfig& config) {
  return std::make_unique<SymmetricExecutor>(comm, config,
                                             collective::GroupWorkspace::of(*comm.state()));
}

}  // namespace meshla::collective
