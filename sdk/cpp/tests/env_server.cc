#include "env_server.h"

#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>
#include <stdexcept>
#include <thread>

namespace rlfleet::testing {

namespace {

constexpr auto kStartTimeout = std::chrono::seconds(90);  // a loaded 2-core machine imports torch slowly

std::string read_file(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

}  // namespace

EnvServerProcess::EnvServerProcess(const std::string& game_link_yaml) {
  char pattern[] = "/tmp/rlfleet-gamelink-test-XXXXXX";
  if (!mkdtemp(pattern)) throw std::runtime_error("mkdtemp failed");
  dir_ = pattern;
  run_ = "cpp-sdk-test-" + std::to_string(getpid());
  const std::string config = dir_ + "/run.yaml";
  std::ofstream(config) << "run:\n  name: " << run_ << "\n  dir: " << dir_ << "/run\n"
                        << "services:\n  - name: env-test\n    service: env_server\n"
                        << "    settings:\n      game_link: " << game_link_yaml << "\n";
  const std::string log_path = dir_ + "/server.log";

  pid_ = fork();
  if (pid_ < 0) throw std::runtime_error("fork failed");
  if (pid_ == 0) {
    setpgid(0, 0);
    prctl(PR_SET_PDEATHSIG, SIGTERM);  // dies with the test binary, however that ends
    FILE* log = std::freopen(log_path.c_str(), "w", stdout);
    if (log) dup2(fileno(stdout), STDERR_FILENO);
    setenv("OMP_NUM_THREADS", "1", 1);
    // What the launcher hands a service: its run's name and directory.
    setenv("RLFLEET_RUN_NAME", run_.c_str(), 1);
    setenv("RLFLEET_RUN_DIR", (dir_ + "/run").c_str(), 1);
    execl(RLFLEET_CLI, RLFLEET_CLI, "serve", "env_server", "--config", config.c_str(), "--name",
          "env-test", "--port", "0", static_cast<char*>(nullptr));
    std::perror("exec " RLFLEET_CLI);
    _exit(127);
  }
  setpgid(pid_, pid_);

  const std::regex serving(R"(serving on (\S+:\d+))");
  const auto deadline = std::chrono::steady_clock::now() + kStartTimeout;
  while (std::chrono::steady_clock::now() < deadline) {
    std::smatch match;
    const std::string text = log();
    if (std::regex_search(text, match, serving)) {
      address_ = match[1];
      return;
    }
    int status = 0;
    if (waitpid(pid_, &status, WNOHANG) == pid_) {
      pid_ = -1;
      throw std::runtime_error("the env server exited before serving:\n" + text);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  const std::string text = log();
  stop();
  throw std::runtime_error("the env server did not serve within 90s:\n" + text);
}

EnvServerProcess::~EnvServerProcess() { stop(); }

void EnvServerProcess::stop() {
  if (pid_ > 0) {
    kill(-pid_, SIGTERM);
    for (int i = 0; i < 100 && waitpid(pid_, nullptr, WNOHANG) == 0; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    kill(-pid_, SIGKILL);
    waitpid(pid_, nullptr, 0);
    pid_ = -1;
  }
  if (!dir_.empty() && std::getenv("RLFLEET_KEEP_TEST_DIR") == nullptr) {
    std::error_code ignored;
    std::filesystem::remove_all(dir_, ignored);
  }
  dir_.clear();
}

std::string EnvServerProcess::log() const { return read_file(dir_ + "/server.log"); }

}  // namespace rlfleet::testing
