// The step protocol between the partition store and the step runner: what
// BeginStep and BeginAccumulate hand out, what each chunk pins, and what
// the runner reports back. See partition_store.h for the calls.
#ifndef OFFLOADD_ENGINE_STEP_PROTOCOL_H_
#define OFFLOADD_ENGINE_STEP_PROTOCOL_H_

#include <cstdint>

#include "cpu_adam/optimizer.h"
#include "cpu_adam/types.h"
#include "swapper/swapper.h"

namespace offload {

// One partition of a step, as BeginStep hands it to the step runner. The
// task's dtypes and step are set (gradients: the fp32 accumulator); the
// pointers come from PinChunk.
struct StepItem {
  uint64_t id = 0;
  AdamTask task;
  uint64_t chunks = 0;
  // What accumulating its gradients measured (non-finite values, norm).
  GradStats stats;
  // The delayed parameter update: the new working copy goes into the
  // partition's other buffer, while the trainer reads the current one.
  bool delayed = false;
  // The working-copy buffers' block kinds: the one the update writes, the
  // one the trainer reads (equal without the delayed update). Fixed for
  // the step: buffers swap only between steps.
  int write_kind = 0, current_kind = 0;
  // The master copy has never been written: initialise it from the working
  // copy before the update.
  bool init_master = false;
  // The first state chunk to update: not 0 when this step resumes one that
  // failed midway through this partition.
  uint64_t first_chunk = 0;
  // The gradients are in the partition's gradient buffer (in its gradient
  // dtype), handed over, not in the accumulator.
  bool hand_over = false;
};

// One chunk of a partition, everything its update touches pinned in host
// memory: elements [begin, end) of the partition. `accum` holds the
// accumulated fp32 gradients (or, handed over, the gradient buffer's).

struct ChunkPins {
  uint64_t begin = 0, end = 0;
  // `params` is the buffer the update writes; `current` (delayed update of
  // a partition whose master is not initialised yet) the one it starts from.
  Swapper::Pin master, exp_avg, exp_avg_sq, params, accum, current;
};

// A micro-batch's gradients being added into a partition's accumulator, as
// BeginAccumulate hands it to the step runner.
struct AccumulateItem {
  uint64_t id = 0;
  uint64_t numel = 0;
  uint64_t chunks = 0;
  DType grad_dtype = DType::kFp32;
  bool first = false;  // the accumulator holds nothing yet: copy
  // The gradients stay in the buffer for the step to read (measured only).
  bool hand_over = false;
  // Measured after the call returned (StepRunner): a failure cannot be
  // reported to the caller, so it loses the accumulation (skip the step).
  bool background = false;
  // Not a return: handed-over gradients copied into the accumulator so
  // that the trainer can have its buffer back before the step (BeginReclaim).
  bool reclaim = false;
};

// One chunk of it: the trainer's gradients (read) and the accumulator.
struct AccumulatePins {
  uint64_t begin = 0, end = 0;
  Swapper::Pin grads, accum;
};

// The gradients waiting for the next step, over a session's partitions.
struct PendingGradients {
  GradStats stats;              // of the accumulated values
  uint64_t partitions = 0;      // with gradients
  uint64_t micro_batches = 0;   // the most accumulated into one partition
  double loss_scale = 1;        // the session's (SessionManager fills it in)
  bool delayed_update = false;  // the session's delayed update is on
  // The session's automatic checkpoint is due (SessionManager fills it in).
  bool auto_checkpoint_due = false;
};

enum class StepOutcome {
  kApplied,  // the update happened: gradients consumed, step counts advance
  kSkipped,  // non-finite gradients: gradients consumed, nothing else changes
  kFailed,   // stopped before its end: gradients stay ready, and the next
             // step resumes at `next_chunk`
};

struct ItemOutcome {
  StepOutcome outcome = StepOutcome::kFailed;
  uint64_t next_chunk = 0;  // kFailed: chunks before it were updated
  bool ended = false;       // already handed back by EndPartition
};

}  // namespace offload

#endif  // OFFLOADD_ENGINE_STEP_PROTOCOL_H_
