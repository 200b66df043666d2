"""The writers' Lua scripts (set or remove our entry in one page's packed value) and how they run.

Owns the scripts' text, the names EVALSHA knows them by, and running a batch of them (EVALSHA,
pipelined where the client allows; SCRIPT LOAD and once more where the server lacks them). Why a
room of its own: publishing, garbage collection and the start's rights probe all run them, the
same way, and the scripts' semantics must not drift between those callers.

Each script touches one page (KEYS[1]), so a pipeline of them stays within a Cluster slot per
chain. A value that is not whole entries, is oversized or is not a string at all is foreign: it is
replaced (a GET of another type would fail the script, and with it the page, on every publish).
"""

from __future__ import annotations

import hashlib
from types import ModuleType
from typing import List, Tuple

from radixtier.storage.index.redis_conn import Client, pipeline

UPSERT_LUA = """
local v = redis.pcall('GET', KEYS[1])
if type(v) ~= 'string' then v = '' end
local e = tonumber(ARGV[3])
if #v % e ~= 0 or #v > e * 4 * tonumber(ARGV[4]) then v = '' end
local me = ARGV[1]
for i = 0, #v / e - 1 do
  if string.sub(v, i * e + 1, i * e + #me) == me then
    redis.call('SET', KEYS[1], string.sub(v, 1, i * e) .. me .. ARGV[2] .. string.sub(v, (i + 1) * e + 1))
    return #v / e
  end
end
if #v / e >= tonumber(ARGV[4]) then v = string.sub(v, e + 1) end
redis.call('SET', KEYS[1], v .. me .. ARGV[2])
return #v / e + 1
"""
REMOVE_LUA = """
local v = redis.pcall('GET', KEYS[1])
if type(v) == 'table' then redis.call('DEL', KEYS[1]) return 0 end
if not v then return 0 end
local e = tonumber(ARGV[2])
if #v % e ~= 0 then redis.call('DEL', KEYS[1]) return 0 end
local me = ARGV[1]
for i = 0, #v / e - 1 do
  if string.sub(v, i * e + 1, i * e + #me) == me then
    v = string.sub(v, 1, i * e) .. string.sub(v, (i + 1) * e + 1)
    break
  end
end
if #v == 0 then redis.call('DEL', KEYS[1]) return 0 end
redis.call('SET', KEYS[1], v)
return #v / e
"""

SCRIPTS = {"upsert": UPSERT_LUA, "remove": REMOVE_LUA}
SHA = {name: hashlib.sha1(text.encode()).hexdigest() for name, text in SCRIPTS.items()}  # what EVALSHA names

Call = Tuple[str, str, list]  # (script name, page key, args)


def load_scripts(client: Client) -> None:
    """SCRIPT LOAD of the writers' scripts (on every primary of a Cluster): what a server
    without them (a restart, SCRIPT FLUSH) needs before EVALSHA finds them again."""
    for source in SCRIPTS.values():
        client.script_load(source)


class ScriptRunner:
    """Runs batches of the writers' scripts for one client kind (standalone or Cluster); stateless."""

    def __init__(self, redis: ModuleType, cluster: bool) -> None:
        self._no_script = redis.exceptions.NoScriptError
        self._response_error = redis.ResponseError
        self._cluster = cluster

    def is_no_script(self, reply: object) -> bool:
        """Whether a reply says the server lacks the scripts (NOSCRIPT)."""
        return isinstance(reply, self._no_script)

    def run(self, client: Client, calls: List[Call], load: bool = True) -> list:
        """Run the writers' scripts (name, page key, args) by EVALSHA, pipelined where the client
        allows it (redis-py refuses scripts in a Cluster pipeline: there they run one by one, off
        the serving path); replies in order, a failed call's error in its place. A server that
        lacks the scripts gets them (SCRIPT LOAD) and the calls run once more (each is idempotent).
        Why not redis-py's Script objects: in a pipeline they send SCRIPT EXISTS before every
        batch, one more round trip and one more right the start check did not see."""
        if not calls:
            return []
        replies = self._evalsha(client, calls)
        if load and any(isinstance(r, self._no_script) for r in replies):
            load_scripts(client)
            replies = self._evalsha(client, calls)
        return replies

    def _evalsha(self, client: Client, calls: List[Call]) -> list:
        if self._cluster:
            out: list = []
            for name, key, args in calls:
                try:
                    out.append(client.evalsha(SHA[name], 1, key, *args))
                except self._response_error as exc:
                    out.append(exc)
            return out
        pipe = pipeline(client, False)
        for name, key, args in calls:
            pipe.evalsha(SHA[name], 1, key, *args)
        return list(pipe.execute(raise_on_error=False))
