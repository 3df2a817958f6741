-- heartbeat.lua: record a daemon as live and count the live ones, on Redis time.
-- KEYS[1] the daemons sorted set; ARGV[1] daemon id, ARGV[2] ttl in ms: a daemon whose
-- last heartbeat is older than ttl is no longer counted (and is removed).
local tm = redis.call('TIME')
local now = tonumber(tm[1]) * 1000 + math.floor(tonumber(tm[2]) / 1000)
local ttl = tonumber(ARGV[2])
redis.call('ZADD', KEYS[1], now, ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - ttl)
redis.call('PEXPIRE', KEYS[1], 2 * ttl)
return redis.call('ZCARD', KEYS[1])
