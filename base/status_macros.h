// Early-return helpers for absl::Status / absl::StatusOr (absl's 2022 LTS has
// none). Usable from any thread; they only touch their arguments.
#ifndef OFFLOADD_BASE_STATUS_MACROS_H_
#define OFFLOADD_BASE_STATUS_MACROS_H_

#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define OFFLOAD_STATUS_CONCAT_INNER_(a, b) a##b
#define OFFLOAD_STATUS_CONCAT_(a, b) OFFLOAD_STATUS_CONCAT_INNER_(a, b)

// Returns the status of `expr` from the enclosing function unless it is OK.
#define RETURN_IF_ERROR(expr)                          \
  do {                                                 \
    ::absl::Status offload_status_ = (expr);           \
    if (!offload_status_.ok()) return offload_status_; \
  } while (0)

// `ASSIGN_OR_RETURN(auto x, MakeX());` binds the value of a StatusOr or
// returns its error status.
#define ASSIGN_OR_RETURN(lhs, rexpr) \
  OFFLOAD_ASSIGN_OR_RETURN_IMPL_(OFFLOAD_STATUS_CONCAT_(offload_statusor_, __LINE__), lhs, rexpr)

#define OFFLOAD_ASSIGN_OR_RETURN_IMPL_(statusor, lhs, rexpr) \
  auto statusor = (rexpr);                                   \
  if (!statusor.ok()) return std::move(statusor).status();   \
  lhs = std::move(statusor).value()

#endif  // OFFLOADD_BASE_STATUS_MACROS_H_
