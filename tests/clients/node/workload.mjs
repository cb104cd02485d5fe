// The client workload of tests/clients (see README.md there) through a
// Node.js cluster client: `node workload.mjs ioredis|node-redis nodes seconds prefix`.
// Each key keeps the values it may hold: those of its writes since the last
// one known to have taken effect (a write that failed may have); a read
// outside them is a violation, and so is a counter outside its bounds.
import { Cluster } from "ioredis";
import { createCluster } from "redis";

const [library, nodeList = "127.0.0.1:7001", secondsText = "8", prefix = library] = process.argv.slice(2);
const nodes = nodeList.split(",").map((address) => {
  const [host, port] = address.split(":");
  return { host, port: Number(port) };
});
const KEYS = 40;
const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

async function connect() {
  if (library === "ioredis") {
    const client = new Cluster(nodes, {
      maxRedirections: 16,
      retryDelayOnFailover: 100,
      retryDelayOnClusterDown: 100,
      slotsRefreshTimeout: 2000,
      redisOptions: { connectTimeout: 2000, commandTimeout: 2000, maxRetriesPerRequest: 1 },
    });
    return {
      set: (key, value) => client.set(key, value),
      get: (key) => client.get(key),
      incr: (key) => client.incr(key),
      hset: (key, field, value) => client.hset(key, field, value),
      hgetall: (key) => client.hgetall(key),
      close: () => client.quit(),
      recover: async () => {}, // ioredis refreshes its slot map itself
    };
  }
  if (library === "node-redis") {
    const open = async () => {
      const cluster = createCluster({
        rootNodes: nodes.map(({ host, port }) => ({ url: `redis://${host}:${port}` })),
        maxCommandRedirections: 16,
        defaults: {
          disableOfflineQueue: true,
          // A node that stays away is given up on: connect() waits for every
          // node the map names, and a dead head is named until its group
          // fails over. The workload then opens the client again.
          socket: { connectTimeout: 2000, reconnectStrategy: (retries) => (retries < 3 ? 200 : false) },
        },
      });
      cluster.on("error", () => {}); // a node going away is expected here
      try {
        await cluster.connect();
      } catch (error) {
        cluster.destroy();
        throw error;
      }
      return cluster;
    };
    let client = await open();
    return {
      set: (key, value) => client.set(key, value),
      get: (key) => client.get(key),
      incr: (key) => client.incr(key),
      hset: (key, field, value) => client.hSet(key, field, value),
      hgetall: (key) => client.hGetAll(key),
      close: () => client.close(),
      // node-redis reads the slot map again only on MOVED: a node that
      // stopped answering sends none, so an application opens the cluster
      // client again, from the nodes it was given.
      recover: async () => {
        try {
          client.destroy();
        } catch {
          // closed already, by a recovery that could not open it again
        }
        client = await open();
      },
    };
  }
  throw new Error(`no such library: ${library}`);
}

// A command unanswered this long is a failure of its own, named.
const HUNG_MS = 10000;
function within(promise, what) {
  let timer;
  const hung = new Promise((_, reject) => {
    timer = setTimeout(() => fail(`${what} had no answer in ${HUNG_MS} ms`), HUNG_MS);
  });
  return Promise.race([promise, hung]).finally(() => clearTimeout(timer));
}

function fail(message) {
  console.error(`${library}: ${message}`);
  process.exit(1);
}

const client = await connect();
const values = Array.from({ length: KEYS }, () => new Set([null]));
const fields = new Map();
const counter = `${prefix}:counter`;
const hash = `${prefix}:hash`;
let counterLow = 0;
let counterHigh = 0;
let ops = 0;
let failures = 0;

const deadline = Date.now() + Number(secondsText) * 1000;
for (let sequence = 0; Date.now() < deadline; sequence++) {
  const i = Math.floor(Math.random() * KEYS);
  const key = `${prefix}:k:${i}`;
  const value = String(sequence);
  const choice = Math.floor(Math.random() * 10);
  try {
    if (choice < 4) {
      try {
        await within(client.set(key, value), `SET ${key}`);
        values[i] = new Set([value]);
      } catch (error) {
        values[i].add(value);
        throw error;
      }
    } else if (choice < 8) {
      const got = await within(client.get(key), `GET ${key}`);
      if (!values[i].has(got)) fail(`GET ${key} = ${got}, not one of ${[...values[i]]}`);
      values[i] = new Set([got]);
    } else if (choice < 9) {
      try {
        const got = Number(await within(client.incr(counter), `INCR ${counter}`));
        if (got < counterLow + 1 || got > counterHigh + 1) {
          fail(`INCR ${counter} = ${got}, not within [${counterLow + 1}, ${counterHigh + 1}]`);
        }
        counterLow = counterHigh = got;
      } catch (error) {
        counterHigh += 1;
        throw error;
      }
    } else {
      const field = String(i % 8);
      if (!fields.has(field)) fields.set(field, new Set([null]));
      try {
        await within(client.hset(hash, field, value), `HSET ${hash}`);
        fields.set(field, new Set([value]));
      } catch (error) {
        fields.get(field).add(value);
        throw error;
      }
    }
  } catch (error) {
    failures += 1;
    await sleep(20);
    await within(client.recover().catch(() => {}), "reconnecting");
  }
  ops += 1;
}

// Everything read back once the cluster has settled, errors retried a while.
const settle = Date.now() + 20000;
async function retry(read) {
  for (;;) {
    try {
      return await within(read(), "a read back");
    } catch (error) {
      if (Date.now() > settle) fail(`reading back: ${error}`);
      await sleep(100);
      await within(client.recover().catch(() => {}), "reconnecting");
    }
  }
}
for (let i = 0; i < KEYS; i++) {
  const key = `${prefix}:k:${i}`;
  const got = await retry(() => client.get(key));
  if (!values[i].has(got)) fail(`at the end GET ${key} = ${got}, not one of ${[...values[i]]}`);
}
const total = Number((await retry(() => client.get(counter))) ?? 0);
if (total < counterLow || total > counterHigh) {
  fail(`at the end ${counter} = ${total}, not within [${counterLow}, ${counterHigh}]`);
}
const stored = await retry(() => client.hgetall(hash));
for (const [field, may] of fields) {
  const got = stored[field] ?? null;
  if (!may.has(got)) fail(`at the end HGET ${hash} ${field} = ${got}, not one of ${[...may]}`);
}
console.log(JSON.stringify({ client: library, ops, errors: failures }));
await client.close();
process.exit(0);
