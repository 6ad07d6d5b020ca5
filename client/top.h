// offloadctl top: a live view of one node's offloadd, drawn from two
// GetStats snapshots taken `seconds` apart (rates are their differences).
// Rendering is a pure function of the snapshots, so that tests check it
// without a terminal; offloadctl redraws it every interval.
#ifndef OFFLOADD_CLIENT_TOP_H_
#define OFFLOADD_CLIENT_TOP_H_

#include <string>

#include "client/client.h"

namespace offload {

// The screen: the daemon, its tiers and the node's swap and prefetch rates,
// then one line per session (placement, held partitions, steps a second,
// the mean step split into waiting for state and computing, its GPU
// tier's traffic and hit rate). `before` may be null (the first screen:
// no rates yet). Lines are cut at `width` columns.
std::string RenderTop(const DaemonStats& now, const DaemonStats* before, double seconds,
                      int width = 200);

}  // namespace offload

#endif  // OFFLOADD_CLIENT_TOP_H_
