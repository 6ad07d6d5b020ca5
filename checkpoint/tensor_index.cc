#include "checkpoint/tensor_index.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <memory>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/host_memory.h"  // RoundUp
#include "base/status_macros.h"
#include "cpu_adam/dtype.h"

namespace offload::checkpoint {

const char* RecordKindName(RecordKind kind) {
  return ::offload::checkpoint::v1::RecordKind_Name(kind).c_str();
}

namespace {

constexpr uint64_t kMaxNumel = uint64_t{1} << 40;

// What the daemon would never write: sizes past 2^40 elements, records
// outside their partition. Checked before anything is sized by them.
absl::Status Validate(const PartitionRecord& p, const std::string& path) {
  auto bad = [&](absl::string_view what) {
    return absl::DataLossError(absl::StrCat(path, ": partition '", p.name(), "' ", what,
                                            ": not a checkpoint offloadd wrote"));
  };
  if (p.tensor().empty()) return bad("names no tensor");
  if (p.numel() == 0 || p.numel() > kMaxNumel || p.offset() > kMaxNumel) {
    return bad(absl::StrCat("has numel ", p.numel(), " at offset ", p.offset()));
  }
  if (p.shape_size() > 16) return bad("has a shape of over 16 dimensions");
  uint64_t n = 1;
  for (uint64_t d : p.shape()) {
    if (d == 0 || d > kMaxNumel / n) return bad("has a shape of 0 or over 2^40 elements");
    n *= d;
  }
  const uint32_t dtype = p.param_dtype();
  if (dtype != static_cast<uint32_t>(DType::kFp32) &&
      dtype != static_cast<uint32_t>(DType::kBf16) &&
      dtype != static_cast<uint32_t>(DType::kFp16)) {
    return bad(absl::StrCat("has parameter dtype ", dtype));
  }
  // [begin, end) of each kind's records: none may hold an element twice
  // (Read counts the elements it copies).
  std::vector<std::tuple<int, uint64_t, uint64_t>> ranges;
  for (const Record& r : p.records()) {
    RETURN_IF_ERROR(CheckRecord(r, path));
    if (r.elems() > p.numel() || r.begin() > p.numel() - r.elems()) {
      return bad(absl::StrCat("has a record of elements [", r.begin(), ", +", r.elems(),
                              ") outside its ", p.numel()));
    }
    ranges.emplace_back(r.kind(), r.begin(), r.begin() + r.elems());
  }
  std::sort(ranges.begin(), ranges.end());
  for (size_t i = 1; i < ranges.size(); ++i) {
    const auto& [kind, begin, end] = ranges[i];
    const auto& [last_kind, last_begin, last_end] = ranges[i - 1];
    if (kind == last_kind && begin < last_end) {
      return bad(absl::StrCat("has two records of ", RecordKindName(static_cast<RecordKind>(kind)),
                              " holding element ", begin));
    }
  }
  return absl::OkStatus();
}

// FAILED_PRECONDITION if the latest checkpoints of the sessions in `dir`
// were taken after different numbers of steps: one of a job's ranks did
// not commit its last one (a full disk, offloadd killed between them), and
// restoring from all would mix two moments of training. Names each
// session's steps and what they all hold, for restore_steps.
absl::Status CheckOneStep(const Directory& dir,
                          const std::vector<std::pair<std::string, Manifest>>& manifests) {
  const uint64_t first = manifests.front().second.steps();
  if (std::all_of(manifests.begin(), manifests.end(),
                  [first](const auto& m) { return m.second.steps() == first; })) {
    return absl::OkStatus();
  }
  std::vector<std::string> each;
  std::vector<uint64_t> common;
  for (size_t i = 0; i < manifests.size(); ++i) {
    const Manifest& m = manifests[i].second;
    std::vector<uint64_t> held = CheckpointSteps(dir, StemFor(m.session_name()));
    if (held.empty()) held = {m.steps()};
    std::string kept;
    if (held.size() > 1) kept = absl::StrCat(" (and ", held[1], ")");
    each.push_back(absl::StrCat("'", m.session_name(), "' ", m.steps(), kept));
    std::sort(held.begin(), held.end());
    if (i == 0) {
      common = held;
    } else {
      std::vector<uint64_t> both;
      std::set_intersection(common.begin(), common.end(), held.begin(), held.end(),
                            std::back_inserter(both));
      common = std::move(both);
    }
  }
  return absl::FailedPreconditionError(absl::StrCat(
      "checkpoint ", dir.path(),
      " holds its sessions at different steps (a rank's last checkpoint did not complete): ",
      absl::StrJoin(each, ", "), "; restoring all would mix them. ",
      common.empty() ? std::string("No step is held by all of them")
                     : absl::StrCat("All of them hold step ", common.back(),
                                    ": ask for it (restore_steps, offloadctl export --steps)")));
}

}  // namespace

absl::StatusOr<std::unique_ptr<TensorIndex>> TensorIndex::Load(const std::string& dir,
                                                               std::optional<uint64_t> steps) {
  auto index = std::make_unique<TensorIndex>();
  index->dir_ = dir;
  // Its manifests and data files read from the directory that was checked.
  ASSIGN_OR_RETURN(const Directory opened, Directory::Open(dir));
  ASSIGN_OR_RETURN(auto manifests, ReadManifests(opened, steps));
  if (!steps.has_value()) RETURN_IF_ERROR(CheckOneStep(opened, manifests));
  for (auto& [path, m] : manifests) {
    auto manifest = std::make_unique<Manifest>(std::move(m));
    ASSIGN_OR_RETURN(DataFileReader reader,
                     DataFileReader::Open(opened, manifest->data_file(), manifest->memory_file()));
    index->readers_.push_back(std::make_unique<DataFileReader>(std::move(reader)));
    for (const PartitionRecord& p : manifest->partitions()) {
      RETURN_IF_ERROR(Validate(p, path));
      Tensor& t = index->tensors_[p.tensor()];
      const std::vector<uint64_t> shape(p.shape().begin(), p.shape().end());
      if (!t.slices.empty() && t.shape != shape) {
        return absl::FailedPreconditionError(
            absl::StrCat("checkpoint ", dir, ": tensor '", p.tensor(),
                         "' has two shapes (partition '", p.name(), "' in ", path, ")"));
      }
      t.shape = shape;
      t.slices.push_back(Slice{manifest.get(), &p, index->readers_.back().get()});
    }
    index->manifests_.emplace_back(path, std::move(manifest));
  }
  for (auto& [name, t] : index->tensors_) {
    std::sort(t.slices.begin(), t.slices.end(),
              [](const Slice& a, const Slice& b) { return a.begin() < b.begin(); });
    for (size_t i = 1; i < t.slices.size(); ++i) {
      if (t.slices[i].begin() < t.slices[i - 1].end()) {
        return absl::FailedPreconditionError(absl::StrCat(
            "checkpoint ", dir, " holds elements of tensor '", name, "' twice (partition '",
            t.slices[i - 1].partition->name(), "' of session '",
            t.slices[i - 1].manifest->session_name(), "' and partition '",
            t.slices[i].partition->name(), "' of session '", t.slices[i].manifest->session_name(),
            "'): keep one checkpoint per directory"));
      }
    }
    if (!t.shape.empty()) {
      t.numel = 1;
      for (uint64_t d : t.shape) t.numel *= d;
    } else {
      t.numel = t.slices.back().end();
    }
  }
  return index;
}

absl::StatusOr<const TensorIndex::Tensor*> TensorIndex::Find(const std::string& tensor) const {
  auto it = tensors_.find(tensor);
  if (it == tensors_.end()) {
    return absl::NotFoundError(
        absl::StrCat("the checkpoint in ", dir_, " has no tensor '", tensor, "'"));
  }
  return &it->second;
}

absl::StatusOr<std::vector<const TensorIndex::Slice*>> TensorIndex::Covering(
    const std::string& name, const Tensor& t, uint64_t begin, uint64_t end) const {
  end = std::min(end, t.numel);
  std::vector<const Slice*> out;
  uint64_t next = begin;
  for (const Slice& s : t.slices) {
    if (s.end() <= next || next >= end) continue;
    if (s.begin() > next) break;
    out.push_back(&s);
    next = s.end();
  }
  if (next < end) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the checkpoint in ", dir_, " lacks elements [", next, ", ", end, ") of tensor '", name,
        "' (", t.numel, " elements): a session that held them was not checkpointed into it"));
  }
  return out;
}

absl::Status TensorIndex::Read(const Slice& slice, RecordKind kind, uint64_t begin, uint64_t elems,
                               size_t elem_size, void* dst) const {
  const PartitionRecord& p = *slice.partition;
  // Indices within the partition.
  const uint64_t lo = begin - p.offset(), hi = lo + elems;
  auto* out = static_cast<std::byte*>(dst);
  // Aligned, so that the records are read around the page cache.
  struct Free {
    void operator()(std::byte* p) const { std::free(p); }
  };
  std::unique_ptr<std::byte[], Free> buffer;
  uint64_t capacity = 0;
  uint64_t covered = 0;
  for (const Record& r : p.records()) {
    if (r.kind() != kind || r.begin() + r.elems() <= lo || r.begin() >= hi) continue;
    if (r.elems() == 0 || r.bytes() != r.elems() * elem_size) {
      return absl::FailedPreconditionError(
          absl::StrCat("partition '", p.name(), "' of the checkpoint in ", dir_, " holds ",
                       RecordKindName(kind), " with ", r.bytes(), " bytes for ", r.elems(),
                       " elements, not ", elem_size, " bytes each (a different dtype)"));
    }
    const uint64_t from = std::max(lo, r.begin()), to = std::min(hi, r.begin() + r.elems());
    covered += to - from;
    if (from == r.begin() && to == r.begin() + r.elems()) {
      // The whole record is wanted: read straight into place.
      RETURN_IF_ERROR(slice.reader->Read(r, out + (from - lo) * elem_size));
      continue;
    }
    if (r.bytes() > capacity) {
      capacity = RoundUp(r.bytes(), kDirectAlignment);
      buffer.reset(static_cast<std::byte*>(std::aligned_alloc(kDirectAlignment, capacity)));
      if (buffer == nullptr) {
        return absl::ResourceExhaustedError(
            absl::StrCat("no memory for a ", capacity, "-byte checkpoint record"));
      }
    }
    RETURN_IF_ERROR(slice.reader->Read(r, buffer.get()));
    std::memcpy(out + (from - lo) * elem_size, buffer.get() + (from - r.begin()) * elem_size,
                (to - from) * elem_size);
  }
  if (covered != elems) {
    return absl::FailedPreconditionError(
        absl::StrCat("partition '", p.name(), "' of the checkpoint in ", dir_, " has ", covered,
                     " of ", elems, " elements of ", RecordKindName(kind), " asked for"));
  }
  return absl::OkStatus();
}

}  // namespace offload::checkpoint
