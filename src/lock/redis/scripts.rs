//! The Lua scripts that make each lock operation one atomic round trip.
//!
//! A lock entry's value is `"<lease id> <token>"`: the lease id makes renew
//! and release compare-and-set, and keeping the token beside it makes
//! acquire idempotent (a retried acquire by the same lease returns the token
//! it already got instead of minting another).
//!
//! Every script returns `{status, value}` as `{integer, string}`:
//! status 1 = done (value = token), 0 = key free, -1 = another lease holds
//! it (value = its remaining PTTL for acquire). The `_MANY` scripts run the
//! same Lua functions once per item and may also answer -2 = this item
//! failed (value = the error).

use redis::Script;

/// Lua: `keep_counter(key, value, idle, now)` sets a token counter's expiry
/// after a write: `idle` ms from now, and never before the server clock's
/// floor (ms × 1024) is above `value` — `floor(value / 1024) + 2` ms since
/// the epoch, on the clock the next acquire reads its floor from; the 2 ms
/// cover rounding of values above 2^53 by Lua's doubles and the expiry
/// (the key is gone once the clock is past the time). `PEXPIREAT` is an
/// absolute time, as replicas and a promoted replica see it. `idle` 0:
/// the counter keeps no expiry (`SET` has removed any). `now`: the
/// server's `TIME` in ms if the script has read it already. See
/// [`super::counters`].
macro_rules! keep_counter_lua {
    () => {
        r#"
local function keep_counter(key, value, idle, now)
  if idle <= 0 then return end
  if not now then
    local t = redis.call('TIME')
    now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  end
  local live = math.floor((tonumber(value) or 0) / 1024) + 2 - now
  if live < idle then live = idle end
  redis.call('PEXPIREAT', key, string.format('%.0f', now + live))
end
"#
    };
}
pub(crate) use keep_counter_lua;

/// Lua: `acquire(lock, counter, delay, lease, ttl, mode, lock_delay, idle)`,
/// the body of [`ACQUIRE`] and [`ACQUIRE_MANY`] (one source for both).
/// Returns `{status, value}`: 1 acquired (value: the token), -1 held by
/// another lease (value: its PTTL), -3 free but in lock-delay (value: the
/// delay's PTTL); status -2 = refused with the message in
/// `value` (the single script turns it into an error reply, the batch
/// script reports it for that item alone).
///
/// Lock-delay: with a delay, the acquire also sets a marker that lives
/// `ttl + delay`; a release deletes it, an expiry leaves it, and while it
/// lives nobody acquires the key (whatever their own delay setting).
///
/// In `hybrid` mode the next token is `max(counter + 1, TIME_ms * 1024)`, so
/// a counter lost with an unpersisted restart or a failover to a lagging
/// replica still moves forward — and so does one that expired: the counter
/// lives until that floor has passed it (`keep_counter`). Numbers stay below
/// 2^53, where Lua's doubles are exact, until the year ~2250; a counter at
/// 2^53 (raised there by a repair) is refused rather than rounded into a
/// token already issued.
/// In `counter` mode the token is the counter's string, exact to 2^63, and
/// the counter never expires.
///
/// The server's `TIME` is read once per script run (`server_now`): a batch
/// of acquires ([`ACQUIRE_MANY`]) runs atomically, at one instant as far as
/// any other client can tell, so its items share the reading and save a
/// call each (each key still takes `max(its counter + 1, floor)`).
macro_rules! acquire_lua {
    () => {
        r#"
local now_ms
local function server_now()
  if not now_ms then
    local t = redis.call('TIME')
    now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  end
  return now_ms
end
local function mint(counter, mode, idle)
  if mode == 'hybrid' then
    local now = server_now()
    local floor = now * 1024
    local c = tonumber(redis.call('GET', counter) or '0')
    if c >= 9007199254740991 then
      return nil, 'fencer: token counter at 2^53; Lua numbers are no longer exact'
    end
    c = c + 1
    if c < floor then c = floor end
    local tok = string.format('%.0f', c)
    redis.call('SET', counter, tok)
    keep_counter(counter, tok, tonumber(idle), now)
    return tok
  end
  -- INCR is exact 64-bit arithmetic in Redis; its reply becomes a Lua
  -- double, which tostring() prints as 1e+14 from 10^14 up. Read the
  -- counter back as the string Redis keeps instead.
  redis.call('INCR', counter)
  return redis.call('GET', counter)
end
-- The live read leases of a key's readers hash (entries "<token>
-- <expiry ms>", server clock), expired ones removed: their count, the ms
-- left to the soonest and to the latest.
local function live_readers(readers)
  if redis.call('EXISTS', readers) == 0 then return 0, 0, 0 end
  local now = server_now()
  local all = redis.call('HGETALL', readers)
  local n, soonest, latest = 0, nil, 0
  for i = 1, #all, 2 do
    local v = all[i + 1]
    local exp = tonumber(string.sub(v, (string.find(v, ' ', 1, true) or 0) + 1)) or 0
    if exp <= now then
      redis.call('HDEL', readers, all[i])
    else
      n = n + 1
      local left = exp - now
      if not soonest or left < soonest then soonest = left end
      if left > latest then latest = left end
    end
  end
  return n, soonest or 0, latest
end
-- A read lease's live entry in the readers hash: its token, or nil (none,
-- or expired).
local function reader_token(readers, lease)
  local mine = redis.call('HGET', readers, lease)
  if not mine then return nil end
  local sep = string.find(mine, ' ', 1, true)
  if sep and tonumber(string.sub(mine, sep + 1)) > server_now() then
    return string.sub(mine, 1, sep - 1)
  end
  return nil
end
local function acquire(lock, counter, delay, readers, wwait, lease, ttl, mode, lock_delay, idle)
  local cur = redis.call('GET', lock)
  if cur then
    local sep = string.find(cur, ' ', 1, true)
    if sep and string.sub(cur, 1, sep - 1) == lease then
      return {1, string.sub(cur, sep + 1)}
    end
    return {-1, tostring(redis.call('PTTL', lock))}
  end
  local delayed = redis.call('PTTL', delay)
  if delayed > 0 then
    return {-3, tostring(delayed)}
  end
  local n, soonest = live_readers(readers)
  if n > 0 then
    -- Read leases hold the key: this writer waits, re-checking within a
    -- second (sooner if the soonest reader ends first), and until a second
    -- after that no new reader gets in (writer preference; each re-check
    -- renews the mark, so a writer that gave up keeps readers out 2 s at
    -- most: memory.rs, WRITER_RECHECK).
    local again = soonest
    if again > 1000 then again = 1000 end
    redis.call('SET', wwait, '1', 'PX', again + 1000)
    return {-1, tostring(again)}
  end
  local tok, err = mint(counter, mode, idle)
  if not tok then
    return {-2, err}
  end
  redis.call('SET', lock, lease .. ' ' .. tok, 'PX', ttl)
  redis.call('DEL', wwait)
  if tonumber(lock_delay) > 0 then
    redis.call('SET', delay, '1', 'PX', tonumber(ttl) + tonumber(lock_delay))
  end
  return {1, tok}
end
"#
    };
}

/// Lua: `batch_error(e)`, the message of an error a `pcall` caught (a
/// `redis.call` error is a table with `err`), as a per-item status -2.
macro_rules! batch_error_lua {
    () => {
        r#"
local function batch_error(e)
  if type(e) == 'table' then e = e.err or e.ok end
  return {-2, tostring(e)}
end
"#
    };
}

/// KEYS: lock, counter, delay marker, readers hash, writer-wait marker.
/// ARGV: lease id, ttl ms, token mode (`hybrid`|`counter`), lock-delay ms,
/// counter idle expiry ms (0: never; `hybrid` only). See `acquire_lua!`
/// for the rules.
pub const ACQUIRE: &str = concat!(
    keep_counter_lua!(),
    acquire_lua!(),
    r#"
local r = acquire(KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5])
if r[1] == -2 then return redis.error_reply(r[2]) end
return r
"#
);

/// A read lease's acquire (read-write locks). KEYS: lock, counter, delay
/// marker, readers hash, writer-wait marker. ARGV: lease id, ttl ms, token
/// mode, counter idle expiry ms. Already this lease's reader → its token;
/// a write lease holds the key, or a writer waits for it → `{-1, ms}`; in
/// lock-delay → `{-3, ms}`; else an entry `"<token> <expiry ms>"` in the
/// readers hash, with the key's next token. The hash lives as long as its
/// latest reader.
pub const READ_ACQUIRE: &str = concat!(
    keep_counter_lua!(),
    acquire_lua!(),
    r#"
local now = server_now()
local mine = reader_token(KEYS[4], ARGV[1])
if mine then return {1, mine} end
if redis.call('EXISTS', KEYS[1]) == 1 then
  return {-1, tostring(redis.call('PTTL', KEYS[1]))}
end
local waiting = redis.call('PTTL', KEYS[5])
if waiting > 0 then
  return {-1, tostring(waiting)}
end
local delayed = redis.call('PTTL', KEYS[3])
if delayed > 0 then
  return {-3, tostring(delayed)}
end
local tok, err = mint(KEYS[2], ARGV[3], ARGV[4])
if not tok then return redis.error_reply(err) end
local ttl = tonumber(ARGV[2])
redis.call('HSET', KEYS[4], ARGV[1], tok .. ' ' .. string.format('%.0f', now + ttl))
if redis.call('PTTL', KEYS[4]) < ttl then redis.call('PEXPIRE', KEYS[4], ttl) end
return {1, tok}
"#
);

/// A read lease's renewal. KEYS: lock, readers hash. ARGV: lease id, ttl
/// ms. `{1, token}` renewed, `{0, ''}` not held, `{-1, ''}` a write lease
/// holds the key.
pub const READ_RENEW: &str = concat!(
    keep_counter_lua!(),
    acquire_lua!(),
    r#"
local tok = reader_token(KEYS[2], ARGV[1])
if tok then
  local ttl = tonumber(ARGV[2])
  redis.call('HSET', KEYS[2], ARGV[1], tok .. ' ' .. string.format('%.0f', server_now() + ttl))
  if redis.call('PTTL', KEYS[2]) < ttl then redis.call('PEXPIRE', KEYS[2], ttl) end
  return {1, tok}
end
if redis.call('EXISTS', KEYS[1]) == 1 then return {-1, ''} end
return {0, ''}
"#
);

/// A read lease's release. KEYS: readers hash. ARGV: lease id, release
/// channel, publish command. The last reader's release publishes (wakes
/// the waiting writer). `{1, token}` released, `{0, ''}` not held.
pub const READ_RELEASE: &str = concat!(
    keep_counter_lua!(),
    acquire_lua!(),
    r#"
local mine = redis.call('HGET', KEYS[1], ARGV[1])
if not mine then return {0, ''} end
redis.call('HDEL', KEYS[1], ARGV[1])
local sep = string.find(mine, ' ', 1, true)
if not sep or tonumber(string.sub(mine, sep + 1)) <= server_now() then return {0, ''} end
if live_readers(KEYS[1]) == 0 then redis.call(ARGV[3], ARGV[2], '1') end
return {1, string.sub(mine, 1, sep - 1)}
"#
);

/// Whether a read lease is live, changing nothing (after a failover).
/// KEYS: readers hash. ARGV: lease id.
pub const READ_CHECK: &str = concat!(
    keep_counter_lua!(),
    acquire_lua!(),
    r#"
local tok = reader_token(KEYS[1], ARGV[1])
if tok then return {1, tok} end
return {0, ''}
"#
);

/// Many acquires in one call (the group commit of [`super::batch`]).
/// KEYS: lock, counter, delay marker, readers hash, writer-wait marker per
/// item. ARGV: lease id and ttl ms
/// per item, then token mode, lock-delay ms, counter idle expiry ms (the
/// single script's layout, items concatenated). Returns `{status, value}`
/// per item, flattened. Each item runs under `pcall`: an error (a refused
/// counter, a `WRONGTYPE` key, `OOM`) answers that item with status -2 and
/// the message, and the other items run as if alone.
pub const ACQUIRE_MANY: &str = concat!(
    keep_counter_lua!(),
    acquire_lua!(),
    batch_error_lua!(),
    r#"
local mode, lock_delay, idle = ARGV[#ARGV - 2], ARGV[#ARGV - 1], ARGV[#ARGV]
local out = {}
for i = 1, #KEYS / 5 do
  local ok, r = pcall(acquire, KEYS[5 * i - 4], KEYS[5 * i - 3], KEYS[5 * i - 2],
    KEYS[5 * i - 1], KEYS[5 * i], ARGV[2 * i - 1], ARGV[2 * i], mode, lock_delay, idle)
  if not ok then r = batch_error(r) end
  out[2 * i - 1] = r[1]
  out[2 * i] = r[2]
end
return out
"#
);

/// KEYS: lock, delay marker. ARGV: lease id, ttl ms, lock-delay ms.
pub const RENEW: &str = r#"
local cur = redis.call('GET', KEYS[1])
if not cur then return {0, ''} end
local sep = string.find(cur, ' ', 1, true)
if not sep or string.sub(cur, 1, sep - 1) ~= ARGV[1] then return {-1, ''} end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
if tonumber(ARGV[3]) > 0 then
  redis.call('SET', KEYS[2], '1', 'PX', tonumber(ARGV[2]) + tonumber(ARGV[3]))
end
return {1, string.sub(cur, sep + 1)}
"#;

/// Lua: `release(lock, delay, lease, channel, publish)`, the body of
/// [`RELEASE`] and [`RELEASE_MANY`]. The message wakes waiters in every
/// sidecar subscribed to this key; a release (unlike an expiry) clears the
/// lock-delay.
macro_rules! release_lua {
    () => {
        r#"
local function release(lock, delay, lease, channel, publish)
  local cur = redis.call('GET', lock)
  if not cur then return {0, ''} end
  local sep = string.find(cur, ' ', 1, true)
  if not sep or string.sub(cur, 1, sep - 1) ~= lease then return {-1, ''} end
  redis.call('DEL', lock, delay)
  redis.call(publish, channel, '1')
  return {1, string.sub(cur, sep + 1)}
end
"#
    };
}

/// KEYS: lock, delay marker. ARGV: lease id, release channel, publish
/// command (`PUBLISH`, or `SPUBLISH` in cluster mode: the channel shares
/// the lock's hash tag, so the message stays on its shard).
pub const RELEASE: &str = concat!(
    release_lua!(),
    r#"
return release(KEYS[1], KEYS[2], ARGV[1], ARGV[2], ARGV[3])
"#
);

/// Many releases in one call. KEYS: lock, delay marker per item. ARGV:
/// lease id and release channel per item, then the publish command.
/// Returns `{status, token}` per item, flattened; an item's error is its
/// status -2 (see [`ACQUIRE_MANY`]).
pub const RELEASE_MANY: &str = concat!(
    release_lua!(),
    batch_error_lua!(),
    r#"
local publish = ARGV[#ARGV]
local out = {}
for i = 1, #KEYS / 2 do
  local ok, r = pcall(release, KEYS[2 * i - 1], KEYS[2 * i], ARGV[2 * i - 1], ARGV[2 * i], publish)
  if not ok then r = batch_error(r) end
  out[2 * i - 1] = r[1]
  out[2 * i] = r[2]
end
return out
"#
);

/// KEYS: one lock key per lease. ARGV: the lease ids, in order.
/// Returns `{status, token}` per key, flattened, changing nothing: after a
/// failover, whether the new master still has each lease.
pub const CHECK_MANY: &str = r#"
local out = {}
for i = 1, #KEYS do
  local cur = redis.call('GET', KEYS[i])
  out[2 * i - 1] = -1
  out[2 * i] = ''
  if not cur then
    out[2 * i - 1] = 0
  else
    local sep = string.find(cur, ' ', 1, true)
    if sep and string.sub(cur, 1, sep - 1) == ARGV[i] then
      out[2 * i - 1] = 1
      out[2 * i] = string.sub(cur, sep + 1)
    end
  end
end
return out
"#;

/// KEYS: lock key and delay marker for each lease. ARGV: lease id and ttl
/// ms for each, in order, then the lock-delay ms.
/// Returns `{status, token}` per key, flattened. Sidecar-driven renewal of
/// many leases in one round trip (in cluster mode, one call per slot).
pub const RENEW_MANY: &str = r#"
local out = {}
local delay = tonumber(ARGV[#ARGV])
for i = 1, #KEYS / 2 do
  local k = KEYS[2 * i - 1]
  local lease = ARGV[2 * i - 1]
  local cur = redis.call('GET', k)
  if not cur then
    out[2 * i - 1] = 0
    out[2 * i] = ''
  else
    local sep = string.find(cur, ' ', 1, true)
    if sep and string.sub(cur, 1, sep - 1) == lease then
      redis.call('PEXPIRE', k, ARGV[2 * i])
      if delay > 0 then
        redis.call('SET', KEYS[2 * i], '1', 'PX', tonumber(ARGV[2 * i]) + delay)
      end
      out[2 * i - 1] = 1
      out[2 * i] = string.sub(cur, sep + 1)
    else
      out[2 * i - 1] = -1
      out[2 * i] = ''
    end
  end
end
return out
"#;

/// KEYS: counter. ARGV: floor (decimal digits), counter idle expiry ms
/// (0: never). Raises the counter to at least the floor. Compared as
/// decimal strings (length, then digits), not as Lua doubles, which round
/// above 2^53. The counter then lives until the clock floor has passed its
/// value (a repair raises it ahead of the clock: up to 2^40, ~12.4 days).
pub const RAISE_FLOOR: &str = concat!(
    keep_counter_lua!(),
    r#"
local cur = redis.call('GET', KEYS[1]) or '0'
local f = ARGV[1]
if string.len(cur) < string.len(f) or (string.len(cur) == string.len(f) and cur < f) then
  redis.call('SET', KEYS[1], f)
  cur = f
end
keep_counter(KEYS[1], cur, tonumber(ARGV[2]))
return {1, ''}
"#
);

/// A script and its body (for `EVAL` when a node answers `NOSCRIPT`).
pub struct Lua {
    pub script: Script,
    pub body: &'static str,
}

impl Lua {
    pub fn new(body: &'static str) -> Lua {
        Lua {
            script: Script::new(body),
            body,
        }
    }
}

/// KEYS: lock, delay marker, counter[, readers hash]. Reads only: `{entry
/// or "", its PTTL, the delay marker's PTTL, counter or ""[, live read
/// leases]}` at one instant (`GET /v1/locks/{key}?scope=backend`,
/// [`super::inspect`]; RedLock, with no readers, passes three keys).
pub const INSPECT: &str = r#"
local cur = redis.call('GET', KEYS[1]) or ''
local pttl = -2
if cur ~= '' then pttl = redis.call('PTTL', KEYS[1]) end
local out = {cur, tostring(pttl), tostring(redis.call('PTTL', KEYS[2])),
             redis.call('GET', KEYS[3]) or ''}
if KEYS[4] then
  -- The live read leases, counted without removing the expired ones (a
  -- look changes nothing).
  local n = 0
  if redis.call('EXISTS', KEYS[4]) == 1 then
    local t = redis.call('TIME')
    local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
    local all = redis.call('HVALS', KEYS[4])
    for i = 1, #all do
      local v = all[i]
      local exp = tonumber(string.sub(v, (string.find(v, ' ', 1, true) or 0) + 1)) or 0
      if exp > now then n = n + 1 end
    end
  end
  out[5] = tostring(n)
end
return out
"#;

/// KEYS: lock, holds record. ARGV: lease id, expected count ("" = read
/// only), new count, change id, owner. Reentrancy: `{status, holds, owner,
/// applied}` — status 1 when the lease holds the lock (then the count, 1
/// if none is recorded for it, is set to ARGV[3] if it was ARGV[2]; 0
/// deletes the record; `applied` 1 when this change is in effect, made now
/// or by an earlier call of the same id), 0 free, -1 another lease's. The
/// record is `"<lease> <holds> <change id> <owner>"`.
pub const HOLDS: &str = r#"
local cur = redis.call('GET', KEYS[1])
if not cur then return {0, '0', '', 0} end
local sep = string.find(cur, ' ', 1, true)
if not sep or string.sub(cur, 1, sep - 1) ~= ARGV[1] then return {-1, '0', '', 0} end
local h, op, owner = 1, '', ''
local rec = redis.call('GET', KEYS[2])
if rec then
  local l, n, c, o = string.match(rec, '^(%S+) (%d+) (%S+) (.*)$')
  if l == ARGV[1] then h = tonumber(n); op = c; owner = o end
end
if ARGV[2] == '' then return {1, tostring(h), owner, 0} end
if op == ARGV[4] then return {1, tostring(h), owner, 1} end
if tonumber(ARGV[2]) ~= h then return {1, tostring(h), owner, 0} end
h = tonumber(ARGV[3])
owner = ARGV[5]
if h == 0 then
  redis.call('DEL', KEYS[2])
else
  redis.call('SET', KEYS[2], ARGV[1] .. ' ' .. h .. ' ' .. ARGV[4] .. ' ' .. owner)
end
return {1, tostring(h), owner, 1}
"#;

/// A semaphore's permit count: set unless set, answered as it stands.
/// KEYS: permits record. ARGV: permits. No expiry (see
/// `LockBackend::fix_permits`).
pub const PERMITS: &str = r#"
redis.call('SET', KEYS[1], ARGV[1], 'NX')
return tonumber(redis.call('GET', KEYS[1]))
"#;

/// The scripts, hashed once; `EVALSHA`, with `EVAL` on `NOSCRIPT`.
pub struct Scripts {
    pub acquire: Lua,
    pub renew: Lua,
    pub release: Lua,
    pub raise_floor: Lua,
    pub renew_many: Lua,
    pub check_many: Lua,
    pub acquire_many: Lua,
    pub release_many: Lua,
    pub inspect: Lua,
    pub holds: Lua,
    pub permits: Lua,
    pub read_acquire: Lua,
    pub read_renew: Lua,
    pub read_release: Lua,
    pub read_check: Lua,
}

impl Scripts {
    pub fn new() -> Scripts {
        Scripts {
            acquire: Lua::new(ACQUIRE),
            renew: Lua::new(RENEW),
            release: Lua::new(RELEASE),
            raise_floor: Lua::new(RAISE_FLOOR),
            renew_many: Lua::new(RENEW_MANY),
            check_many: Lua::new(CHECK_MANY),
            acquire_many: Lua::new(ACQUIRE_MANY),
            release_many: Lua::new(RELEASE_MANY),
            inspect: Lua::new(INSPECT),
            holds: Lua::new(HOLDS),
            permits: Lua::new(PERMITS),
            read_acquire: Lua::new(READ_ACQUIRE),
            read_renew: Lua::new(READ_RENEW),
            read_release: Lua::new(READ_RELEASE),
            read_check: Lua::new(READ_CHECK),
        }
    }

    pub fn all(&self) -> [&Lua; 15] {
        [
            &self.acquire,
            &self.renew,
            &self.release,
            &self.raise_floor,
            &self.renew_many,
            &self.check_many,
            &self.acquire_many,
            &self.release_many,
            &self.inspect,
            &self.holds,
            &self.permits,
            &self.read_acquire,
            &self.read_renew,
            &self.read_release,
            &self.read_check,
        ]
    }
}

impl Default for Scripts {
    fn default() -> Self {
        Self::new()
    }
}
