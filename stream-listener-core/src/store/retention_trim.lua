-- Trims one stream key to its retention in one step (docs/design.md §10.9).
-- KEYS[1] the stream (a shard, or a dead-letter stream: one key, one slot).
-- ARGV[1] 'acked' | 'force'; ARGV[2] max age in ms ('' = none); ARGV[3] max length ('' = none);
-- ARGV[4] '1' = dry run (count, change nothing).
-- Returns {'NOSTREAM'} or {'OK', deleted, reason, holder, holderId, point, lengthAfter,
-- {group1, lost1, group2, lost2, ...}}. Ids are compared as (ms, seq) pairs of decimal strings:
-- no arithmetic on them (Lua numbers are doubles).
local key = KEYS[1]
local mode, dry = ARGV[1], ARGV[4] == '1'
if redis.call('EXISTS', key) == 0 then return {'NOSTREAM'} end

local function split(id)
  local dash = string.find(id, '-', 1, true)
  if not dash then return id, '0' end
  return string.sub(id, 1, dash - 1), string.sub(id, dash + 1)
end
local function cmpnum(a, b)
  if #a ~= #b then return (#a < #b) and -1 or 1 end
  if a == b then return 0 end
  return (a < b) and -1 or 1
end
local function cmp(a, b)
  local am, as = split(a)
  local bm, bs = split(b)
  local c = cmpnum(am, bm)
  if c ~= 0 then return c end
  return cmpnum(as, bs)
end
-- Entries between two XRANGE arguments, counted in chunks (dry runs only: O(entries counted)).
local function count(start, stop)
  local n = 0
  while true do
    local r = redis.call('XRANGE', key, start, stop, 'COUNT', 1000)
    n = n + #r
    if #r < 1000 or r[#r][1] == '18446744073709551615-18446744073709551615' then return n end
    start = '(' .. r[#r][1]
  end
end

-- Every consumer group on the key, registered or not: what it still needs.
local groups = {}
for _, raw in ipairs(redis.call('XINFO', 'GROUPS', key)) do
  local info = {}
  for i = 1, #raw, 2 do info[raw[i]] = raw[i + 1] end
  local g = {name = info['name'], pending = tonumber(info['pending'])}
  g.ldid = info['last-delivered-id']
  -- Redis 7.0+: entries after last-delivered-id (nil after an XDEL in that range, or on older
  -- servers). Never below the truth: a force trim past the group only makes it larger.
  g.lag = tonumber(info['lag'])
  if g.pending > 0 then g.oldest = redis.call('XPENDING', key, g.name)[2] end
  -- Nothing follows the largest id, and '(' before it is an invalid XRANGE start.
  if g.ldid ~= '18446744073709551615-18446744073709551615' then
    local nxt = redis.call('XRANGE', key, '(' .. g.ldid, '+', 'COUNT', 1)
    if #nxt > 0 then g.undelivered = nxt[1][1] end
  end
  g.hold = g.oldest
  if g.undelivered and (not g.hold or cmp(g.undelivered, g.hold) < 0) then g.hold = g.undelivered end
  groups[#groups + 1] = g
end

local len = redis.call('XLEN', key)
local holder, hold = '', nil
for _, g in ipairs(groups) do
  if g.hold and (not hold or cmp(g.hold, hold) < 0) then hold, holder = g.hold, g.name end
end
if mode == 'acked' and #groups == 0 then
  return {'OK', 0, 'noGroups', '', '', '', len, {}}
end
-- G: the lowest id a group still needs (nil: none). Force mode ignores it.
local G = nil
if mode == 'acked' then G = hold end

-- act: {'MINID', p, reason} (entries < p go) or {'MAXLEN', last, reason} (entries <= last go).
local act = nil
if ARGV[2] ~= '' then
  local t = redis.call('TIME')
  local cut = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) - tonumber(ARGV[2])
  if cut > 0 then
    local age = string.format('%.0f', cut) .. '-0'
    if G and cmp(G, age) < 0 then act = {'MINID', G, 'group'} else act = {'MINID', age, 'maxAge'} end
  end
end
if ARGV[3] ~= '' and len > tonumber(ARGV[3]) then
  local max_len = tonumber(ARGV[3])
  local excess = len - max_len
  -- Fast path (acked, not a dry run): when at most max_len entries are at or after G (every
  -- group close to the tail, the usual case), the oldest `excess` entries are all below G, so
  -- the length bound may trim without fetching them. Counted from the holding group's lag and
  -- in-flight entries, else probed (O(100) whatever the backlog); the trims cost O(entries that
  -- go) inside XTRIM, not as Lua tables.
  if mode == 'acked' and not dry then
    local probe = math.min(max_len, 100)
    local few = not G
    if not few then
      local holding = nil
      for _, g in ipairs(groups) do if g.name == holder then holding = g end end
      -- Entries at or after G: the holder's lag (after its last delivered id) plus its
      -- delivered entries from G on (its in-flight ones, counted up to the probe).
      if holding and holding.lag and holding.lag <= max_len then
        local delivered = 0
        if cmp(G, holding.ldid) <= 0 then
          delivered = #redis.call('XRANGE', key, G, holding.ldid, 'COUNT', probe + 1)
        end
        few = delivered <= probe and holding.lag + delivered <= max_len
      end
    end
    if not few then few = #redis.call('XRANGE', key, G, '+', 'COUNT', probe + 1) <= probe end
    if few then
      local deleted, reason, point = 0, 'withinBounds', ''
      if act then
        deleted = redis.call('XTRIM', key, 'MINID', act[2])
        if deleted > 0 or act[3] == 'group' then reason, point = act[3], act[2] end
      end
      local n = redis.call('XTRIM', key, 'MAXLEN', max_len)
      if n > 0 then
        deleted = deleted + n
        reason = 'maxLen'
        point = redis.call('XRANGE', key, '-', '+', 'COUNT', 1)[1][1]
      end
      return {'OK', deleted, reason, holder, hold or '', point, len - deleted, {}}
    end
  end
  local stop = '+'
  if G then stop = '(' .. G end
  -- O(entries that go): the ids below G, at most the excess.
  local r = redis.call('XRANGE', key, '-', stop, 'COUNT', excess)
  local by_len = nil
  if #r == excess then by_len = {'MAXLEN', r[excess][1], 'maxLen'}
  elseif G then by_len = {'MINID', G, 'group'} end
  if by_len then
    if not act or by_len[1] == 'MINID' or cmp(by_len[2], act[2]) >= 0 then act = by_len end
  end
end
if not act then
  local reason = 'withinBounds'
  if ARGV[2] == '' and ARGV[3] == '' then reason = 'noBounds' end
  return {'OK', 0, reason, holder, hold or '', '', len, {}}
end
local function goes(id)
  if act[1] == 'MINID' then return cmp(id, act[2]) < 0 end
  return cmp(id, act[2]) <= 0
end
local stop = act[2]
if act[1] == 'MINID' then stop = '(' .. act[2] end

-- Force mode: what each group loses, exactly: its pending ids among the entries that go (from
-- the first entry on: ids trimmed earlier are not counted twice), plus its undelivered entries
-- that go, attributed step by step (trim to U_1, then U_2, ...: each step's count is lost to
-- every group whose first undelivered id is at or below the step's start).
local lost, steps = {}, {}
if mode == 'force' and len > 0 then
  local first = redis.call('XRANGE', key, '-', '+', 'COUNT', 1)[1][1]
  for _, g in ipairs(groups) do
    g.lost = 0
    if g.oldest and goes(g.oldest) then
      -- Pending ids after last-delivered-id (an XGROUP SETID back past them) are undelivered
      -- too, counted by the steps below: only those up to it here, or they count twice.
      local upto = stop
      if goes(g.ldid) then upto = g.ldid end
      g.lost = #redis.call('XPENDING', key, g.name, first, upto, g.pending)
    end
    if g.undelivered and goes(g.undelivered) then steps[#steps + 1] = g end
  end
  table.sort(steps, function(a, b) return cmp(a.undelivered, b.undelivered) < 0 end)
end

local deleted, prev = 0, '-'
for i, g in ipairs(steps) do
  local n
  if dry then n = count(prev, '(' .. g.undelivered)
  else n = redis.call('XTRIM', key, 'MINID', g.undelivered) end
  deleted = deleted + n
  for j = 1, i - 1 do steps[j].lost = steps[j].lost + n end
  prev = g.undelivered
end
local n
if dry then
  n = count(prev, stop)
elseif act[1] == 'MINID' then
  n = redis.call('XTRIM', key, 'MINID', act[2])
else
  n = redis.call('XTRIM', key, 'MAXLEN', ARGV[3])
end
deleted = deleted + n
for _, g in ipairs(steps) do g.lost = g.lost + n end

local point = act[2]
if act[1] == 'MAXLEN' then
  local nxt = redis.call('XRANGE', key, '(' .. act[2], '+', 'COUNT', 1)
  if #nxt > 0 then point = nxt[1][1] else point = '' end
end
local reason = act[3]
if deleted == 0 and reason ~= 'group' then reason = 'withinBounds' end
for _, g in ipairs(groups) do
  if g.lost and g.lost > 0 then lost[#lost + 1] = g.name; lost[#lost + 1] = g.lost end
end
local after = len - deleted
return {'OK', deleted, reason, holder, hold or '', point, after, lost}
