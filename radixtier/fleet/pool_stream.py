"""The shared pool's KV events on one stream, Mooncake-style: what any node wrote into the
namespace the fleet shares, announced with medium EXTERNAL.

Every node attached to a shared namespace (with the prefix index) can read every other node's
tier-3 pages by verified slot location; a router that knows only each node's own DISK events
still thinks a prefix lives on the node that wrote it. This process subscribes to the nodes'
KV-event streams (SGLang's wire format, with radixtier's tier-3 events joined: kv_events.py), keeps
for each block which nodes announced it in tier 3, and publishes, through SGLang's own ZMQ
publisher (sequence numbers, replay), `BlockStored` (EXTERNAL) when a block enters the pool -- its
first holder announced it, with the tokens and parent that holder sent -- and `BlockRemoved`
(EXTERNAL) when its last holder removed it. A router registers the stream as one more source
(e.g. Dynamo's indexer: `--workers "0=tcp://pool:5600,..."`) and reads a match on it as "any node
attached to the pool can load this prefix from tier 3".

**It starts from what exists.** Given the namespace (`namespace`) and, per source, the partition
its node writes (`partitions`), it reads what those partitions hold (the router tags each page was
written with: tags.namespace_tags, read-only, no lease) before it applies any node's batch, and
announces it: a pool process started, or restarted, after the writes shows the same pool as one that
ran throughout. A node whose sequence number goes back (it restarted) is read again from its
partition: what it still holds stays in the pool (no removal and re-announcement flicker), what it
lost is removed. Without the mapping it knows only what the nodes announce while it listens (a
restarted node announces its partition itself). Blocks announced without token ids are tracked
but not announced until some holder sends their tokens; device and host events (GPU, CPU)
and SGLang's AllBlocksCleared are not about the pool and are ignored. Memory: one dict entry (an
int bit mask of holders) per block, at most `max_blocks` = 4M (~0.5 GiB; past it, new blocks are
counted in `untracked` and not announced).

    python -m radixtier pool-events --source tcp://node-a:5557 --source tcp://node-b:5557 \\
        --endpoint 'tcp://*:5600'
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
from typing import Dict, List, Optional, Sequence, Tuple

import msgspec
import zmq
from sglang.srt.disaggregation.kv_events import (BlockRemoved, BlockStored, KVEventBatch, StorageMedium,
                                                 ZmqEventPublisher)

log = logging.getLogger("radixtier.pool")

DISK = StorageMedium.DISK.value
EXTERNAL = StorageMedium.EXTERNAL.value
MAX_BLOCKS = 1 << 22
ANNOUNCE_AFTER_S = 1.0  # the pool read at start is published this long after the stream opened


class PoolStream:
    """Subscribes to `sources` (ZMQ PUB endpoints of the nodes) and publishes the pool on `endpoint`.

    `_holders`: block hash -> bit mask, bit 0 set once the block was announced to the pool's
    subscribers (it came with tokens), bit n+1 for node n holding it. One thread applies the nodes'
    batches; `_holders`, `_last_seq` and `counters` change only under `_lock`, which view() and
    stats() take too (never held across I/O)."""

    def __init__(self, sources: Sequence[str], endpoint: str, replay_endpoint: Optional[str] = None,
                 topic: str = "", source_topic: str = "", max_blocks: int = MAX_BLOCKS,
                 namespace: Optional[str] = None, partitions: Optional[Sequence[Optional[int]]] = None) -> None:
        if not sources:
            raise ValueError("sources: expected at least one node's KV-event endpoint")
        if len(set(sources)) != len(sources):
            raise ValueError(f"sources: each node once, got {list(sources)!r}")
        parts = list(partitions) if partitions is not None else [None] * len(sources)
        if len(parts) != len(sources):
            raise ValueError(f"partitions: one per source ({len(sources)}), got {len(parts)}")
        known = [p for p in parts if p is not None]
        if len(set(known)) != len(known):
            raise ValueError(f"partitions: each partition once, got {known!r}")
        if known and namespace is None:
            raise ValueError("partitions: given without the namespace they are partitions of")
        self.sources = list(sources)
        self.namespace = namespace
        self.partitions = parts
        self.max_blocks = max_blocks
        self._holders: Dict[int, int] = {}
        self._last_seq: Dict[int, int] = {}
        self._lock = threading.Lock()
        self.counters = {"batches_in": 0, "decode_errors": 0, "blocks_stored": 0, "blocks_removed": 0,
                         "untracked": 0, "batches_out": 0, "without_tokens": 0, "sequence_gaps": 0,
                         "node_restarts": 0, "errors": 0, "read_from_namespace": 0}
        try:
            self._publisher = ZmqEventPublisher(0, endpoint=endpoint, replay_endpoint=replay_endpoint, topic=topic,
                                                bind=True)
        except zmq.ZMQError as exc:
            raise RuntimeError(f"endpoint: cannot publish on {endpoint!r}: {exc}") from None
        self._ctx = zmq.Context.instance()
        self._subs: List[zmq.Socket] = []
        try:
            for source in self.sources:
                sub = self._ctx.socket(zmq.SUB)
                self._subs.append(sub)
                sub.setsockopt(zmq.LINGER, 0)
                sub.connect(source)
                sub.setsockopt(zmq.SUBSCRIBE, source_topic.encode())
        except zmq.ZMQError as exc:
            self._close_sockets()
            raise RuntimeError(f"source: cannot subscribe to {source!r}: {exc}") from None
        self._decoder = msgspec.msgpack.Decoder(KVEventBatch)
        self._seeded: List[object] = []  # the pool read at start: published by the thread, before any node's batch
        try:  # before any node's batch is applied (the subscriptions queue them meanwhile)
            for node, part in enumerate(parts):
                if part is not None:
                    self._seeded += self.apply(node, [], reseed=self._read_partition(node))
        except BaseException:
            self._close_sockets()
            self._publisher.shutdown()
            atexit.unregister(self._publisher.shutdown)
            raise
        self._running = True
        self._thread = threading.Thread(target=self._run, name="radixtier-pool-events", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        if self._seeded:  # the stream just opened: subscribers (re)connect every 100 ms, a PUB drops until then
            time.sleep(ANNOUNCE_AFTER_S)
            self._publish(self._seeded)
            self._seeded = []
        poller = zmq.Poller()
        node_of = {}
        for node, sub in enumerate(self._subs):
            poller.register(sub, zmq.POLLIN)
            node_of[sub] = node
        while self._running:
            try:
                for sock, _ in poller.poll(100):
                    self._receive(node_of[sock], sock.recv_multipart())
            except Exception as exc:  # one bad batch costs that batch, never the stream
                with self._lock:
                    self.counters["errors"] += 1
                log.error("radixtier: pool events: %s", exc)

    def _receive(self, node: int, frames: List[bytes]) -> None:
        try:
            seq = int.from_bytes(frames[-2], "big", signed=True)
            batch = self._decoder.decode(frames[-1])  # [topic, sequence, payload]
        except (msgspec.DecodeError, IndexError) as exc:
            with self._lock:
                self.counters["decode_errors"] += 1
            log.warning("radixtier: pool events: undecodable batch from %s: %s", self.sources[node], exc)
            return
        with self._lock:
            last = self._last_seq.get(node)
        reseed = None
        if last is not None and seq <= last and self.partitions[node] is not None:
            reseed = self._read_partition(node)  # the node restarted: what its partition holds now
        self._publish(self.apply(node, batch.events, seq, reseed))

    def _publish(self, out: List[object]) -> None:
        if out:
            self._publisher.publish(KVEventBatch(ts=time.time(), events=out))
            with self._lock:
                self.counters["batches_out"] += 1

    def _read_partition(self, node: int) -> List[BlockStored]:
        """What `node`'s partition holds, read from the namespace, as DISK BlockStored runs (parents
        first). Read with no lock held; an unreadable namespace is logged and counts as empty."""
        from radixtier.storage.nvmeof.tags import namespace_tags

        events: List[BlockStored] = []
        try:
            for _p, pages in namespace_tags(self.namespace, [self.partitions[node]]):
                events += _as_stored(pages)
        except (OSError, ValueError) as exc:
            with self._lock:
                self.counters["errors"] += 1
            log.error("radixtier: pool events: cannot read partition %s of %s: %s", self.partitions[node],
                      self.namespace, exc)
        with self._lock:
            self.counters["read_from_namespace"] += sum(len(e.block_hashes) for e in events)
        return events

    def apply(self, node: int, events: Sequence[object], seq: Optional[int] = None,
              reseed: Optional[List[BlockStored]] = None) -> List[object]:
        """The pool's events for one batch of `node`'s events (its DISK events; the rest ignored).
        A sequence number lower than the node's last means it restarted: what it held is dropped,
        except what `reseed` (its partition read back, as DISK BlockStored) says it still holds,
        which is applied first, as it is when given alone (the pool's start)."""
        with self._lock:
            out: List[object] = []
            restarted = False
            if seq is not None:
                last = self._last_seq.get(node)
                if last is not None and seq <= last:
                    self.counters["node_restarts"] += 1
                    restarted = True
                elif last is not None and seq > last + 1:
                    self.counters["sequence_gaps"] += 1
                self._last_seq[node] = seq
            if reseed is not None:
                keep = {h for e in reseed for h in e.block_hashes}
                out += self._apply(node, reseed)
                if restarted:
                    out += self._forget(node, keep)
            elif restarted:
                out += self._forget(node, set())
            if seq is not None or reseed is None:  # a node's batch (the start's read is not one)
                self.counters["batches_in"] += 1
            return out + self._apply(node, events)

    def _forget(self, node: int, keep: set) -> List[object]:
        bit = 1 << (node + 1)
        return self._release(bit, [h for h, mask in self._holders.items() if mask & bit and h not in keep])

    def _release(self, bit: int, hashes: Sequence[int]) -> List[object]:
        """One node (`bit`) no longer holds `hashes`: the pool's removal of those nobody holds now
        and the pool had announced (bit 0), as one EXTERNAL BlockRemoved, or nothing."""
        gone = []
        for h in hashes:
            mask = self._holders.get(h)
            if mask is None or not mask & bit:
                continue
            mask &= ~bit
            if mask >> 1:
                self._holders[h] = mask
            else:
                del self._holders[h]
                if mask & 1:
                    gone.append(h)
        self.counters["blocks_removed"] += len(gone)
        return [BlockRemoved(block_hashes=gone, medium=EXTERNAL)] if gone else []

    def _apply(self, node: int, events: Sequence[object]) -> List[object]:
        out: List[object] = []
        bit = 1 << (node + 1)
        for event in events:
            if isinstance(event, BlockStored) and event.medium == DISK:
                out += self._stored(bit, event)
            elif isinstance(event, BlockRemoved) and event.medium == DISK:
                out += self._release(bit, event.block_hashes)
        return out

    def _stored(self, bit: int, event: BlockStored) -> List[object]:
        """Blocks of one DISK store: each is announced to the pool's subscribers the first time a
        holder sends it with tokens (a block without them would be ignored by a router)."""
        hashes, tokens, size = event.block_hashes, event.token_ids, event.block_size
        with_tokens = bool(tokens) and size * len(hashes) == len(tokens)
        out: List[object] = []
        run: List[int] = []
        run_tokens: List[int] = []
        parent = event.parent_block_hash
        run_parent = parent
        untracked = 0
        for i, h in enumerate(hashes):
            mask = self._holders.get(h)
            if mask is None and len(self._holders) >= self.max_blocks:
                untracked += 1
                mask = None
                announce = False
            else:
                mask = (mask or 0) | bit
                announce = with_tokens and not mask & 1
                self._holders[h] = mask | 1 if announce else mask
            if announce:
                if not run:
                    run_parent = parent
                run.append(h)
                run_tokens.extend(tokens[i * size:(i + 1) * size])
            elif run:
                out.append(self._block_stored(run, run_parent, run_tokens, event))
                run, run_tokens = [], []
            parent = h
        if run:
            out.append(self._block_stored(run, run_parent, run_tokens, event))
        self.counters["blocks_stored"] += sum(len(e.block_hashes) for e in out)
        self.counters["untracked"] += untracked
        if not with_tokens:
            self.counters["without_tokens"] += len(hashes)
        return out

    @staticmethod
    def _block_stored(hashes: List[int], parent: Optional[int], tokens: List[int], like: BlockStored) -> BlockStored:
        return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens, block_size=like.block_size,
                           lora_id=like.lora_id, medium=EXTERNAL)

    def view(self, block_hashes: Sequence[int]) -> Dict[str, object]:
        """For a request's block hashes (SGLang's, in chain order): per node, the leading blocks it
        announced in tier 3 (`disk`) and the leading blocks anyone holds in the pool, which every
        attached node can load (`external`); `pool` is that run. Nodes holding none are left out."""
        with self._lock:
            pool = 0
            disk: Dict[int, int] = {}
            for i, h in enumerate(block_hashes):
                mask = self._holders.get(h, 0) >> 1
                if not mask:
                    break
                pool = i + 1
                node = 0
                while mask:
                    if mask & 1 and disk.get(node, 0) == i:
                        disk[node] = i + 1
                    mask >>= 1
                    node += 1
        return {"pool": pool, "nodes": {self.sources[n]: {"disk": d, "external": pool} for n, d in disk.items()}}

    def stats(self) -> Dict[str, int]:
        with self._lock:
            return dict(self.counters, blocks_in_pool=len(self._holders), nodes_heard=len(self._last_seq))

    def holders(self) -> Dict[int, Tuple[bool, List[str]]]:
        """The pool as this process sees it: block hash -> (announced to the pool's subscribers, the
        sources holding it). For comparing two pool processes and for tests."""
        with self._lock:
            items = list(self._holders.items())
        return {h: (bool(mask & 1), [src for n, src in enumerate(self.sources) if mask >> (n + 1) & 1])
                for h, mask in items}

    def close(self) -> None:
        self._running = False
        self._thread.join(5)
        if not self._thread.is_alive():  # ZMQ sockets are not thread-safe: never closed under the thread
            self._close_sockets()
        self._publisher.shutdown()
        atexit.unregister(self._publisher.shutdown)  # SGLang registers it; a second call waits 1 s for nothing

    def _close_sockets(self) -> None:
        for sub in self._subs:
            sub.close()


def _as_stored(pages: Sequence[Tuple[bytes, int, Optional[int], List[int]]]) -> List[BlockStored]:
    """Tagged pages (tags.namespace_tags, parents first) as DISK BlockStored runs: a run goes on
    while each page's parent is the page before it and its token count is the run's."""
    out: List[BlockStored] = []
    for _key, h, parent, tokens in pages:
        last = out[-1] if out else None
        if last is not None and parent == last.block_hashes[-1] and len(tokens) == last.block_size \
                and bool(tokens) == bool(last.token_ids):
            last.block_hashes.append(h)
            last.token_ids.extend(tokens)
        else:
            out.append(BlockStored(block_hashes=[h], parent_block_hash=parent, token_ids=list(tokens),
                                   block_size=len(tokens), lora_id=None, medium=DISK))
    return out
