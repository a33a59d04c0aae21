// GameLink bench client (bench/transport/game_link.py starts it): L links of N agents, each a
// GameLink on its own thread (a GameLink belongs to one thread, as in a game loop), each running
// W warm-up ticks and then T measured ticks with up to K observations in flight (1: lock step).
// Prints one JSON line: the measured seconds (all links, from the moment every link is warmed
// up), the ticks, the granted in-flight window and every tick's submit -> reply latency in
// microseconds.
//
//   link_bench ADDRESS AGENTS LINKS TICKS WARMUP IN_FLIGHT
#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <exception>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "rlfleet/game_link.h"

namespace {

using Clock = std::chrono::steady_clock;

// Every link thread and main() meet here twice: warmed up, and done measuring.
class Rendezvous {
 public:
  explicit Rendezvous(int parties) : parties_(parties) {}
  void arrive_and_wait() {
    std::unique_lock<std::mutex> lock(mutex_);
    const int round = round_;
    if (++arrived_ == parties_) {
      arrived_ = 0;
      ++round_;
      changed_.notify_all();
    } else {
      changed_.wait(lock, [&] { return round_ != round || failed_; });
    }
  }
  void fail() {
    std::lock_guard<std::mutex> lock(mutex_);
    failed_ = true;
    changed_.notify_all();
  }
  bool failed() {
    std::lock_guard<std::mutex> lock(mutex_);
    return failed_;
  }

 private:
  std::mutex mutex_;
  std::condition_variable changed_;
  int parties_, arrived_ = 0, round_ = 0;
  bool failed_ = false;
};

struct Game {  // CartPole's spaces, constant values: stepping it costs nothing
  explicit Game(std::uint32_t agents)
      : observations(agents * 4, 0.5f), rewards(agents, 0.0f), ends(agents, false), ids(agents) {
    for (std::uint32_t i = 0; i < agents; ++i) ids[i] = i;
  }
  std::vector<float> observations, rewards;
  std::vector<bool> ends;
  std::vector<std::int64_t> ids;
};

// `count` ticks from tick `first`, up to max_in_flight() unanswered; latencies (us) into `out`.
void drive(rlfleet::GameLink& link, const Game& game, std::uint64_t first, long count,
           std::vector<double>* out) {
  std::deque<Clock::time_point> sent;
  auto receive = [&] {
    link.receive();
    const double us = std::chrono::duration<double, std::micro>(Clock::now() - sent.front()).count();
    sent.pop_front();
    if (out) out->push_back(us);
  };
  for (long t = 0; t < count; ++t) {
    if (sent.size() >= link.max_in_flight()) receive();
    sent.push_back(Clock::now());
    link.submit(first + t, game.observations, game.rewards, game.ends, game.ends, game.ids);
  }
  while (!sent.empty()) receive();
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 7) {
    std::fprintf(stderr, "usage: link_bench ADDRESS AGENTS LINKS TICKS WARMUP IN_FLIGHT\n");
    return 2;
  }
  long agents = 0, links = 0, ticks = 0, warmup = 0, in_flight = 0;
  try {
    agents = std::stol(argv[2]), links = std::stol(argv[3]), ticks = std::stol(argv[4]);
    warmup = std::stol(argv[5]), in_flight = std::stol(argv[6]);
  } catch (const std::logic_error&) {
    std::fprintf(stderr, "link_bench: AGENTS LINKS TICKS WARMUP IN_FLIGHT must be integers\n");
    return 2;
  }
  if (agents < 1 || links < 1 || ticks < 1 || warmup < 0 || in_flight < 1) {
    std::fprintf(stderr, "link_bench: AGENTS, LINKS, TICKS, IN_FLIGHT >= 1 and WARMUP >= 0\n");
    return 2;
  }
  const Game game(static_cast<std::uint32_t>(agents));
  Rendezvous meet(static_cast<int>(links) + 1);
  std::vector<std::vector<double>> latencies(links);
  std::vector<std::uint32_t> granted(links, 0);
  std::mutex error_mutex;
  std::string error;
  std::vector<std::thread> threads;
  for (long i = 0; i < links; ++i) {
    threads.emplace_back([&, i] {
      try {
        rlfleet::GameLinkOptions options;
        options.address = argv[1];
        options.game = "bench-cpp";
        options.env_id = "BenchTick-v0";
        options.observation_space = rlfleet::spaces::box(-1.0f, 1.0f, {4});
        options.action_space = rlfleet::spaces::discrete(2);
        options.num_agents = static_cast<std::uint32_t>(agents);
        options.max_in_flight = static_cast<std::uint32_t>(in_flight);
        rlfleet::GameLink link(options);
        granted[i] = link.max_in_flight();
        drive(link, game, 1, warmup, nullptr);
        meet.arrive_and_wait();
        latencies[i].reserve(ticks);
        drive(link, game, warmup + 1, ticks, &latencies[i]);
        meet.arrive_and_wait();
        link.close("bench done");
      } catch (const std::exception& e) {
        std::lock_guard<std::mutex> lock(error_mutex);
        error = e.what();
        meet.fail();
      }
    });
  }
  meet.arrive_and_wait();
  const auto started = Clock::now();
  meet.arrive_and_wait();
  const double seconds = std::chrono::duration<double>(Clock::now() - started).count();
  for (auto& thread : threads) thread.join();
  if (meet.failed()) {
    std::fprintf(stderr, "link_bench: %s\n", error.c_str());
    return 1;
  }
  std::printf("{\"seconds\": %.6f, \"ticks\": %ld, \"in_flight\": %u, \"latencies_us\": [", seconds,
              ticks * links, *std::min_element(granted.begin(), granted.end()));
  const char* separator = "";
  for (const auto& per_link : latencies) {
    for (double us : per_link) {
      std::printf("%s%.1f", separator, us);
      separator = ", ";
    }
  }
  std::printf("]}\n");
  return 0;
}
