#include "tcp_proxy.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <stdexcept>

namespace rlfleet::testing {

TcpProxy::TcpProxy(const std::string& upstream) {
  const auto colon = upstream.rfind(':');
  upstream_host_ = upstream.substr(0, colon);
  upstream_port_ = std::stoi(upstream.substr(colon + 1));

  listener_ = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  if (bind(listener_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      listen(listener_, 16) != 0) {
    throw std::runtime_error("proxy: cannot listen on loopback");
  }
  socklen_t length = sizeof(addr);
  getsockname(listener_, reinterpret_cast<sockaddr*>(&addr), &length);
  address_ = "127.0.0.1:" + std::to_string(ntohs(addr.sin_port));
  acceptor_ = std::thread([this] { serve(); });
}

TcpProxy::~TcpProxy() {
  stopping_ = true;
  shutdown(listener_, SHUT_RDWR);
  cut();
  acceptor_.join();
  for (auto& thread : threads_) thread.join();
  close(listener_);
  std::lock_guard<std::mutex> lock(mutex_);
  for (int fd : sockets_) close(fd);
}

void TcpProxy::cut() {
  std::lock_guard<std::mutex> lock(mutex_);
  // shutdown, not close: the pump threads still own the descriptors and close them.
  for (int fd : sockets_) shutdown(fd, SHUT_RDWR);
}

void TcpProxy::serve() {
  while (!stopping_) {
    pollfd ready{listener_, POLLIN, 0};
    if (poll(&ready, 1, 100) <= 0) continue;
    const int client = accept(listener_, nullptr, nullptr);
    if (client < 0) continue;
    const int server = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(static_cast<uint16_t>(upstream_port_));
    inet_pton(AF_INET, upstream_host_.c_str(), &addr.sin_addr);
    if (connect(server, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
      close(client);
      close(server);
      continue;
    }
    const int one = 1;
    setsockopt(client, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    setsockopt(server, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    ++accepted_;
    std::lock_guard<std::mutex> lock(mutex_);
    sockets_.push_back(client);
    sockets_.push_back(server);
    threads_.emplace_back([this, client, server] { pump(client, server); });
  }
}

// Copies both ways until either side ends, then ends the other.
void TcpProxy::pump(int a, int b) {
  char buffer[16384];
  pollfd fds[2] = {{a, POLLIN, 0}, {b, POLLIN, 0}};
  bool open = true;
  while (open) {
    if (poll(fds, 2, 100) < 0) break;
    for (int i = 0; i < 2 && open; ++i) {
      if (fds[i].revents == 0) continue;
      const ssize_t n = read(fds[i].fd, buffer, sizeof(buffer));
      if (n <= 0) {
        open = false;
        break;
      }
      ssize_t sent = 0;
      while (sent < n) {
        // MSG_NOSIGNAL: a peer that is gone must end this pump, not the test (SIGPIPE).
        const ssize_t w =
            send(fds[1 - i].fd, buffer + sent, static_cast<size_t>(n - sent), MSG_NOSIGNAL);
        if (w <= 0) {
          open = false;
          break;
        }
        sent += w;
      }
    }
    if (stopping_) break;
  }
  shutdown(a, SHUT_RDWR);
  shutdown(b, SHUT_RDWR);
  std::lock_guard<std::mutex> lock(mutex_);
  for (int fd : {a, b}) {
    sockets_.erase(std::remove(sockets_.begin(), sockets_.end(), fd), sockets_.end());
    close(fd);
  }
}

}  // namespace rlfleet::testing
