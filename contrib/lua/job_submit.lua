-- job_submit.lua: asks `slurmgpu serve` which GPUs a batch job should get, from inside slurmctld.
-- Rendered by `slurmgpu lua render`; render again rather than edit (see contrib/lua/README.md).
--
-- Any failure (no lua-socket, no daemon, a timeout, an unreadable answer, an error here) leaves
-- the job exactly as submitted: this hook never rejects a job, and never holds slurmctld longer
-- than timeout_ms per job. After a failure it passes jobs through without asking for backoff_s.
-- Needs Debian's lua-socket (socket.unix); Lua 5.1 as linked into Slurm 22.05 and 24.11.

local CONFIG = {
    enabled = true,
    dry_run = false,           -- log what would change, change nothing
    socket = "/run/slurmgpu/slurmgpu.sock",
    timeout_ms = 200,
    backoff_s = 10,
    marker = "SLURMGPU_DECIDED",  -- gsbatch sets <marker>=<Unix time> in the environment of jobs it decided
    marker_window_s = 300,  -- how far that time may lie from now (an inherited one is older)
    partitions = {},  -- empty: every partition
    accounts = {},    -- empty: every account
    users = {},       -- names or numeric uids; empty: everyone
}

-- The slurmgpu config when rendered: every answer is checked against it before it is applied
-- (GPU types, per-partition types and counts). nil: rendered without a config, no answer is applied.
local SITE = {
    types = {["a100"] = true, ["v100"] = true, ["t4"] = true, ["a100_1g.10gb"] = true, ["a100_3g.40gb"] = true},
    partitions = {
        ["gpu"] = { types = {["a100"] = true, ["v100"] = true}, per_node = 4, total = 4 },
        ["gpu-small"] = { types = {["t4"] = true}, per_node = 4, total = 4 },
        ["mig"] = { types = {["a100_1g.10gb"] = true, ["a100_3g.40gb"] = true}, per_node = 4, total = 4 },
    },
}

-- Advise or rewrite, and waivers, from the admin config when rendered (slurmgpu/pipeline/modes.py):
-- user (by uid, resolved when rendered) over account over partition over the global mode. Nothing
-- the job or its environment says changes them. advise: the decision is logged, never applied.
local MODES = {
    default = "rewrite",
    uids = {},
    accounts = {},
    partitions = {},
}
local WAIVERS = {}

local TIMEOUT_S = CONFIG.timeout_ms / 1000
local MAX_REQUEST = 262143  -- bytes of one request line: the daemon refuses longer ones
local MAX_REPLY = 65536
local NO_VAL = 4294967294
local TRES = { "tres_per_node", "tres_per_job", "tres_per_task", "tres_per_socket" }
local STRINGS = { "partition", "account", "qos", "name", "features", "req_nodes", "user_name" }
local NUMBERS = { "num_tasks", "min_nodes", "max_nodes", "ntasks_per_node", "cpus_per_task",
                  "sockets_per_node", "time_limit", "user_id" }
local IS_TRES = {}
for _, field in ipairs(TRES) do IS_TRES[field] = true end

local have_socket, socket = pcall(require, "socket")
local have_unix, unix = pcall(require, "socket.unix")
local down_until = 0

local function clean(text)
    return (tostring(text):gsub("%c", " "):sub(1, 400))
end

local function log_info(text) slurm.log_info("slurmgpu: %s", clean(text)) end
local function log_error(text) slurm.log_error("slurmgpu: %s", clean(text)) end

-- JSON: the request is a flat object; the answer is decoded in full, and bounded.

local ESCAPE = { ['"'] = '\\"', ["\\"] = "\\\\", ["\n"] = "\\n", ["\r"] = "\\r", ["\t"] = "\\t" }

local function quote(text)
    return '"' .. (text:gsub('[%c"\\]', function(c)
        return ESCAPE[c] or string.format("\\u%04x", c:byte())
    end)) .. '"'
end

local function encode_job(job_desc)
    local fields = {}
    for _, list in ipairs({ TRES, STRINGS }) do
        for _, key in ipairs(list) do
            local value = job_desc[key]
            if key == "account" and value == nil then value = job_desc.default_account end  -- what Slurm will use
            if type(value) == "string" then fields[#fields + 1] = quote(key) .. ":" .. quote(value) end
        end
    end
    for _, key in ipairs(NUMBERS) do
        local value = job_desc[key]
        if type(value) == "number" and value >= 0 and value < 4294967296 then
            fields[#fields + 1] = quote(key) .. ":" .. string.format("%d", value)
        end
    end
    local rest = table.concat(fields, ",")
    -- The script, cut at a line end until the escaped request fits (the directives come first).
    local script = job_desc.script
    local text = quote(script)
    while #text + #rest + 40 > MAX_REQUEST and #script > 0 do
        script = script:sub(1, math.floor(#script / 2)):match("^(.*\n)") or ""
        text = quote(script)
    end
    return '{"op":"decide","job":{"script":' .. text .. (rest ~= "" and "," or "") .. rest .. "}}\n"
end

local UNESCAPE = { b = "\b", f = "\f", n = "\n", r = "\r", t = "\t", ['"'] = '"', ["\\"] = "\\", ["/"] = "/" }
local LITERALS = { ["true"] = true, ["false"] = false }

local function skip(s, i)
    return s:find("[^ \t\r\n]", i) or #s + 1
end

local function utf8_char(code)
    if code < 0x80 then return string.char(code) end
    if code < 0x800 then return string.char(0xC0 + math.floor(code / 0x40), 0x80 + code % 0x40) end
    return string.char(0xE0 + math.floor(code / 0x1000), 0x80 + math.floor(code / 0x40) % 0x40, 0x80 + code % 0x40)
end

local function decode_string(s, i)
    local out, j = {}, i + 1
    while true do
        local k = s:find('["\\]', j)
        if not k then error("unterminated string") end
        out[#out + 1] = s:sub(j, k - 1)
        if s:sub(k, k) == '"' then return table.concat(out), k + 1 end
        local e = s:sub(k + 1, k + 1)
        if e == "u" then
            local hex = s:match("^%x%x%x%x", k + 2)
            if not hex then error("bad \\u escape") end
            out[#out + 1] = utf8_char(tonumber(hex, 16))
            j = k + 6
        elseif UNESCAPE[e] then
            out[#out + 1] = UNESCAPE[e]
            j = k + 2
        else
            error("bad escape")
        end
    end
end

local function decode_value(s, i, depth)
    if depth > 32 then error("nested too deeply") end
    i = skip(s, i)
    local c = s:sub(i, i)
    if c == "{" or c == "[" then
        local result, n, close = {}, 0, (c == "{") and "}" or "]"
        i = skip(s, i + 1)
        if s:sub(i, i) == close then return result, i + 1 end
        while true do
            local key
            if c == "{" then
                if s:sub(i, i) ~= '"' then error("expected a key") end
                key, i = decode_string(s, i)
                i = skip(s, i)
                if s:sub(i, i) ~= ":" then error("expected ':'") end
                i = i + 1
            else
                n = n + 1
                key = n
            end
            result[key], i = decode_value(s, i, depth + 1)
            i = skip(s, i)
            local sep = s:sub(i, i)
            if sep == close then return result, i + 1 end
            if sep ~= "," then error("expected ',' or '" .. close .. "'") end
            i = skip(s, i + 1)
        end
    elseif c == '"' then
        return decode_string(s, i)
    end
    local word = s:match("^%a+", i)
    if word == "null" then return nil, i + 4 end
    if LITERALS[word] ~= nil then return LITERALS[word], i + #word end
    local number = s:match("^-?%d+%.?%d*[eE]?[-+]?%d*", i)
    if number and tonumber(number) then return tonumber(number), i + #number end
    error("unexpected character at " .. i)
end

local function decode(s)
    local value, i = decode_value(s, 1, 0)
    if skip(s, i) <= #s then error("trailing characters") end
    return value
end

-- Transport: one request per connection, every step bounded by the same deadline.

local function exchange(request)
    local deadline = socket.gettime() + TIMEOUT_S
    local conn, err = unix()
    if not conn then return nil, "socket: " .. tostring(err) end
    conn:settimeout(TIMEOUT_S, "t")
    local ok
    ok, err = conn:connect(CONFIG.socket)
    if ok then
        conn:settimeout(math.max(deadline - socket.gettime(), 0), "t")
        ok, err = conn:send(request)
    end
    if not ok then
        conn:close()
        return nil, "cannot reach " .. CONFIG.socket .. ": " .. tostring(err)
    end
    conn:settimeout(0)
    local chunks, size = {}, 0
    while true do
        local left = deadline - socket.gettime()
        if left <= 0 then break end
        local readable = socket.select({ conn }, nil, left)
        if readable[1] then
            local data, status, partial = conn:receive(8192)
            local piece = data or partial or ""
            chunks[#chunks + 1] = piece
            size = size + #piece
            local newline = piece:find("\n", 1, true)
            if newline then
                conn:close()
                chunks[#chunks] = piece:sub(1, newline - 1)
                return table.concat(chunks)
            end
            if size > MAX_REPLY or status == "closed" then
                conn:close()
                return nil, size > MAX_REPLY and "answer too long" or "connection closed before a full answer"
            end
        end
    end
    conn:close()
    return nil, string.format("no answer from %s within %d ms", CONFIG.socket, CONFIG.timeout_ms)
end

-- What the answer changes: every value checked before anything is set.

local function gpu_prefix(item)
    local prefix = item:match("^(.-)gpu[:=]") or item:match("^(.-)gpu$")
    if prefix == "" or prefix == "gres:" or prefix == "gres/" then return prefix end
    return nil
end

local function has_gpu(job_desc)
    for _, field in ipairs(TRES) do
        for item in (job_desc[field] or ""):gmatch("[^,]+") do
            if gpu_prefix(item) then return true end
        end
    end
    return false
end

-- The GPU entries of a tres string replaced by one, spelt as the string spells them
-- (gres: or gres/ prefix, ':' or '=' before the count); its other entries are kept.
local function replace_gpu(current, value)
    local out, done = {}, false
    for item in current:gmatch("[^,]+") do
        local prefix = gpu_prefix(item)
        if not prefix then
            out[#out + 1] = item
        elseif not done then
            local entry = value
            if item:find("=%d+$") then entry = entry:gsub(":(%d+)$", "=%1") end
            out[#out + 1] = prefix .. entry
            done = true
        end
    end
    return done and table.concat(out, ",") or nil
end

local function default_partition(part_list)
    for name, part in pairs(part_list or {}) do
        if part.flag_default == 1 then return name end
    end
    return nil
end

-- The same checks as slurmgpu.pipeline.validate.check_decision, against the rendered config and
-- slurmctld's own partition list (only partitions this user may use; their MaxTime).
local function check_gpu(field, value, partition)
    local gtype, count = value:match("^gpu:([%w_.%-]+):(%d+)$")
    if not gtype then count = value:match("^gpu:(%d+)$") end
    count = tonumber(count)
    local part = SITE.partitions[partition or ""]
    if not part then return "the job's partition " .. tostring(partition) .. " is not in the slurmgpu config" end
    if gtype and not SITE.types[gtype] then return "GPU type " .. gtype .. " is not in the slurmgpu config" end
    if gtype and not part.types[gtype] then return "GPU type " .. gtype .. " is not offered in partition " .. partition end
    local limit = field == "tres_per_job" and part.total or part.per_node
    if not count or count < 1 or count > limit then
        return string.format("%s GPUs in %s exceed the %d partition %s has", tostring(count), field, limit, partition)
    end
    return nil
end

local function changes_for(job_desc, apply, part_list)
    if type(apply) ~= "table" then return nil, "no 'apply' object" end
    if next(apply) and SITE == nil then return nil, "hook rendered without a slurmgpu config: answers not applied" end
    local partition = job_desc.partition or default_partition(part_list)
    local changes = {}
    for field, value in pairs(apply) do
        local new
        if type(value) ~= "string" then
            return nil, "non-string value for " .. tostring(field)
        elseif field == "partition" and value:match("^[%w_.%-]+$") then
            if not SITE.partitions[value] then return nil, "partition " .. value .. " is not in the slurmgpu config" end
            if not (part_list or {})[value] then return nil, "partition " .. value .. " is not one this job's user may use" end
            new = value
            partition = value
        elseif field == "time_limit" and value:match("^%d+$") then
            -- only ever longer than the limit the job wrote (a move to a slower card), never set where it wrote none
            local old = job_desc.time_limit
            new = tonumber(value)
            if type(old) ~= "number" or old >= NO_VAL or new <= old or new >= NO_VAL then
                return nil, string.format("time limit %s min is not longer than the job's %s", value, tostring(old))
            end
        elseif IS_TRES[field] and (value:match("^gpu:%d+$") or value:match("^gpu:[%w_.%-]+:%d+$")) then
            new = job_desc[field] and replace_gpu(job_desc[field], value)
            if not new then return nil, tostring(field) .. " holds no GPU entry" end
        else
            return nil, "unexpected " .. tostring(field) .. "=" .. value
        end
        if new ~= job_desc[field] then changes[#changes + 1] = { field = field, old = job_desc[field], new = new } end
    end
    for field, value in pairs(apply) do
        if IS_TRES[field] then
            local problem = check_gpu(field, value, partition)
            if problem then return nil, problem end
        end
    end
    if apply.partition or apply.time_limit then
        local part = (part_list or {})[partition or ""]
        local limit = part and part.max_time
        local asked = apply.time_limit and tonumber(apply.time_limit) or job_desc.time_limit
        if type(limit) == "number" and type(asked) == "number" and asked < NO_VAL and limit < NO_VAL
                and asked > limit then
            return nil, string.format("time limit %d min exceeds MaxTime %d min of partition %s", asked, limit, partition)
        end
    end
    return changes
end

-- The mode for this job, and which config entry set it (the same order as modes.resolve_mode).
local function mode_of(job_desc, part_list)
    local uid = job_desc.user_id and string.format("%d", job_desc.user_id) or ""
    if MODES.uids[uid] then return MODES.uids[uid], "user " .. uid end
    local account = job_desc.account or job_desc.default_account or ""
    if MODES.accounts[account] then return MODES.accounts[account], "account " .. account end
    for name in (job_desc.partition or default_partition(part_list) or ""):gmatch("[^,]+") do
        if MODES.partitions[name] then return MODES.partitions[name], "partition " .. name end
    end
    return MODES.default, "default"
end

-- An active waiver for this job's user or account and family (the daemon names the family).
local function waiver_for(job_desc, family)
    if type(family) ~= "string" then return nil end
    local today = os.date("%Y-%m-%d")
    local uid = job_desc.user_id and string.format("%d", job_desc.user_id) or ""
    local account = job_desc.account or job_desc.default_account or ""
    for _, w in ipairs(WAIVERS) do
        if w.family == family and today <= w.expires and ((w.uid and w.uid == uid) or (w.account and w.account == account)) then
            return w
        end
    end
    return nil
end

-- The daemon's decision tag (slurmgpu:d=<id>;m=model;...) goes into the job's AdminComment, which no user
-- can set (sbatch has no option for it, scontrol update refuses it to users): sacct keeps it, and the
-- ingest links the job to the daemon's record of this decision (its source, model version and script).
-- The user's own Comment is theirs, untouched; an admin's AdminComment is never replaced.
local function tag_job(job_desc, decision)
    local tag = decision.tag
    if type(tag) ~= "string" or #tag > 80 or not tag:match("^slurmgpu:d=%x+;m=[%w.%-]+[%w.;=]*$") then return end
    if job_desc.admin_comment == nil or job_desc.admin_comment == "" then job_desc.admin_comment = tag end
end

local function describe(changes)
    local text = {}
    for _, c in ipairs(changes) do
        text[#text + 1] = string.format("%s %s -> %s", c.field, tostring(c.old or "(default)"), c.new)
    end
    return table.concat(text, ", ")
end

-- Which jobs: batch jobs asking for GPUs, not decided by gsbatch, in the covered scope.

local function in_scope(job_desc, part_list)
    if next(CONFIG.partitions) then
        local names = job_desc.partition or default_partition(part_list)
        if not names then return false end
        for name in names:gmatch("[^,]+") do
            if not CONFIG.partitions[name] then return false end
        end
    end
    if next(CONFIG.accounts) and not CONFIG.accounts[job_desc.account or job_desc.default_account or ""] then
        return false
    end
    if next(CONFIG.users) then
        local uid = job_desc.user_id and string.format("%d", job_desc.user_id) or ""
        if not (CONFIG.users[job_desc.user_name or ""] or CONFIG.users[uid]) then return false end
    end
    return true
end

local function wanted(job_desc, part_list)
    if not CONFIG.enabled or job_desc.script == nil or not has_gpu(job_desc) then return false end
    local mark = job_desc.environment and job_desc.environment[CONFIG.marker]
    if mark == "1" then return false end  -- the user's own opt-out
    local at = tonumber(mark)  -- gsbatch's: this submission's time, not a parent job's
    if at and math.abs(os.time() - at) <= CONFIG.marker_window_s then return false end
    return in_scope(job_desc, part_list)
end

-- The decision in the daemon's answer; else nil, why, and whether the daemon itself failed.
local function consult(job_desc)
    local line, err = exchange(encode_job(job_desc))
    if not line then return nil, err, true end
    local ok, reply = pcall(decode, line)
    if not ok or type(reply) ~= "table" then return nil, "unreadable answer (" .. tostring(reply) .. ")", true end
    if reply.ok ~= true then return nil, "slurmgpu says " .. tostring(reply.error), false end
    if type(reply.decision) ~= "table" then return nil, "answer without a decision", true end
    return reply.decision
end

local function decide(job_desc, part_list)
    if not (have_socket and have_unix) or not wanted(job_desc, part_list) or socket.gettime() < down_until then
        return
    end
    local who = string.format("job %s of %s", tostring(job_desc.name or "?"), tostring(job_desc.user_name or job_desc.user_id))
    local decision, err, broken = consult(job_desc)
    local changes, mode, source = nil, mode_of(job_desc, part_list)
    if decision then
        local advice = decision.advice
        if decision.mode == "advise" and type(advice) == "table" and next(advice) then
            mode, source = "advise", decision.mode_source or source
            changes, err = changes_for(job_desc, advice, part_list)
        else
            changes, err = changes_for(job_desc, decision.apply, part_list)
        end
        broken = not changes
    end
    if not changes then
        if not broken then
            log_info(string.format("%s left as submitted: %s", who, err))
            return
        end
        down_until = socket.gettime() + CONFIG.backoff_s
        log_error(string.format("%s; %s left as submitted%s", err, who,
            CONFIG.backoff_s > 0 and string.format(", jobs pass unasked for %d s", CONFIG.backoff_s) or ""))
        return
    end
    local reasons = type(decision.reasons) == "table" and decision.reasons or {}
    local why = tostring(decision.refused or reasons[#reasons] or "")
    if #changes == 0 then
        if mode ~= "advise" and not CONFIG.dry_run then tag_job(job_desc, decision) end
        log_info(string.format("%s kept as submitted: %s", who, why))
        return
    end
    local text = describe(changes)
    local waiver = waiver_for(job_desc, decision.family)
    if waiver then
        log_info(string.format("%s kept as submitted: %s (would change: %s)", who, waiver.text, text))
        return
    end
    if mode == "advise" then
        log_info(string.format("advised (%s): %s would change: %s (%s); submitted as written", source, who, text, why))
        if slurm.log_user then  -- shown by sbatch to the user who submitted
            slurm.log_user("%s", clean("slurmgpu advice: " .. text .. " (" .. why .. "); submitted as written"))
        end
        return
    end
    if CONFIG.dry_run then
        log_info(string.format("dry run: %s would change: %s (%s)", who, text, why))
        return
    end
    for _, c in ipairs(changes) do job_desc[c.field] = c.new end
    tag_job(job_desc, decision)
    log_info(string.format("%s changed: %s (%s)", who, text, why))
end

function slurm_job_submit(job_desc, part_list, submit_uid)
    local ok, err = pcall(decide, job_desc, part_list)
    if not ok then log_error("hook error, job left as submitted: " .. tostring(err)) end
    return slurm.SUCCESS
end

function slurm_job_modify(job_desc, job_rec, part_list, modify_uid)
    return slurm.SUCCESS
end

if not (have_socket and have_unix) then
    log_error("lua-socket (socket.unix) not available, GPU jobs pass unchanged: "
        .. tostring(have_socket and unix or socket))
end
return slurm.SUCCESS
