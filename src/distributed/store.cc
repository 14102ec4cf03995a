// The rendezvous store's server and client (distributed/store.h).
#include "distributed/store.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstring>
#include <list>
#include <map>
#include <string_view>

#include "support/error.h"

namespace kiln {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

enum Op : uint8_t {
  // requests
  kHello = 1,  // magic, rank, world size, connection name
  kSet,        // key, value
  kGet,        // key, wait in ms (0: answer at once)
  kAdd,        // key, delta
  kBye,
  kDeclareLost,  // reason
  // replies
  kOk = 100,
  kValue,    // value
  kTimeout,  // the key was not set within the wait
  kLost,     // rank, reason
  kRefused,  // message
};

constexpr std::string_view kMagic = "kiln-store-1";
constexpr uint32_t kMaxFrame = 1u << 30;
const std::string kLostKey = "kiln/lost";
const std::string kDroppedReason = "its connection to the store closed without a goodbye";
// How much longer than a get's own wait a client waits for the server's answer: the server
// answers at the deadline, so this only matters when its process has stopped answering at all.
constexpr milliseconds kReplyGrace = 10s;

std::string errno_text(int error) { return std::strerror(error); }

// A frame under construction: a length placeholder, the opcode, the fields.
class Writer {
 public:
  explicit Writer(Op op) : bytes_(4, '\0') { bytes_.push_back(static_cast<char>(op)); }
  Writer& i64(int64_t value) {
    for (int i = 0; i < 8; ++i) bytes_.push_back(static_cast<char>(uint64_t(value) >> (8 * i)));
    return *this;
  }
  Writer& str(std::string_view text) {
    i64(static_cast<int64_t>(text.size()));
    bytes_.append(text);
    return *this;
  }
  std::string done() {
    uint32_t length = static_cast<uint32_t>(bytes_.size() - 4);
    for (int i = 0; i < 4; ++i) bytes_[i] = static_cast<char>(length >> (8 * i));
    return std::move(bytes_);
  }

 private:
  std::string bytes_;
};

// Reads a frame's payload; a short or inconsistent one throws kiln::Error.
class Reader {
 public:
  explicit Reader(std::string_view payload) : rest_(payload) {}
  uint8_t op() { return static_cast<uint8_t>(take(1)[0]); }
  int64_t i64() {
    std::string_view bytes = take(8);
    uint64_t value = 0;
    for (int i = 0; i < 8; ++i) value |= uint64_t(static_cast<uint8_t>(bytes[i])) << (8 * i);
    return static_cast<int64_t>(value);
  }
  std::string str() {
    int64_t size = i64();
    KILN_CHECK(size >= 0 && uint64_t(size) <= rest_.size(), "malformed store message");
    return std::string(take(static_cast<size_t>(size)));
  }

 private:
  std::string_view take(size_t n) {
    KILN_CHECK(n <= rest_.size(), "malformed store message");
    std::string_view out = rest_.substr(0, n);
    rest_.remove_prefix(n);
    return out;
  }
  std::string_view rest_;
};

// Removes one whole frame from the front of `inbox` and returns its payload, or nullopt while
// the frame is incomplete.
std::optional<std::string> take_frame(std::string& inbox) {
  if (inbox.size() < 4) return std::nullopt;
  uint32_t length = 0;
  for (int i = 0; i < 4; ++i) length |= uint32_t(static_cast<uint8_t>(inbox[i])) << (8 * i);
  KILN_CHECK(length >= 1 && length <= kMaxFrame, "malformed store message (length {})", length);
  if (inbox.size() < 4 + size_t(length)) return std::nullopt;
  std::string payload = inbox.substr(4, length);
  inbox.erase(0, 4 + size_t(length));
  return payload;
}

bool send_all(int fd, std::string_view bytes) {
  while (!bytes.empty()) {
    ssize_t sent = ::send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL);
    if (sent < 0 && errno == EINTR) continue;
    if (sent <= 0) return false;
    bytes.remove_prefix(static_cast<size_t>(sent));
  }
  return true;
}

// Appends what the socket has to `inbox`: the byte count, 0 at the peer's end, -1 on an error.
ssize_t receive_some(int fd, std::string& inbox) {
  char buffer[64 * 1024];
  ssize_t got;
  do got = ::recv(fd, buffer, sizeof(buffer), MSG_DONTWAIT);
  while (got < 0 && errno == EINTR);
  if (got > 0) inbox.append(buffer, static_cast<size_t>(got));
  if (got < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return 1;  // nothing yet: not an end
  return got;
}

int remaining_ms(Clock::time_point deadline) {
  auto left = std::chrono::ceil<milliseconds>(deadline - Clock::now()).count();
  return static_cast<int>(std::clamp<int64_t>(left, 0, 1 << 30));
}

void close_fd(int& fd) {
  if (fd >= 0) ::close(fd);
  fd = -1;
}

// A connected socket to host:port, or -1 with `error` saying why not.
int try_connect(const std::string& host, int port, Clock::time_point deadline, std::string& error) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  int status = ::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &found);
  if (status != 0) {
    error = fmt::format("cannot resolve '{}': {}", host, ::gai_strerror(status));
    return -1;
  }
  int fd = -1;
  for (addrinfo* a = found; a != nullptr && fd < 0; a = a->ai_next) {
    fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, a->ai_protocol);
    if (fd < 0) {
      error = errno_text(errno);
      continue;
    }
    // Non-blocking, so that an address that drops packets costs no more than the deadline.
    int result = ::connect(fd, a->ai_addr, a->ai_addrlen);
    if (result < 0 && errno == EINPROGRESS) {
      pollfd p{fd, POLLOUT, 0};
      int ready;
      do ready = ::poll(&p, 1, remaining_ms(deadline));
      while (ready < 0 && errno == EINTR);
      int socket_error = ready > 0 ? 0 : ETIMEDOUT;
      socklen_t length = sizeof(socket_error);
      if (ready > 0) ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &socket_error, &length);
      result = socket_error == 0 ? 0 : -1;
      errno = socket_error;
    }
    if (result < 0) {
      error = errno_text(errno);
      close_fd(fd);
    }
  }
  ::freeaddrinfo(found);
  if (fd >= 0) {
    ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) & ~O_NONBLOCK);
    int on = 1;
    ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &on, sizeof(on));
  }
  return fd;
}

// "<rank> <reason>", the value of kLostKey.
std::pair<int, std::string> parse_lost(const std::string& value) {
  int rank = -1;
  auto [end, error] = std::from_chars(value.data(), value.data() + value.size(), rank);
  std::string reason = end < value.data() + value.size() ? std::string(end + 1, value.data() + value.size()) : "";
  return {error == std::errc() ? rank : 0, reason};
}

}  // namespace

std::string format_seconds(milliseconds duration) {
  return fmt::format("{:g} s", static_cast<double>(duration.count()) / 1000.0);
}

// ------------------------------------------------------------------------------------------
// The server

struct StoreServer::State {
  struct Client {
    int fd = -1;
    std::string inbox;
    int rank = -1;  // after its hello
    std::string connection;
    bool said_bye = false;
    bool closing = false;  // to be closed after this round (a goodbye, a refusal, an error)
    std::optional<std::string> waiting_for;  // a parked get's key
    Clock::time_point deadline;
  };

  std::string host;
  int port = 0;
  int world_size = 1;
  std::list<Client> clients;
  std::map<std::string, std::string> data;
  int lost = -1;

  void reply(Client& client, std::string frame) {
    if (!send_all(client.fd, frame)) client.closing = true;
  }

  // Answers the gets parked on `key`.
  void set(const std::string& key, std::string value) {
    std::string& stored = data[key] = std::move(value);
    for (Client& c : clients) {
      if (c.waiting_for == key) {
        c.waiting_for.reset();
        reply(c, Writer(kValue).str(stored).done());
      }
    }
  }

  void mark_lost(int rank, const std::string& reason) {
    if (lost >= 0) return;
    lost = rank;
    set(kLostKey, fmt::format("{} {}", rank, reason));
    for (Client& c : clients) {
      if (c.waiting_for) {
        c.waiting_for.reset();
        reply(c, Writer(kLost).i64(rank).str(reason).done());
      }
    }
  }

  void handle(Client& client, const std::string& payload) {
    Reader in(payload);
    uint8_t op = in.op();
    if (op == kHello) {
      std::string magic = in.str();
      int64_t rank = in.i64(), world = in.i64();
      std::string connection = in.str();
      std::string refusal;
      if (magic != kMagic) {
        refusal = fmt::format("a client of another protocol ('{}') reached the kiln store", magic);
      } else if (world != world_size) {
        refusal = fmt::format("rank {} says WORLD_SIZE={} but the rendezvous at {}:{} serves "
                              "WORLD_SIZE={} (were the ranks started with different WORLD_SIZE?)",
                              rank, world, host, port, world_size);
      } else if (rank < 0 || rank >= world_size) {
        refusal = fmt::format("rank {} is not a rank of WORLD_SIZE={}", rank, world_size);
      } else {
        for (const Client& c : clients) {
          if (&c != &client && !c.closing && c.rank == rank && c.connection == connection)
            refusal = fmt::format("rank {} joined the rendezvous at {}:{} twice (were two processes "
                                  "started with RANK={}?)", rank, host, port, rank);
        }
      }
      if (!refusal.empty()) {
        reply(client, Writer(kRefused).str(refusal).done());
        client.closing = true;
        return;
      }
      client.rank = static_cast<int>(rank);
      client.connection = connection;
      reply(client, Writer(kOk).done());
      return;
    }
    if (client.rank < 0) {
      reply(client, Writer(kRefused).str("a store request came before the hello").done());
      client.closing = true;
      return;
    }
    switch (op) {
      case kSet: {
        std::string key = in.str();
        std::string value = in.str();
        reply(client, Writer(kOk).done());
        set(key, std::move(value));
        return;
      }
      case kGet: {
        std::string key = in.str();
        int64_t wait_ms = in.i64();
        if (auto it = data.find(key); it != data.end()) {
          reply(client, Writer(kValue).str(it->second).done());
        } else if (lost >= 0) {
          auto [rank, reason] = parse_lost(data[kLostKey]);
          reply(client, Writer(kLost).i64(rank).str(reason).done());
        } else if (wait_ms <= 0) {
          reply(client, Writer(kTimeout).done());
        } else {
          client.waiting_for = key;
          client.deadline = Clock::now() + milliseconds(wait_ms);
        }
        return;
      }
      case kAdd: {
        std::string key = in.str();
        int64_t delta = in.i64();
        int64_t value = 0;
        if (auto it = data.find(key); it != data.end()) {
          const std::string& text = it->second;
          auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value);
          if (error != std::errc() || end != text.data() + text.size()) {
            reply(client, Writer(kRefused)
                              .str(fmt::format("store key '{}' holds '{}', not a counter", key, text))
                              .done());
            return;
          }
        }
        std::string text = std::to_string(value + delta);
        reply(client, Writer(kValue).str(text).done());
        set(key, text);
        return;
      }
      case kDeclareLost:
        mark_lost(client.rank, in.str());
        reply(client, Writer(kOk).done());
        return;
      case kBye:
        client.said_bye = true;
        reply(client, Writer(kOk).done());
        client.closing = true;
        return;
      default:
        fail("unknown store request {}", op);
    }
  }

  // Closes a client; one with a rank that left without a goodbye is lost.
  void drop(Client& client) {
    close_fd(client.fd);
    if (client.rank >= 0 && !client.said_bye) mark_lost(client.rank, kDroppedReason);
  }
};

StoreServer::StoreServer(const std::string& host, int port, int world_size)
    : state_(std::make_unique<State>()) {
  KILN_CHECK(port >= 0 && port <= 65535, "MASTER_PORT={} is not a TCP port", port);
  state_->host = host;
  state_->world_size = world_size;
  // Every interface, IPv6 and IPv4 in one socket where the kernel has IPv6 (the other machines
  // reach MASTER_ADDR on whichever interface it names).
  int fd = ::socket(AF_INET6, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_storage address{};
  socklen_t length;
  if (fd >= 0) {
    int off = 0;
    ::setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &off, sizeof(off));
    auto* a6 = reinterpret_cast<sockaddr_in6*>(&address);
    a6->sin6_family = AF_INET6;
    a6->sin6_addr = in6addr_any;
    a6->sin6_port = htons(static_cast<uint16_t>(port));
    length = sizeof(sockaddr_in6);
  } else {
    fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    KILN_CHECK(fd >= 0, "cannot open a socket for the rendezvous: {}", errno_text(errno));
    auto* a4 = reinterpret_cast<sockaddr_in*>(&address);
    a4->sin_family = AF_INET;
    a4->sin_addr.s_addr = htonl(INADDR_ANY);
    a4->sin_port = htons(static_cast<uint16_t>(port));
    length = sizeof(sockaddr_in);
  }
  listen_fd_ = fd;
  // A port whose last job's connections linger in TIME_WAIT is free; one with a listener is not.
  int on = 1;
  ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &on, sizeof(on));
  if (::bind(fd, reinterpret_cast<sockaddr*>(&address), length) < 0 || ::listen(fd, SOMAXCONN) < 0) {
    int error = errno;
    close_fd(listen_fd_);
    if (error == EADDRINUSE)
      fail("MASTER_PORT {} on {} is taken: {} (another job on this machine? choose another "
           "MASTER_PORT)", port, host, errno_text(error));
    fail("cannot serve the rendezvous on port {} of {}: {}", port, host, errno_text(error));
  }
  length = sizeof(address);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length);
  port_ = ntohs(address.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&address)->sin6_port
                                              : reinterpret_cast<sockaddr_in*>(&address)->sin_port);
  state_->port = port_;
  if (::pipe2(wake_pipe_, O_CLOEXEC | O_NONBLOCK) < 0) {
    close_fd(listen_fd_);
    fail("cannot create the rendezvous server's pipe: {}", errno_text(errno));
  }
  thread_ = std::thread([this] { serve(); });
}

StoreServer::~StoreServer() {
  stopping_ = true;
  char byte = 0;
  [[maybe_unused]] ssize_t ignored = ::write(wake_pipe_[1], &byte, 1);
  thread_.join();
  close_fd(listen_fd_);
  close_fd(wake_pipe_[0]);
  close_fd(wake_pipe_[1]);
}

void StoreServer::serve() {
  State& s = *state_;
  std::optional<Clock::time_point> shutdown_deadline;
  std::vector<pollfd> fds;
  for (;;) {
    if (stopping_ && !shutdown_deadline) shutdown_deadline = Clock::now() + shutdown_timeout_;
    if (shutdown_deadline && (s.clients.empty() || Clock::now() >= *shutdown_deadline)) break;

    fds.assign({{wake_pipe_[0], POLLIN, 0}, {listen_fd_, POLLIN, 0}});
    std::optional<Clock::time_point> next = shutdown_deadline;
    for (const State::Client& c : s.clients) {
      fds.push_back({c.fd, POLLIN, 0});
      if (c.waiting_for && (!next || c.deadline < *next)) next = c.deadline;
    }
    int ready = ::poll(fds.data(), fds.size(), next ? remaining_ms(*next) : -1);
    if (ready < 0 && errno != EINTR) break;  // cannot happen with valid descriptors

    if (fds[0].revents) {
      char drain[64];
      while (::read(wake_pipe_[0], drain, sizeof(drain)) > 0) {}
    }
    if (fds[1].revents & POLLIN) {
      int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
      if (fd >= 0) {
        int on = 1;
        ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &on, sizeof(on));
        s.clients.push_back({});
        s.clients.back().fd = fd;
      }
    }
    size_t index = 2;
    for (State::Client& c : s.clients) {
      if (index >= fds.size() || fds[index++].fd != c.fd || c.closing) continue;
      if (!(fds[index - 1].revents & (POLLIN | POLLHUP | POLLERR))) continue;
      if (receive_some(c.fd, c.inbox) <= 0) {
        c.closing = true;
        continue;
      }
      try {
        while (!c.closing) {
          std::optional<std::string> payload = take_frame(c.inbox);
          if (!payload) break;
          s.handle(c, *payload);
        }
      } catch (const std::exception&) {
        c.closing = true;  // a malformed message (this is no kiln client), or out of memory
      }
    }
    Clock::time_point now = Clock::now();
    for (State::Client& c : s.clients) {
      if (c.waiting_for && c.deadline <= now && !c.closing) {
        c.waiting_for.reset();
        s.reply(c, Writer(kTimeout).done());
      }
    }
    // Dropping may mark a rank lost, which answers the others' parked gets: so one at a time,
    // each removed before the next is looked at.
    for (auto it = s.clients.begin(); it != s.clients.end();) {
      if (!it->closing) {
        ++it;
        continue;
      }
      State::Client gone = std::move(*it);
      it = s.clients.erase(it);
      s.drop(gone);
      it = s.clients.begin();
    }
  }
  for (State::Client& c : s.clients) close_fd(c.fd);
  s.clients.clear();
}

// ------------------------------------------------------------------------------------------
// The client

struct Store::Reply {
  uint8_t op = 0;
  std::string text;  // kValue's value, kLost's reason, kRefused's message
  int rank = -1;     // kLost's
};

Store::Store(StoreOptions options) : options_(std::move(options)) {
  auto deadline = Clock::now() + options_.timeout;
  std::string error = "no attempt";
  milliseconds pause = 20ms;
  for (;;) {
    fd_ = try_connect(options_.host, options_.port, deadline, error);
    if (fd_ >= 0 || Clock::now() >= deadline) break;
    std::this_thread::sleep_for(std::min<Clock::duration>(pause, deadline - Clock::now()));
    pause = std::min<milliseconds>(pause * 2, 1s);
  }
  KILN_CHECK(fd_ >= 0,
             "cannot reach the rendezvous at {}:{} after {} (is rank 0 running? are MASTER_ADDR "
             "and MASTER_PORT right?): {}",
             options_.host, options_.port, format_seconds(options_.timeout), error);

  sockaddr_storage address{};
  socklen_t length = sizeof(address);
  char text[INET6_ADDRSTRLEN] = "";
  if (::getsockname(fd_, reinterpret_cast<sockaddr*>(&address), &length) == 0) {
    const void* raw = address.ss_family == AF_INET6
                          ? static_cast<const void*>(&reinterpret_cast<sockaddr_in6*>(&address)->sin6_addr)
                          : static_cast<const void*>(&reinterpret_cast<sockaddr_in*>(&address)->sin_addr);
    ::inet_ntop(address.ss_family, raw, text, sizeof(text));
  }
  local_address_ = text;

  Reply reply;
  try {
    reply = request(Writer(kHello)
                        .str(kMagic)
                        .i64(options_.rank)
                        .i64(options_.world_size)
                        .str(options_.connection)
                        .done(),
                    options_.timeout, "joining the rendezvous");
  } catch (const Error&) {
    close_fd(fd_);
    throw;
  }
  if (reply.op != kOk) {
    close_fd(fd_);
    fail("{}", reply.op == kRefused ? reply.text
                                     : fmt::format("the rendezvous at {}:{} is not a kiln store",
                                                   options_.host, options_.port));
  }
}

Store::~Store() {
  if (fd_ < 0) return;
  bool usable;
  {
    std::lock_guard lock(mutex_);
    usable = !broken_;
  }
  try {
    if (usable) request(Writer(kBye).done(), 2s, "saying goodbye");
  } catch (const Error&) {
    // The server is gone already: there is no one to tell.
  }
  close_fd(fd_);
}

Store::Reply Store::request(const std::string& frame, milliseconds wait, const char* what) {
  std::lock_guard lock(mutex_);
  if (broken_) throw_lost(what);
  auto deadline = Clock::now() + wait;
  auto dropped = [&] {
    broken_ = true;
    record_lost(0, fmt::format("the rendezvous store at {}:{} closed the connection",
                               options_.host, options_.port));
    throw_lost(what);
  };
  if (!send_all(fd_, frame)) dropped();
  std::string inbox;
  for (;;) {
    std::optional<std::string> payload;
    try {
      payload = take_frame(inbox);
    } catch (const Error&) {
      broken_ = true;
      fail("{}: the rendezvous at {}:{} answered with something that is not a kiln store's "
           "message", what, options_.host, options_.port);
    }
    if (payload) {
      Reply reply;
      try {
        Reader in(*payload);
        reply.op = in.op();
        if (reply.op == kValue || reply.op == kRefused) reply.text = in.str();
        if (reply.op == kLost) {
          reply.rank = static_cast<int>(in.i64());
          reply.text = in.str();
        }
      } catch (const Error&) {
        broken_ = true;
        fail("{}: the rendezvous at {}:{} sent a malformed message", what, options_.host,
             options_.port);
      }
      return reply;
    }
    pollfd p{fd_, POLLIN, 0};
    int ready = ::poll(&p, 1, remaining_ms(deadline));
    if (ready < 0 && errno == EINTR) continue;
    if (ready == 0) {
      broken_ = true;
      fail("{}: the rendezvous store at {}:{} did not answer within {}", what, options_.host,
           options_.port, format_seconds(wait));
    }
    if (receive_some(fd_, inbox) <= 0) dropped();
  }
}

void Store::record_lost(int rank, const std::string& reason) {
  std::lock_guard lock(reason_mutex_);
  if (lost_ >= 0) return;
  lost_reason_ = reason;
  lost_ = rank;
}

std::string Store::lost_reason() const {
  std::lock_guard lock(reason_mutex_);
  return lost_reason_;
}

void Store::throw_lost(const std::string& doing) const {
  int rank = lost_.load();
  throw LostRankError(rank, fmt::format("{}: rank {} was lost ({})", doing, rank, lost_reason()));
}

void Store::set(const std::string& key, const std::string& value) {
  Reply reply = request(Writer(kSet).str(key).str(value).done(), options_.timeout,
                        "setting a store key");
  KILN_CHECK(reply.op == kOk, "setting store key '{}': {}", key, reply.text);
}

std::string Store::get(const std::string& key, milliseconds timeout) {
  timeout = std::max(timeout, 0ms);
  std::string doing = fmt::format("waiting for store key '{}'", key);
  Reply reply = request(Writer(kGet).str(key).i64(timeout.count()).done(), timeout + kReplyGrace,
                        doing.c_str());
  switch (reply.op) {
    case kValue: return reply.text;
    case kTimeout:
      fail("the rendezvous store has no key '{}' after {} (a rank that should set it is slow, "
           "stuck or gone)", key, format_seconds(timeout));
    case kLost:
      record_lost(reply.rank, reply.text);
      throw_lost(doing);
    default: fail("{}: {}", doing, reply.text);
  }
}

int64_t Store::add(const std::string& key, int64_t delta) {
  Reply reply = request(Writer(kAdd).str(key).i64(delta).done(), options_.timeout,
                        "adding to a store counter");
  KILN_CHECK(reply.op == kValue, "{}", reply.text);
  int64_t value = 0;
  std::from_chars(reply.text.data(), reply.text.data() + reply.text.size(), value);
  return value;
}

void Store::wait(const std::vector<std::string>& keys, milliseconds timeout) {
  auto deadline = Clock::now() + timeout;
  for (const std::string& key : keys)
    get(key, std::chrono::duration_cast<milliseconds>(deadline - Clock::now()));
}

void Store::declare_lost(const std::string& reason) noexcept {
  try {
    request(Writer(kDeclareLost).str(reason).done(), options_.timeout, "leaving the job");
  } catch (...) {
    // The server is gone: the others learn of it through rank 0.
  }
}

std::optional<int> Store::lost_rank() {
  if (lost_ >= 0) return lost_.load();
  try {
    Reply reply = request(Writer(kGet).str(kLostKey).i64(0).done(), options_.timeout,
                          "asking the store for a lost rank");
    if (reply.op == kValue) {
      auto [rank, reason] = parse_lost(reply.text);
      record_lost(rank, reason);
    } else if (reply.op == kLost) {
      record_lost(reply.rank, reply.text);
    }
  } catch (const Error&) {
    // A dropped connection recorded rank 0; a server that does not answer tells nothing.
  }
  if (lost_ >= 0) return lost_.load();
  return std::nullopt;
}

}  // namespace kiln
