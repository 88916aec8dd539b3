// The options of a Session (one TapeSAC) and the view of a closed block call's tape that the planner observes.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "tapesac/capture/device_memory.h"
#include "tapesac/capture/graph_device.h"
#include "tapesac/capture/op_timer.h"
#include "tapesac/capture/tape.h"
#include "tapesac/replay/approx.h"
#include "tapesac/replay/decide.h"
#include "tapesac/replay/graph_block.h"
#include "tapesac/replay/preserve.h"
#include "tapesac/replay/schedule.h"

namespace tapesac::replay {

/// What a block call's forward left for planning (see Session::set_tape_observer): its tape, the values a policy
/// decides on (saved for backward, produced on the tape; ascending ValueId), which of them cannot be dropped, and
/// the keep mask applied this step (1 = kept).
struct BlockTapeView {
  const std::string& name;
  uint64_t signature;
  const capture::Tape& tape;
  const std::vector<capture::ValueId>& candidates;
  const std::vector<uint8_t>& must_keep;
  const std::vector<uint8_t>& kept;
  const std::string& plan_key;  ///< the call's key among the step's plans (plan_key(), as its timeline spans' call)
};

using TapeObserver = std::function<void(const BlockTapeView&)>;

struct SessionOptions {
  PolicyKind policy = PolicyKind::kFull;
  /// For kSaveOps: true when outputs of the op named (e.g. "aten::mm", "aten::add.Tensor") should be kept.
  /// Called once per distinct op kind per Session (results cached); may call into Python.
  std::function<bool(const std::string&)> save_op;
  /// Check version counters of saved and live tensors at unpack (contract "check"/"strict"); off skips them.
  bool check_versions = true;
  /// Check replayed outputs' metadata against the tape.
  bool check_metadata = true;
  /// Contract "strict": checksum every dropped tensor's bytes at forward and compare after replay.
  bool check_bytes = false;
  /// How replays recover external tensors the step writes in place after a block's forward (see preserve.h);
  /// kOff rejects such replays.
  PreserveMode preserve = PreserveMode::kRegions;
  /// Step-peak limit in bytes enforced during replay (0: none): a replay that would not fit runs in pieces, and
  /// raises MemoryLimitError when even a piece cannot fit.
  int64_t memory_limit = 0;
  /// Bound of the step's memory timeline (points); 0 disables it.
  size_t timeline_points = 8192;
  /// CUDA only: the private memory pool (a MempoolId_t, e.g. torch.cuda.MemPool().id) every replay of the
  /// session allocates from — the replay arena; {0, 0}: replays use the default pool.
  capture::PoolId arena_pool_id{0, 0};
  int arena_device = 0;
  /// The device's memory figures and arena routing; null: capture::cuda_device_memory() (itself null without the
  /// GPU backend).
  std::shared_ptr<capture::DeviceMemorySource> device_memory;
  /// Graph replay (graph_block.h): the device that captures and launches block graphs; null: eager replay only.
  std::shared_ptr<capture::GraphDevice> graph_device;
  GraphOptions graph;
  /// The step-peak limit graph captures must respect (bytes, 0: none), also on the steps where memory_limit is
  /// switched off (a planner's measuring step): a graph's static memory stays for every later step.
  int64_t graph_memory_limit = 0;
  /// A replay schedule shape every block call follows instead of its plan's or the default (schedule.h).
  ForcedSchedule forced_schedule = ForcedSchedule::kNone;
  /// The shape a block call without a plan's schedule follows when none is forced (schedule.h): one segment, or lazy
  /// (the least alive: runtime::Runtime's choice for planned schedules under a memory limit, until a plan exists).
  ForcedSchedule unplanned_schedule = ForcedSchedule::kOneSegment;
  /// Device op times for the planner (capture/op_timer.h, e.g. capture::device_op_timers()); null: CPU clock.
  std::shared_ptr<capture::OpTimerFactory> op_timers;

  bool has_arena() const { return arena_pool_id.first != 0 || arena_pool_id.second != 0; }
};

/// The names the Python front passes: "none", "full", "save_ops", "plan". Throws ConfigError listing them otherwise.
PolicyKind parse_policy(const std::string& name);
/// "off", "regions", "snapshots". Throws ConfigError otherwise.
PreserveMode parse_preserve(const std::string& name);
/// "off", "first", "every". Throws ConfigError otherwise.
LaunchTiming parse_graph_timing(const std::string& name);
/// A validated approximation (fraction in (0, 1], method "sketch" or "greedy"). Throws ConfigError otherwise.
std::shared_ptr<Approx> make_approx(double fraction, const std::string& method, bool mlp, bool attn, uint64_t seed,
                                    bool reweight);

}  // namespace tapesac::replay
