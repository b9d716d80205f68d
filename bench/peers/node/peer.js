// bench/peers.py's node peer: N async clients in one process, each with its
// own ioredis connection, run the lock scenario of src/bench/locks.rs with
// redis-semaphore's Mutex: acquire → non-atomic GET/SET increment of a
// per-key counter → release.
//
// Protocol with the driver (one JSON object per stdout line):
//   argv: --redis URL --clients N --keys K --seconds S --tag TAG
//   → {"ready":true,"pids":[pid]}  after every connection is up
//   ← "go\n" on stdin
//   → {"cycles":…, "owner_changes":…, …}  when every client has stopped
'use strict';

const Redis = require('ioredis');
const { Mutex } = require('redis-semaphore');

function args() {
  const a = {};
  const v = process.argv.slice(2);
  for (let i = 0; i < v.length; i += 2) a[v[i].replace(/^--/, '')] = v[i + 1];
  return {
    redis: a.redis,
    clients: Number(a.clients),
    keys: Number(a.keys),
    seconds: Number(a.seconds),
    tag: a.tag,
  };
}

const nowUs = () => Number(process.hrtime.bigint() / 1000n);

// Same quantile as Report::pct in src/bench/stats.rs: sorted µs → ms.
function pct(v, p) {
  if (v.length === 0) return 0;
  return v[Math.floor((v.length - 1) * p)] / 1000;
}

function waitForGo() {
  return new Promise((resolve, reject) => {
    let buf = '';
    process.stdin.setEncoding('utf8');
    process.stdin.on('data', (d) => {
      buf += d;
      if (buf.includes('\n')) resolve(buf.trim());
    });
    process.stdin.on('end', () => reject(new Error('stdin closed before go')));
  });
}

async function main() {
  const o = args();
  // Each client has its own connection, as separate application threads
  // or processes would; no auto-pipelining (the default).
  const conns = [];
  for (let i = 0; i < o.clients; i++) {
    const c = new Redis(o.redis, { lazyConnect: true, maxRetriesPerRequest: 1 });
    await c.connect();
    await c.ping();
    conns.push(c);
  }
  process.stdout.write(JSON.stringify({ ready: true, pids: [process.pid] }) + '\n');
  const go = await waitForGo();
  if (go !== 'go') throw new Error(`expected go, got ${go}`);

  const lastOwner = new Array(o.keys).fill(-1);
  const started = nowUs();
  const deadline = started + o.seconds * 1e6;
  const one = async (id) => {
    const conn = conns[id];
    const k = id % o.keys;
    const counter = `bench-counter:${o.tag}:${k}`;
    const lockKey = `bench-lock:${o.tag}:${k}`;
    const r = { cycles: 0, owner_changes: 0, errors: 0, wait: [], cycle: [] };
    while (nowUs() < deadline) {
      const t0 = nowUs();
      // The idiomatic use: a Mutex per critical section. 10 s lock
      // timeout and acquire timeout like the bench's ttl_ms/wait_ms,
      // 10 ms retry like the baseline's polling, no refresh timer (the
      // direct baseline renews nothing either).
      const m = new Mutex(conn, lockKey, {
        lockTimeout: 10000,
        acquireTimeout: 10000,
        retryInterval: 10,
        refreshInterval: 0,
      });
      try {
        await m.acquire();
      } catch (e) {
        r.errors += 1;
        continue;
      }
      const waited = nowUs() - t0;
      const v = await conn.get(counter);
      await conn.set(counter, (v === null ? 0 : Number(v)) + 1);
      if (lastOwner[k] !== id) {
        r.owner_changes += 1;
      }
      lastOwner[k] = id;
      await m.release();
      r.cycles += 1;
      r.wait.push(waited);
      r.cycle.push(nowUs() - t0);
    }
    return r;
  };
  const reports = await Promise.all(conns.map((_, id) => one(id)));
  const secs = (nowUs() - started) / 1e6;

  const total = { cycles: 0, owner_changes: 0, errors: 0, per_client: [] };
  const perKey = new Array(o.keys).fill(0);
  let wait = [];
  let cycle = [];
  reports.forEach((r, id) => {
    total.cycles += r.cycles;
    total.owner_changes += r.owner_changes;
    total.errors += r.errors;
    total.per_client.push(r.cycles);
    perKey[id % o.keys] += r.cycles;
    wait = wait.concat(r.wait);
    cycle = cycle.concat(r.cycle);
  });
  let lost = 0;
  for (let k = 0; k < o.keys; k++) {
    const v = await conns[0].get(`bench-counter:${o.tag}:${k}`);
    lost += perKey[k] - (v === null ? 0 : Number(v));
  }
  wait.sort((a, b) => a - b);
  cycle.sort((a, b) => a - b);
  const out = {
    ...total,
    secs,
    lost_updates: lost,
    wait_ms: { p50: pct(wait, 0.5), p99: pct(wait, 0.99), max: pct(wait, 1) },
    cycle_ms: { p50: pct(cycle, 0.5), p99: pct(cycle, 0.99), max: pct(cycle, 1) },
  };
  process.stdout.write(JSON.stringify(out) + '\n');
  await Promise.all(conns.map((c) => c.quit()));
}

main().then(
  () => process.exit(0),
  (e) => {
    process.stderr.write(`node peer: ${e && e.stack ? e.stack : e}\n`);
    process.exit(1);
  },
);
