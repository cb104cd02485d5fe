package tessera;

import io.lettuce.core.RedisURI;
import io.lettuce.core.cluster.ClusterClientOptions;
import io.lettuce.core.cluster.ClusterTopologyRefreshOptions;
import io.lettuce.core.cluster.RedisClusterClient;
import io.lettuce.core.cluster.api.StatefulRedisClusterConnection;
import io.lettuce.core.cluster.api.sync.RedisAdvancedClusterCommands;
import java.time.Duration;
import java.util.ArrayList;
import java.util.HashMap;
import java.util.HashSet;
import java.util.List;
import java.util.Map;
import java.util.Random;
import java.util.Set;
import redis.clients.jedis.DefaultJedisClientConfig;
import redis.clients.jedis.HostAndPort;
import redis.clients.jedis.JedisCluster;

/**
 * The client workload of tests/clients (see README.md there) through a Java
 * cluster client: {@code Workload jedis|lettuce nodes seconds prefix}. Each
 * key keeps the values it may hold: those of its writes since the last one
 * known to have taken effect (a write that failed may have); a read outside
 * them is a violation, and so is a counter outside its bounds.
 */
public final class Workload {
    private static final int KEYS = 40;

    /** The commands the workload sends, whichever library sends them. */
    interface Client extends AutoCloseable {
        void set(String key, String value);

        String get(String key);

        long incr(String key);

        void hset(String key, String field, String value);

        Map<String, String> hgetall(String key);

        @Override
        void close();
    }

    static Client jedis(List<HostAndPort> nodes) {
        DefaultJedisClientConfig config =
                DefaultJedisClientConfig.builder().connectionTimeoutMillis(2000).socketTimeoutMillis(2000).build();
        JedisCluster cluster = new JedisCluster(new HashSet<>(nodes), config, 5);
        return new Client() {
            public void set(String key, String value) { cluster.set(key, value); }
            public String get(String key) { return cluster.get(key); }
            public long incr(String key) { return cluster.incr(key); }
            public void hset(String key, String field, String value) { cluster.hset(key, field, value); }
            public Map<String, String> hgetall(String key) { return cluster.hgetAll(key); }
            public void close() { cluster.close(); }
        };
    }

    static Client lettuce(List<HostAndPort> nodes) {
        List<RedisURI> uris = new ArrayList<>();
        for (HostAndPort node : nodes) {
            uris.add(RedisURI.builder()
                    .withHost(node.getHost())
                    .withPort(node.getPort())
                    .withTimeout(Duration.ofSeconds(2))
                    .build());
        }
        RedisClusterClient client = RedisClusterClient.create(uris);
        // Lettuce builds its view from CLUSTER NODES, again every second and
        // whenever a connection breaks or a MOVED arrives.
        client.setOptions(ClusterClientOptions.builder()
                .topologyRefreshOptions(ClusterTopologyRefreshOptions.builder()
                        .enablePeriodicRefresh(Duration.ofSeconds(1))
                        .enableAllAdaptiveRefreshTriggers()
                        .build())
                .build());
        StatefulRedisClusterConnection<String, String> connection = client.connect();
        RedisAdvancedClusterCommands<String, String> commands = connection.sync();
        return new Client() {
            public void set(String key, String value) { commands.set(key, value); }
            public String get(String key) { return commands.get(key); }
            public long incr(String key) { return commands.incr(key); }
            public void hset(String key, String field, String value) { commands.hset(key, field, value); }
            public Map<String, String> hgetall(String key) { return commands.hgetall(key); }
            public void close() {
                connection.close();
                client.shutdown();
            }
        };
    }

    private static String library;

    private static void fail(String message) {
        System.err.println(library + ": " + message);
        System.exit(1);
    }

    private static Set<String> only(String value) {
        Set<String> values = new HashSet<>();
        values.add(value);
        return values;
    }

    interface Read<T> {
        T run();
    }

    private static <T> T retry(long settle, Read<T> read) throws InterruptedException {
        while (true) {
            try {
                return read.run();
            } catch (RuntimeException error) {
                if (System.currentTimeMillis() > settle) {
                    fail("reading back: " + error);
                }
                Thread.sleep(100);
            }
        }
    }

    public static void main(String[] args) throws InterruptedException {
        library = args[0];
        List<HostAndPort> nodes = new ArrayList<>();
        for (String address : args[1].split(",")) {
            nodes.add(HostAndPort.from(address));
        }
        double seconds = Double.parseDouble(args[2]);
        String prefix = args.length > 3 ? args[3] : library;
        Client client = switch (library) {
            case "jedis" -> jedis(nodes);
            case "lettuce" -> lettuce(nodes);
            default -> throw new IllegalArgumentException("no such library: " + library);
        };

        List<Set<String>> values = new ArrayList<>();
        for (int i = 0; i < KEYS; i++) {
            values.add(only(null));
        }
        Map<String, Set<String>> fields = new HashMap<>();
        String counter = prefix + ":counter";
        String hash = prefix + ":hash";
        long counterLow = 0;
        long counterHigh = 0;
        long ops = 0;
        long failures = 0;
        Random random = new Random();

        long deadline = System.currentTimeMillis() + (long) (seconds * 1000);
        for (int sequence = 0; System.currentTimeMillis() < deadline; sequence++) {
            int i = random.nextInt(KEYS);
            String key = prefix + ":k:" + i;
            String value = Integer.toString(sequence);
            int choice = random.nextInt(10);
            String field = Integer.toString(i % 8);
            try {
                if (choice < 4) {
                    values.get(i).add(value);
                    client.set(key, value);
                    values.set(i, only(value));
                } else if (choice < 8) {
                    String got = client.get(key);
                    if (!values.get(i).contains(got)) {
                        fail("GET " + key + " = " + got + ", not one of " + values.get(i));
                    }
                    values.set(i, only(got));
                } else if (choice < 9) {
                    counterHigh += 1;
                    long got = client.incr(counter);
                    if (got < counterLow + 1 || got > counterHigh) {
                        fail("INCR " + counter + " = " + got + ", not within [" + (counterLow + 1) + ", " + counterHigh + "]");
                    }
                    counterLow = got;
                    counterHigh = got;
                } else {
                    fields.computeIfAbsent(field, unused -> only(null)).add(value);
                    client.hset(hash, field, value);
                    fields.put(field, only(value));
                }
            } catch (RuntimeException error) {
                failures += 1;
                Thread.sleep(20);
            }
            ops += 1;
        }

        // Everything read back once the cluster has settled, errors retried a while.
        long settle = System.currentTimeMillis() + 20_000;
        for (int i = 0; i < KEYS; i++) {
            String key = prefix + ":k:" + i;
            String got = retry(settle, () -> client.get(key));
            if (!values.get(i).contains(got)) {
                fail("at the end GET " + key + " = " + got + ", not one of " + values.get(i));
            }
        }
        String total = retry(settle, () -> client.get(counter));
        long counted = total == null ? 0 : Long.parseLong(total);
        if (counted < counterLow || counted > counterHigh) {
            fail("at the end " + counter + " = " + counted + ", not within [" + counterLow + ", " + counterHigh + "]");
        }
        Map<String, String> stored = retry(settle, () -> client.hgetall(hash));
        for (Map.Entry<String, Set<String>> entry : fields.entrySet()) {
            String got = stored.get(entry.getKey());
            if (!entry.getValue().contains(got)) {
                fail("at the end HGET " + hash + " " + entry.getKey() + " = " + got + ", not one of " + entry.getValue());
            }
        }
        System.out.println("{\"client\":\"" + library + "\",\"ops\":" + ops + ",\"errors\":" + failures + "}");
        client.close();
        System.exit(0);
    }
}
