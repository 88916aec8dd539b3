// Text form of BlockProblem (problem_io.h).
#include "tapesac/planner/problem_io.h"

#include <cstdio>
#include <sstream>
#include <string>

#include "tapesac/common/errors.h"

namespace tapesac::planner {
namespace {

std::string format_double(double x) {
  char buf[40];
  std::snprintf(buf, sizeof(buf), "%.17g", x);
  return buf;
}

class LineReader {
 public:
  explicit LineReader(std::istream& in) : in_(in) {}

  /// The next non-blank, non-comment line as a stream; throws at end of input.
  std::istringstream next(const char* what) {
    std::string line;
    while (std::getline(in_, line)) {
      ++number_;
      const size_t start = line.find_first_not_of(" \t\r");
      if (start == std::string::npos || line[start] == '#') continue;
      if (!line.empty() && line.back() == '\r') line.pop_back();
      last_ = line;
      return std::istringstream(line);
    }
    fail("expected ", what, ", found the end of the input");
    return {};
  }

  /// Reads `keyword <count>`.
  int64_t header(const char* keyword) {
    std::istringstream s = next(keyword);
    std::string word;
    int64_t n = -1;
    s >> word >> n;
    if (word != keyword || s.fail() || n < 0 || n > (int64_t{1} << 31)) {
      fail("expected '", keyword, " <count>', found '", last_, "'");
    }
    return n;
  }

  template <typename... Args>
  [[noreturn]] void fail(const Args&... parts) const {
    throw Error(ErrorKind::kConfig, c10::str("read_problem: line ", number_, ": ", parts...));
  }

  const std::string& last() const { return last_; }

 private:
  std::istream& in_;
  int64_t number_ = 0;
  std::string last_;
};

template <typename T>
T field(std::istringstream& s, LineReader& r, const char* what) {
  T x{};
  s >> x;
  if (s.fail()) r.fail("expected ", what, " in '", r.last(), "'");
  return x;
}

}  // namespace

void write_problem(std::ostream& out, const BlockProblem& p) {
  validate_problem(p);
  out << "tapesac-plan-problem " << kProblemFormatVersion << "\n";
  out << "signature " << p.signature << "\n";
  out << "values " << p.values.size() << "\n";
  for (const PlanValue& v : p.values) out << v.bytes << " " << v.producer << " " << v.storage << "\n";
  out << "ops " << p.ops.size() << "\n";
  for (size_t i = 0; i < p.ops.size(); ++i) {
    const PlanOp& op = p.ops[i];
    TAPESAC_CHECK(op.name != "-" && op.name.find_first_of(" \t\r\n") == std::string::npos, kConfig,
                  "write_problem: op #", i, " has name '", op.name, "'; names must not be '-' or hold whitespace");
    out << format_double(op.cost_ns) << " " << (op.replayable ? 1 : 0) << " " << (op.name.empty() ? "-" : op.name)
        << " " << op.inputs.size();
    for (int32_t v : op.inputs) out << " " << v;
    out << " " << op.outputs.size();
    for (int32_t v : op.outputs) out << " " << v;
    out << "\n";
  }
  out << "candidates " << p.candidates.size() << "\n";
  for (size_t c = 0; c < p.candidates.size(); ++c) {
    out << p.candidates[c] << " " << (p.must_keep[c] ? 1 : 0) << "\n";
  }
  out << "end\n";
  TAPESAC_CHECK(out.good(), kConfig, "write_problem: the output stream failed");
}

BlockProblem read_problem(std::istream& in) {
  LineReader r(in);
  BlockProblem p;
  {
    std::istringstream s = r.next("the header 'tapesac-plan-problem <version>'");
    std::string magic;
    int version = -1;
    s >> magic >> version;
    if (magic != "tapesac-plan-problem" || s.fail()) {
      r.fail("expected the header 'tapesac-plan-problem <version>', found '", r.last(), "'");
    }
    if (version != kProblemFormatVersion) {
      r.fail("format version ", version, " is not supported (this build reads version ", kProblemFormatVersion,
             "); re-dump the problem with this tapesac");
    }
  }
  {
    r.next("'signature <text>'");
    const std::string& line = r.last();
    const std::string key = "signature";
    if (line.compare(0, key.size(), key) != 0) r.fail("expected 'signature <text>', found '", line, "'");
    p.signature = line.size() > key.size() + 1 ? line.substr(key.size() + 1) : std::string();
  }
  const int64_t n_values = r.header("values");
  p.values.resize(static_cast<size_t>(n_values));
  for (PlanValue& v : p.values) {
    std::istringstream s = r.next("a value line '<bytes> <producer> <storage>'");
    v.bytes = field<int64_t>(s, r, "<bytes>");
    v.producer = field<int32_t>(s, r, "<producer>");
    v.storage = field<int32_t>(s, r, "<storage>");
  }
  const int64_t n_ops = r.header("ops");
  p.ops.resize(static_cast<size_t>(n_ops));
  for (PlanOp& op : p.ops) {
    std::istringstream s = r.next("an op line");
    op.cost_ns = field<double>(s, r, "<cost_ns>");
    op.replayable = field<int>(s, r, "<replayable>") != 0;
    op.name = field<std::string>(s, r, "<name>");
    if (op.name == "-") op.name.clear();
    const int64_t n_in = field<int64_t>(s, r, "<n_in>");
    if (n_in < 0) r.fail("negative input count in '", r.last(), "'");
    for (int64_t k = 0; k < n_in; ++k) op.inputs.push_back(field<int32_t>(s, r, "an input id"));
    const int64_t n_out = field<int64_t>(s, r, "<n_out>");
    if (n_out < 0) r.fail("negative output count in '", r.last(), "'");
    for (int64_t k = 0; k < n_out; ++k) op.outputs.push_back(field<int32_t>(s, r, "an output id"));
  }
  const int64_t n_candidates = r.header("candidates");
  for (int64_t c = 0; c < n_candidates; ++c) {
    std::istringstream s = r.next("a candidate line '<value> <must_keep>'");
    p.candidates.push_back(field<int32_t>(s, r, "<value>"));
    p.must_keep.push_back(field<int>(s, r, "<must_keep>") != 0 ? 1 : 0);
  }
  r.next("'end'");
  if (r.last().substr(0, 3) != "end") r.fail("expected 'end', found '", r.last(), "'");
  validate_problem(p);
  return p;
}

}  // namespace tapesac::planner
