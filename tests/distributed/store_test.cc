// The rendezvous store: set/get/add/wait across connections, its errors (a get's timeout, a
// taken port, an unreachable server, a refused hello), and liveness: a client that dies, one
// that declares itself lost, a server that goes.
#include "distributed/store.h"

#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <future>
#include <thread>

#include "distributed/test_ranks.h"
#include "test_util.h"

namespace kiln {
namespace {

using testing::client_options;

TEST(Store, SetGetAndWaitAcrossConnections) {
  StoreServer server("127.0.0.1", 0, 3);
  ASSERT_GT(server.port(), 0);
  Store a(client_options(server.port(), 0, 3));
  Store b(client_options(server.port(), 1, 3));
  // b's get waits for a's set.
  auto got = std::async(std::launch::async, [&] { return b.get("greeting"); });
  auto waited = std::async(std::launch::async, [&] {
    Store c(client_options(server.port(), 2, 3));
    c.wait({"x", "y"});
    return c.get("y");
  });
  a.set("x", "1");
  a.set("greeting", std::string("hello\0world", 11));
  EXPECT_EQ(got.get(), std::string("hello\0world", 11));
  a.set("y", "2");
  EXPECT_EQ(waited.get(), "2");
  a.set("greeting", "replaced");
  EXPECT_EQ(b.get("greeting"), "replaced");
  EXPECT_FALSE(a.lost_rank().has_value());
}

TEST(Store, AddIsAtomicAcrossConnections) {
  StoreServer server("127.0.0.1", 0, 3);
  std::vector<std::thread> threads;
  for (int rank = 0; rank < 3; ++rank) {
    threads.emplace_back([&, rank] {
      Store store(client_options(server.port(), rank, 3));
      for (int i = 0; i < 20; ++i) store.add("counter", rank + 1);
    });
  }
  for (std::thread& t : threads) t.join();
  Store store(client_options(server.port(), 0, 3));
  EXPECT_EQ(store.get("counter"), std::to_string(20 * (1 + 2 + 3)));
  EXPECT_EQ(store.add("counter", -120), 0);
  store.set("text", "abc");
  EXPECT_KILN_ERROR(store.add("text", 1), "store key 'text' holds 'abc', not a counter");
}

TEST(Store, GetTimesOutNamingTheKeyAndTheWait) {
  StoreServer server("127.0.0.1", 0, 1);
  Store store(client_options(server.port(), 0, 1));
  EXPECT_KILN_ERROR(store.get("missing", 200ms), "no key 'missing' after 0.2 s");
  // The connection stays usable after a timeout.
  store.set("present", "v");
  EXPECT_EQ(store.get("present", 0ms), "v");
}

TEST(Store, TakenPortIsOneClearLine) {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)), 0);
  ASSERT_EQ(::listen(fd, 1), 0);
  socklen_t length = sizeof(address);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length);
  int port = ntohs(address.sin_port);
  EXPECT_KILN_ERROR(StoreServer("127.0.0.1", port, 2),
                    fmt::format("MASTER_PORT {} on 127.0.0.1 is taken", port));
  ::close(fd);
}

TEST(Store, UnreachableServerFailsAfterTheTimeout) {
  int port = testing::unused_port();
  StoreOptions options = client_options(port, 1, 2);
  options.timeout = 300ms;
  EXPECT_KILN_ERROR(Store{options},
                    fmt::format("cannot reach the rendezvous at 127.0.0.1:{} after 0.3 s (is rank 0 running?", port));
}

TEST(Store, RefusesAWrongWorldSizeAndARankThatJoinsTwice) {
  StoreServer server("127.0.0.1", 0, 2);
  EXPECT_KILN_ERROR(Store(client_options(server.port(), 1, 3)),
                    "rank 1 says WORLD_SIZE=3 but the rendezvous at 127.0.0.1:", "serves WORLD_SIZE=2");
  Store first(client_options(server.port(), 1, 2));
  EXPECT_KILN_ERROR(Store(client_options(server.port(), 1, 2)), "rank 1 joined the rendezvous",
                    "twice (were two processes started with RANK=1?)");
  StoreOptions other = client_options(server.port(), 1, 2);
  other.connection = "watchdog";
  Store second_connection(other);  // another connection of the same rank is fine
  // Neither refusal counts as a lost rank.
  EXPECT_FALSE(first.lost_rank().has_value());
}

TEST(Store, ACleanGoodbyeIsNoLoss) {
  StoreServer server("127.0.0.1", 0, 2);
  Store a(client_options(server.port(), 0, 2));
  { Store b(client_options(server.port(), 1, 2)); }
  EXPECT_FALSE(a.lost_rank().has_value());
}

TEST(Store, AKilledClientIsLostForEveryBlockedGet) {
  testing::ChildRank child([](int port, const std::function<void()>& ready) {
    Store store(client_options(port, 1, 3));
    ready();
    ::pause();
  });
  StoreServer server("127.0.0.1", 0, 3);
  child.start(server.port());
  child.wait_ready();
  Store watcher(client_options(server.port(), 0, 3));
  Store blocked(client_options(server.port(), 2, 3));
  auto waiting = std::async(std::launch::async, [&] {
    return testing::error_of([&] { blocked.get("never set", 30s); });
  });
  child.kill();
  std::string message = waiting.get();
  // The 30 s timeout did not run out: the server answered as soon as rank 1 dropped.
  EXPECT_NE(message.find("waiting for store key 'never set': rank 1 was lost (its connection to "
                         "the store closed without a goodbye)"), std::string::npos) << message;
  EXPECT_EQ(watcher.lost_rank(), 1);
  EXPECT_EQ(watcher.lost_reason(), "its connection to the store closed without a goodbye");
  EXPECT_EQ(blocked.lost_rank(), 1);
  // Keys that are set still read.
  watcher.set("k", "v");
  EXPECT_EQ(blocked.get("k"), "v");
}

TEST(Store, ADeclaredLossReachesTheOthersWithItsReason) {
  StoreServer server("127.0.0.1", 0, 3);
  Store blocked(client_options(server.port(), 0, 3));
  auto waiting = std::async(std::launch::async, [&] {
    return testing::error_of([&] { blocked.get("never set", 30s); });
  });
  Store leaving(client_options(server.port(), 2, 3));
  leaving.declare_lost("it ran out of memory");
  EXPECT_NE(waiting.get().find("rank 2 was lost (it ran out of memory)"), std::string::npos);
  EXPECT_EQ(blocked.lost_rank(), 2);
  // Once a rank is lost, a get of a key nobody set fails at once, as a LostRankError.
  try {
    blocked.get("also never set", 30s);
    ADD_FAILURE() << "no error";
  } catch (const LostRankError& e) {
    EXPECT_EQ(e.rank(), 2);
  }
}

TEST(Store, TheServerGoingIsRankZeroLost) {
  auto server = std::make_unique<StoreServer>("127.0.0.1", 0, 2);
  server->set_shutdown_timeout(0ms);
  Store client(client_options(server->port(), 1, 2));
  auto waiting = std::async(std::launch::async, [&] {
    return testing::error_of([&] { client.get("never set", 30s); });
  });
  // Let the get reach the server before it goes (either way the client must see rank 0 lost).
  std::this_thread::sleep_for(50ms);
  server.reset();
  EXPECT_NE(waiting.get().find("rank 0 was lost (the rendezvous store at 127.0.0.1:"),
            std::string::npos);
  EXPECT_EQ(client.lost_rank(), 0);
  EXPECT_KILN_ERROR(client.set("k", "v"), "rank 0 was lost");
}

}  // namespace
}  // namespace kiln
