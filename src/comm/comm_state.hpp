// The state behind a meshla::Communicator: one NCCL communicator, shared by every Communicator
// copy and every plan that uses it, destroyed with the last of them.
#pragma once

#include <chrono>
#include <functional>

#include <nccl.h>

namespace meshla::detail {

struct CommState {
  // `release` ends the NCCL communicator; production code passes release_nccl_comm, CPU tests a
  // recorder. It runs exactly once, when the last owner lets go.
  CommState(ncclComm_t comm, int rank, int size, int device, std::chrono::milliseconds timeout,
            std::function<void(ncclComm_t)> release);
  ~CommState();
  CommState(const CommState&) = delete;
  CommState& operator=(const CommState&) = delete;

  ncclComm_t comm;
  int rank;
  int size;
  int device;
  std::chrono::milliseconds timeout;

 private:
  std::function<void(ncclComm_t)> release_;
};

// Ends a communicator with ncclCommAbort: local, so teardown in any order on any rank never waits
// for a peer (ncclCommFinalize is collective and would hang when ranks drop their handles in
// different orders). Plans synchronise their own last execution before they let go.
void release_nccl_comm(ncclComm_t comm);

// Waits until the nonblocking communicator has finished its pending host-side work (creation,
// connection setup). Throws kNccl on an asynchronous error and kTimeout past the state's timeout.
void wait_until_ready(const CommState& state, const char* what);

// Checks the status of an NCCL call on `state`: ncclInProgress waits until ready, any other
// failure throws naming the call.
void check_nccl_on(const CommState& state, ncclResult_t status, const char* call, const char* file,
                   int line);

}  // namespace meshla::detail

#define MESHLA_CHECK_NCCL_ON(state, call) \
  ::meshla::detail::check_nccl_on((state), (call), #call, __FILE__, __LINE__)
