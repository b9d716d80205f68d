//! The two RedLock-specific scripts; renewal, release and the counter
//! floor reuse the single-Redis scripts (`lock::redis::scripts`), which
//! work per master unchanged.
//!
//! An acquisition is two rounds. `LOCK` takes the key on a master and
//! reports that master's token counter and clock floor; once a majority
//! granted, the sidecar mints a token above every counter of that majority
//! and `STAMP` writes it back into the lock entry and the counter of a
//! majority *before* the token is handed out. Any later majority shares at
//! least one master with that one, so it sees the counter and mints higher.

/// KEYS: lock, counter, delay marker, the master's data-age marker. ARGV:
/// lease id, ttl ms, lock-delay ms, restart quarantine ms.
///
/// Returns `{1, counter, entry token, clock floor}` when this lease holds
/// the key on this master (just taken, or already: a retry), where the
/// entry token is `0` before the write-back; `{-1, pttl}` when another
/// lease holds it, `{-3, pttl}` when nobody does but the lock-delay marker
/// lives; `{0, ms}` when this
/// master abstains for `ms` more: it has not kept its data for the
/// quarantine yet. The age marker (the master's own `TIME` at the first
/// vote, never expiring) vanishes with the data, so a master restarted
/// empty starts a quarantine at its next vote, on its own clock.
pub const LOCK: &str = r#"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local quarantine = tonumber(ARGV[4])
if quarantine > 0 then
  local born = redis.call('GET', KEYS[4])
  if not born then
    redis.call('SET', KEYS[4], string.format('%.0f', now))
    return {0, tostring(quarantine)}
  end
  local age = now - tonumber(born)
  if age < quarantine then
    return {0, string.format('%.0f', quarantine - age)}
  end
end
local floor = string.format('%.0f', now * 1024)
local cur = redis.call('GET', KEYS[1])
if cur then
  local sep = string.find(cur, ' ', 1, true)
  if sep and string.sub(cur, 1, sep - 1) == ARGV[1] then
    return {1, redis.call('GET', KEYS[2]) or '0', string.sub(cur, sep + 1), floor}
  end
  return {-1, tostring(redis.call('PTTL', KEYS[1]))}
end
local delayed = redis.call('PTTL', KEYS[3])
if delayed > 0 then
  return {-3, tostring(delayed)}
end
redis.call('SET', KEYS[1], ARGV[1] .. ' 0', 'PX', ARGV[2])
if tonumber(ARGV[3]) > 0 then
  redis.call('SET', KEYS[3], '1', 'PX', tonumber(ARGV[2]) + tonumber(ARGV[3]))
end
return {1, redis.call('GET', KEYS[2]) or '0', '0', floor}
"#;

/// KEYS: lock, counter. ARGV: lease id, token (decimal digits), counter
/// idle expiry ms (0: never).
///
/// If the lease still holds the key here: writes the token into the entry
/// (keeping its TTL) and raises the counter to it (compared as decimal
/// strings, not Lua doubles), and sets the counter's expiry: `idle` from
/// now, and never before this master's clock floor has passed the counter
/// (`keep_counter`). The next `LOCK` here either sees the counter or
/// reports a floor above it, so a later majority sharing this master still
/// mints higher. Returns 1, or 0 when the lease does not hold the key here
/// (expired meanwhile).
pub const STAMP: &str = concat!(
    crate::lock::redis::scripts::keep_counter_lua!(),
    r#"
local cur = redis.call('GET', KEYS[1])
if not cur then return 0 end
local sep = string.find(cur, ' ', 1, true)
if not sep or string.sub(cur, 1, sep - 1) ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[1] .. ' ' .. ARGV[2], 'KEEPTTL')
local c = redis.call('GET', KEYS[2]) or '0'
local f = ARGV[2]
if string.len(c) < string.len(f) or (string.len(c) == string.len(f) and c < f) then
  redis.call('SET', KEYS[2], f)
  c = f
end
keep_counter(KEYS[2], c, tonumber(ARGV[3]))
return 1
"#
);
