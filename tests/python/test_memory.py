"""maxmemory and its policies, side by side with a real redis-server given the
same limit: the same refusal, reads and deletes still served, and eviction
that keeps what is used (allkeys-lru) or what does not expire (volatile-*)."""

import pytest
import redis

from conftest import Node

LIMIT = 30 << 20
VALUE = b"v" * 1000


@pytest.fixture
def pair(data_dir, redis_server, request):
    """A Tessera node and a redis-server, both at maxmemory LIMIT under the
    policy the test is parametrised with."""
    policy = request.param
    node = Node(data_dir, "--maxmemory", "30mb", "--maxmemory-policy", policy).start()
    reference = redis.Redis(port=redis_server)
    reference.config_set("maxmemory", LIMIT)
    reference.config_set("maxmemory-policy", policy)
    yield node.client(), reference
    node.stop()


def fill_until_refused(client, prefix, most=200_000):
    """SETs of 1 KB values until the server refuses one: how many it took, and the error."""
    for index in range(most):
        try:
            client.set(f"{prefix}{index}", VALUE)
        except redis.ResponseError as error:
            return index, str(error)
    return most, None


@pytest.mark.parametrize("pair", ["noeviction"], indirect=True)
def test_noeviction_refuses_writes_as_redis_does_and_keeps_serving_reads(pair):
    tessera, reference = pair
    results = {name: fill_until_refused(client, "k") for name, client in (("tessera", tessera), ("redis", reference))}
    (stored, error), (redis_stored, redis_error) = results["tessera"], results["redis"]
    assert error == redis_error == "command not allowed when used memory > 'maxmemory'."
    # The same limit holds about as many 1 KB values (per-key overheads differ a little).
    assert 0.8 * redis_stored <= stored <= 1.2 * redis_stored, results
    for client in (tessera, reference):
        assert client.get("k1") == VALUE, "reads are served past the limit"
        assert client.exists("k2") == 1
        with pytest.raises(redis.ResponseError, match="OOM|maxmemory"):
            client.append("k3", VALUE * 10)
        assert client.delete("k1") == 1, "deletes are served past the limit"
    memory = tessera.info("memory")
    assert memory["maxmemory"] == LIMIT and memory["maxmemory_policy"] == "noeviction"
    assert memory["used_memory"] <= LIMIT * 1.01
    # The whole process, not only what the counter sees, stays near the budget.
    assert memory["used_memory_rss"] < LIMIT + (32 << 20), memory
    assert tessera.config_get("maxmemory") == reference.config_get("maxmemory")


def lru_workload(client):
    """2,000 hot keys read throughout while 60,000 cold ones are written:
    how many hot keys are still there."""
    hot = [f"hot{index}" for index in range(2000)]
    for key in hot:
        client.set(key, VALUE)
    pipe = client.pipeline(transaction=False)
    for index in range(60_000):
        pipe.set(f"cold{index}", VALUE)
        if index % 100 == 0:
            start = (index // 100) % 20 * 100
            for key in hot[start:start + 100]:
                pipe.get(key)
        if len(pipe) > 500:
            pipe.execute()
    pipe.execute()
    return sum(client.exists(key) for key in hot)


@pytest.mark.parametrize("pair", ["allkeys-lru"], indirect=True)
def test_allkeys_lru_evicts_what_is_not_used_at_least_as_well_as_redis(pair):
    tessera, reference = pair
    kept, redis_kept = lru_workload(tessera), lru_workload(reference)
    info = tessera.info()
    print(f"hot keys kept: tessera {kept} of 2000, redis {redis_kept}; tessera evicted {info['evicted_keys']}")
    assert info["evicted_keys"] > 30_000
    assert info["used_memory"] <= LIMIT * 1.01
    assert kept >= 0.9 * redis_kept and kept >= 1000, (kept, redis_kept)


@pytest.mark.parametrize("pair", ["volatile-ttl"], indirect=True)
def test_volatile_ttl_evicts_the_nearest_expiry_and_never_a_persistent_key(pair):
    tessera, reference = pair
    for client in (tessera, reference):
        for index in range(5000):
            client.set(f"keep{index}", VALUE)
        # Expiring keys, the later ones with the longer time to live.
        for index in range(40_000):
            client.set(f"ttl{index}", VALUE, ex=1000 + index)
        assert all(client.exists(f"keep{index}") for index in range(0, 5000, 50)), "persistent keys stay"
        early = sum(client.exists(f"ttl{index}") for index in range(0, 5000, 10))
        late = sum(client.exists(f"ttl{index}") for index in range(35_000, 40_000, 10))
        assert late > early, (client, early, late)
        # With nothing left that may expire, writes are refused.
        client.delete(*[f"ttl{index}" for index in range(40_000)])
        stored, error = fill_until_refused(client, "more")
        assert error == "command not allowed when used memory > 'maxmemory'.", error
    assert tessera.info()["evicted_keys"] > 0


def test_clients_holding_partial_requests_share_one_query_buffer_budget(data_dir):
    """Twenty clients each start a 60 MiB SET and stop half-way: past the
    node's 64 MiB budget for unparsed input, those growing their buffers are
    closed with an error, the node stays small, and other clients are served."""
    import socket
    import time

    node = Node(data_dir, "--bulk-bytes-max", str(64 << 20), "--query-buffer-bytes-max", str(64 << 20),
                "--query-buffer-budget", str(64 << 20)).start()
    try:
        client = node.client()
        header = b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$" + str(60 << 20).encode() + b"\r\n"
        chunk = b"x" * (1 << 20)
        sockets = []
        for _ in range(20):
            sock = socket.create_connection(("127.0.0.1", node.port))
            sock.settimeout(10)
            sock.sendall(header)
            sockets.append(sock)
        closed = []
        for sock in sockets:
            try:
                for _ in range(30):
                    sock.sendall(chunk)
            except OSError:
                pass
        time.sleep(0.5)
        for sock in sockets:
            sock.settimeout(0.2)
            try:
                answer = sock.recv(200)
            except socket.timeout:
                continue
            except OSError:
                answer = b""
            closed.append(answer)
        assert closed, "some clients were closed"
        assert any(b"query_buffer_budget" in answer for answer in closed), closed[:3]
        assert len(closed) < 20, "the first clients, within the budget, are kept"
        memory = client.info("memory")
        assert memory["used_memory_rss"] < (64 << 20) + (96 << 20), memory["used_memory_rss_human"]
        assert client.set("small", "ok") and client.get("small") == b"ok"
        for sock in sockets:
            sock.close()
        # With the buffers given back, one large value fits again.
        deadline = time.time() + 5
        while True:
            try:
                assert client.set("large", b"y" * (50 << 20))
                break
            except redis.ConnectionError:
                assert time.time() < deadline
                time.sleep(0.2)
        assert client.strlen("large") == 50 << 20
    finally:
        node.stop()
