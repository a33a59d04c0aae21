// The Pong game process: N tables in one loop, one GameLink agent per table. It owns its loop:
// every tick it reports what each table shows and applies the actions the run's policy sends.
//
//   pong --tables 16                  # trains: the address comes from $RLFLEET_GAME_LINK_ADDRESS
//   pong --local tracker --episodes 200   # no server: a ball-following player (or `random`)
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <numeric>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "pong.h"
#include "rlfleet/game_link.h"

namespace {

// SIGTERM (the launcher stopping the run) or SIGINT: finish the tick, say Goodbye, exit 0.
volatile std::sig_atomic_t stop_requested = 0;
void request_stop(int) { stop_requested = 1; }

struct Args {
  int tables = 16;
  std::uint64_t seed = 1;
  pong::Rules rules;
  long episodes = 0;  // stop after this many (0: until the run stops the game)
  std::string local;  // "", "random" or "tracker"
  std::string address;
  std::string env_id = "PongCpp-v0";
  double log_interval_s = 10.0;
};

[[noreturn]] void usage(const std::string& problem) {
  std::fprintf(stderr,
               "pong: %s\nusage: pong [--tables N] [--seed S] [--point-limit P] [--max-ticks T]\n"
               "            [--episodes E] [--local random|tracker] [--address HOST:PORT]\n"
               "            [--env-id ID] [--log-interval SECONDS]\n",
               problem.c_str());
  std::exit(2);
}

Args parse(int argc, char** argv) {
  Args args;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (i + 1 >= argc) usage("missing a value after " + flag);
    const std::string value = argv[++i];
    try {
      if (flag == "--tables") args.tables = std::stoi(value);
      else if (flag == "--seed") args.seed = std::stoull(value);
      else if (flag == "--point-limit") args.rules.point_limit = std::stoi(value);
      else if (flag == "--max-ticks") args.rules.max_ticks = std::stoi(value);
      else if (flag == "--episodes") args.episodes = std::stol(value);
      else if (flag == "--local") args.local = value;
      else if (flag == "--address") args.address = value;
      else if (flag == "--env-id") args.env_id = value;
      else if (flag == "--log-interval") args.log_interval_s = std::stod(value);
      else usage("unknown option " + flag);
    } catch (const std::logic_error&) {
      usage("bad value for " + flag + ": " + value);
    }
  }
  if (args.tables < 1) usage("--tables must be >= 1");
  if (args.rules.point_limit < 1 || args.rules.max_ticks < 1) usage("limits must be >= 1");
  if (!args.local.empty() && args.local != "random" && args.local != "tracker") {
    usage("--local is random or tracker");
  }
  return args;
}

// Scores of finished episodes, for the progress lines.
class Scores {
 public:
  void add(int points) {
    ++episodes_;
    recent_.push_back(points);
    if (recent_.size() > 100) recent_.pop_front();
  }
  long episodes() const { return episodes_; }
  double recent_mean() const {
    return recent_.empty() ? 0.0
                           : std::accumulate(recent_.begin(), recent_.end(), 0.0) / recent_.size();
  }

 private:
  long episodes_ = 0;
  std::deque<int> recent_;
};

}  // namespace

int main(int argc, char** argv) {
  const Args args = parse(argc, argv);
  std::signal(SIGTERM, request_stop);
  std::signal(SIGINT, request_stop);
  const auto n = static_cast<std::size_t>(args.tables);
  std::vector<pong::Table> tables;
  for (std::size_t i = 0; i < n; ++i) tables.emplace_back(args.rules, args.seed * 7919 + i);

  std::optional<rlfleet::GameLink> link;
  if (args.local.empty()) {
    rlfleet::GameLinkOptions options;
    options.address = args.address;
    options.game = "pong-cpp";
    options.env_id = args.env_id;
    options.observation_space = rlfleet::spaces::box(-1.0f, 1.0f, {pong::kObservationSize});
    options.action_space = rlfleet::spaces::discrete(pong::kNumActions);
    options.num_agents = static_cast<std::uint32_t>(n);
    options.labels = {{"tables", std::to_string(n)}};
    try {
      link.emplace(options);
    } catch (const rlfleet::GameLinkError& error) {
      std::fprintf(stderr, "pong: %s\n", error.what());
      return 1;
    }
    std::printf("pong: link %s open, %zu tables, run %s\n", link->link_id().c_str(), n,
                link->run().c_str());
    std::fflush(stdout);
  }

  std::vector<float> observations(n * pong::kObservationSize);
  std::vector<float> rewards(n, 0.0f);
  std::vector<bool> terminated(n, false), truncated(n, false);
  std::vector<std::int64_t> episode_ids(n, 0);
  std::vector<std::int64_t> actions(n, pong::kStay);
  std::mt19937 random(static_cast<std::uint32_t>(args.seed));
  Scores scores;
  std::uint64_t tick = 0;
  const auto start = std::chrono::steady_clock::now();
  auto last_log = start;

  try {
    while (!stop_requested && (args.episodes == 0 || scores.episodes() < args.episodes)) {
      ++tick;
      for (std::size_t i = 0; i < n; ++i) tables[i].observe(&observations[i * pong::kObservationSize]);
      if (link) {
        actions = link->act(observations, rewards, terminated, truncated, episode_ids).discrete();
      } else {
        for (std::size_t i = 0; i < n; ++i) {
          actions[i] = args.local == "tracker" ? pong::tracker_action(tables[i])
                                               : static_cast<int>(random() % pong::kNumActions);
        }
      }
      for (std::size_t i = 0; i < n; ++i) {
        if (terminated[i] || truncated[i]) {
          // This tick showed the episode's end; the action for it is ignored, a new one starts.
          scores.add(tables[i].points());
          tables[i].reset();
          ++episode_ids[i];
          rewards[i] = 0.0f;
          terminated[i] = truncated[i] = false;
          continue;
        }
        const pong::StepResult result = tables[i].step(static_cast<int>(actions[i]));
        rewards[i] = result.reward;
        terminated[i] = result.terminated;
        truncated[i] = result.truncated;
      }
      const auto now = std::chrono::steady_clock::now();
      if (std::chrono::duration<double>(now - last_log).count() >= args.log_interval_s) {
        last_log = now;
        const double seconds = std::chrono::duration<double>(now - start).count();
        std::printf("pong: tick %llu, %ld episodes, mean score (last 100) %.2f, %.0f ticks/s%s\n",
                    static_cast<unsigned long long>(tick), scores.episodes(),
                    scores.recent_mean(), tick / seconds,
                    link ? (", policy version " + std::to_string(link->policy_version())).c_str()
                         : "");
        std::fflush(stdout);
      }
    }
  } catch (const rlfleet::GameLinkError& error) {
    std::fprintf(stderr, "pong: %s\n", error.what());
    return 1;
  }

  std::printf("pong: %ld episodes, mean score (last 100) %.2f\n", scores.episodes(),
              scores.recent_mean());
  if (link) {
    try {
      const rlfleet::Farewell farewell = link->close(stop_requested ? "stopped" : "pong finished");
      std::printf("pong: farewell: %lld ticks, %lld episodes\n",
                  static_cast<long long>(farewell.ticks),
                  static_cast<long long>(farewell.episodes));
    } catch (const rlfleet::GameLinkError& error) {
      std::fprintf(stderr, "pong: closing the link: %s\n", error.what());
      return 1;
    }
  }
  return 0;
}
