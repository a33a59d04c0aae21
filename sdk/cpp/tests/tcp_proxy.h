// A loopback TCP proxy in front of the env server whose connections the test can cut, the way a
// network fault or a NAT timeout would: the client sees its stream break and reconnects
// through the proxy, which keeps accepting.
#pragma once

#include <atomic>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace rlfleet::testing {

class TcpProxy {
 public:
  explicit TcpProxy(const std::string& upstream);  // upstream: host:port
  ~TcpProxy();
  TcpProxy(const TcpProxy&) = delete;
  TcpProxy& operator=(const TcpProxy&) = delete;

  const std::string& address() const { return address_; }  // where clients connect
  void cut();          // closes every open connection (both sides)
  int accepted() const { return accepted_; }

 private:
  void serve();
  void pump(int from, int to);

  std::string upstream_host_;
  int upstream_port_ = 0;
  std::string address_;
  int listener_ = -1;
  std::atomic<bool> stopping_{false};
  std::atomic<int> accepted_{0};
  std::mutex mutex_;
  std::vector<int> sockets_;  // open connections, both sides
  std::vector<std::thread> threads_;
  std::thread acceptor_;
};

}  // namespace rlfleet::testing
