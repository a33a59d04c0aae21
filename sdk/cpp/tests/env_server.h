// A real env server for the tests: `rlfleet serve env_server` in a child process (its own
// process group, killed with the test binary) with the given `game_link` settings, on a free
// loopback port that it reports in its log.
#pragma once

#include <string>
#include <sys/types.h>

namespace rlfleet::testing {

class EnvServerProcess {
 public:
  // game_link_yaml: the flow mapping of the server's `game_link` settings, e.g.
  // "{enabled: true, policy: random}". Waits until the server serves (or throws with its log).
  explicit EnvServerProcess(const std::string& game_link_yaml);
  ~EnvServerProcess();
  EnvServerProcess(const EnvServerProcess&) = delete;
  EnvServerProcess& operator=(const EnvServerProcess&) = delete;

  const std::string& address() const { return address_; }  // host:port
  const std::string& run() const { return run_; }          // the run name in its config
  std::string log() const;                                 // what it wrote so far

 private:
  void stop();  // SIGTERM, then SIGKILL after 10 s, to the server's process group

  std::string dir_;
  std::string address_;
  std::string run_;
  pid_t pid_ = -1;
};

}  // namespace rlfleet::testing
