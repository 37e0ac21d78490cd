"""Graph-captured decoding on the CUDA backend: what runtime.engine.Engine.generate runs when its backend is a
CudaBackend with graphs on. Same results as the generic loop (greedy DDTree == AR), but each stage is one
CUDA graph replay and the host only moves a few small arrays per round.

Graphs (captured once per decoder, on first use, before the timed decode loop):
  ar[T]             one-token forward at the device prefix, lm_head, argmax (or sample at temperature T)
  verify[b, T]      target forward over a padded tree of b + 1 slots (bucket b in 16..1024), lm_head, pick,
                    the tap layers' hidden states concatenated (the drafter's next context)
  draft[b, k, T]    commit of the previous round (KV compaction of the accepted nodes; their tap hidden
                    states, gathered from verify[b, T]'s output, appended to the drafter's context), then the
                    drafter block, lm_head on rows 1.., per-row log-softmax top-k
Every per-round value lives in one int32 device block (`_State`) with a pinned host mirror: the prefix
length, the draft block, the commit plan, each bucket's tree (tokens, positions, visibility), and the
sampling key (the seed's two words, set once per generate). A sampled token is keyed by its row's position
(runtime/philox.py): the kernel reads the key and the positions the forward already uses, so nothing
per-round is added for sampling.
A round is: fill + upload the head of the block, replay draft, read the top-k (one D2H), build_tree, fill +
upload the bucket's tree, replay verify, read the target tokens (one D2H), walk. No allocation, no capture.

Padded tree slots hold token 0 at position start and see only themselves; no real node sees them, and the
KV they write lands past the committed prefix, where the next round overwrites it. The drafter's context
append is padded to block rows the same way: rows past the accepted count are overwritten by the block.
"""
from __future__ import annotations

import gc
import time

import numpy as np

from runtime.accept import committed_tokens, fill_draft_head, walk
from runtime.backends.base import causal_visibility
from runtime.backends.cuda_backend import CudaArray, Meter, Region
from runtime.cuda import PinnedBuffer, bench, bucket_for, capture, check
from runtime.cuda.device import driver
from runtime import dense_kernels as dk
from runtime.philox import seed_key
from runtime.tree import DraftTree, build_tree, fill_verify_slots

BUCKETS = (16, 32, 64, 128, 256, 512, 1024)


def graph_decoder(engine) -> "GraphDecoder":
    """The engine's decoder (made on first use, reused across generate calls so graphs are captured once)."""
    dec = getattr(engine, "_graph_decoder", None)
    if dec is None:
        dec = engine._graph_decoder = GraphDecoder(engine.target, engine.drafter, engine.prefill_chunk)
    return dec


class _State:
    """int32 device block of per-round inputs + its pinned host mirror. Layout (int32 words):
    start | ar_id ar_pos | key (2, the sampling seed as uint32 lo, hi) | meta = (ctx_start, m) | compact_src,
    ctx_rows, ctx_pos, draft_ids, draft_pos (block each) | per bucket: ids, pos [T], visibility [T, W]
    (T = bucket + 1)."""

    def __init__(self, backend, block: int, mask_token: int):
        self.b, self.block = backend, block
        names = [("start", 1), ("ar_id", 1), ("ar_pos", 1), ("key", 2), ("meta", 2)]
        names += [(n, block) for n in ("compact_src", "ctx_rows", "ctx_pos", "draft_ids", "draft_pos")]
        self.slots: dict = {}
        off = 0
        for n, size in names:
            self.slots[n] = (off, size)
            off += size
        self.head_words = off
        for bkt in BUCKETS:
            t, w = bkt + 1, (bkt + 1 + 31) // 32
            for n, size in (("ids", t), ("pos", t), ("vis", t * w)):
                self.slots[(n, bkt)] = (off, size)
                off += size
        self.words = off
        self.pinned = PinnedBuffer(4 * off)
        self._views: dict = {}
        self.host = self.pinned.array(np.int32, (off,))
        self.host[:] = 0
        self.dev = backend.empty((off,), np.int32)
        self.h("draft_ids")[1:] = mask_token
        self.upload(0, off)
        backend.stream.synchronize()

    def h(self, name, dtype=np.int32) -> np.ndarray:
        """The host view of a slot (made once: the round loop fills these every round)."""
        v = self._views.get((name, dtype))
        if v is None:
            off, size = self.slots[name]
            v = self._views[(name, dtype)] = self.host[off:off + size].view(dtype)
        return v

    def d(self, name, shape=None, dtype=np.int32) -> CudaArray:
        off, size = self.slots[name]
        return CudaArray(self.dev.ptr + 4 * off, shape or (size,), dtype, owner=self.dev.owner)

    def upload(self, lo: int, hi: int):
        check(driver().cuMemcpyHtoDAsync(self.dev.ptr + 4 * lo, self.pinned.ptr + 4 * lo, 4 * (hi - lo),
                                         self.b.stream.handle), "cuMemcpyHtoDAsync")

    def bucket_range(self, bkt) -> tuple[int, int]:
        return self.slots[("ids", bkt)][0], sum(self.slots[("vis", bkt)])


class _BucketSlots:
    """One bucket's host slots in the state block, as views made once (the round loop fills them with
    runtime.tree.fill_verify_slots: padded slots, from the tree's node count on, hold token 0 at the round's start
    position and see only themselves), and the word range one upload covers."""

    def __init__(self, S: _State, bkt: int):
        self.T, self.W = bkt + 1, (bkt + 1 + 31) // 32
        self.ids, self.pos = S.h(("ids", bkt)), S.h(("pos", bkt))
        self.vis = S.h(("vis", bkt), np.uint32).reshape(self.T, self.W)
        self.lo, self.hi = S.bucket_range(bkt)


class _Graph:
    """An instantiated graph, the activations region it replays into, its outputs and their pinned read-back:
    the read-back outputs are neighbours in the region, so one pinned buffer mirrors the span they cover and
    one copy reads them all (`read`), or the first rows of the first one (`read(rows=...)`)."""

    def __init__(self, exec_, region, ws, outputs: dict, readback: tuple = ()):
        self.exec, self.region, self.ws, self.out = exec_, region, ws, outputs
        self.host = {}
        if readback:
            arrays = [outputs[n] for n in readback]
            self.lo = min(a.ptr for a in arrays)
            span = max(a.ptr + a.nbytes for a in arrays) - self.lo
            self._pinned = PinnedBuffer(span)
            raw = self._pinned.array(np.uint8)
            for n, a in zip(readback, arrays):
                off = a.ptr - self.lo
                self.host[n] = raw[off:off + a.nbytes].view(a.dtype).reshape(a.shape)
            self.span, self.first = span, arrays[0]

    def read(self, stream, rows=None):
        """Queue the D2H of every read-back output (or of the first `rows` rows of the first one)."""
        if rows is None:
            src, n = self.lo, self.span
        else:
            src, n = self.first.ptr, rows * (self.first.nbytes // self.first.shape[0])
        check(driver().cuMemcpyDtoHAsync(self._pinned.ptr + (src - self.lo), src, n, stream.handle),
              "cuMemcpyDtoHAsync")


class GraphDecoder:
    def __init__(self, target, drafter=None, prefill_chunk: int = 512):
        self.target, self.drafter, self.prefill_chunk = target, drafter, prefill_chunk
        self.b = target.backend
        self.capacity = 0
        self.graphs: dict = {}
        self.block = drafter.block_size if drafter is not None else 1
        self.state = _State(self.b, self.block, drafter.mask_token_id if drafter is not None else 0)
        self._tree = None
        self._slots: dict = {}                  # bucket -> _BucketSlots
        self._round_ctx: dict = {}              # (bucket, k, temperature) -> graphs and views of a round
        S = self.state
        # head views of the state block, filled every round
        self._h_start, self._h_meta = S.h("start"), S.h("meta")
        self._h_compact, self._h_ctx_rows, self._h_ctx_pos = S.h("compact_src"), S.h("ctx_rows"), S.h("ctx_pos")
        self._h_draft_ids, self._h_draft_pos = S.h("draft_ids"), S.h("draft_pos")
        self._prev_m = self.block               # ctx_rows past the accepted count are kept at zero
        if [S.slots[n][0] for n in ("start", "ar_id", "ar_pos")] != [0, 1, 2]:
            raise RuntimeError("state block layout: the AR step expects start, ar_id, ar_pos in words 0..2")
        self._h_ar = S.host[:3]
        self._key = S.d("key", dtype=np.uint32)
        from runtime.engine import RoundStats       # (runtime.engine imports this module lazily)
        self._RoundStats = RoundStats

    # ---- buffers and graphs -------------------------------------------------------------------------------
    def _ensure_capacity(self, need: int):
        if need <= self.capacity:
            return
        self.graphs.clear()                     # they point at the old caches
        self._round_ctx.clear()                 # (it holds graphs)
        self.capacity = max(2048, -(-need // 1024) * 1024)
        self.tcache = self.target.new_cache(self.capacity)
        self.planes = dk.KVPlanes([*self.tcache.k, *self.tcache.v])
        if self.drafter is not None:
            self.dcache = self.drafter.new_cache(self.capacity + 2 * self.block)

    def _capture(self, key, fn, readback=()):
        """Run fn once for real (loads kernels, sizes scratch, measures the activations), then capture it."""
        g = self.graphs.get(key)
        if g is not None:
            return g
        b = self.b
        ws, meter = dk.Workspace(), Meter()
        with b.recording(meter, ws):
            fn()
        b.stream.synchronize()
        region = Region(meter.nbytes)
        gc.collect()            # a standalone buffer freed inside the capture would be a cuMemFree there
        gc.disable()
        try:
            with b.recording(region, ws):
                with capture(b.stream) as cap:
                    out = fn()
        finally:
            gc.enable()
        g = self.graphs[key] = _Graph(cap.instantiate(), region, ws, out, readback)
        return g

    def _pick(self, logits, temperature, positions):
        b = self.b
        return b.argmax(logits) if temperature <= 0 else b.sample(logits, temperature, positions, self._key)

    def _ar_graph(self, temperature):
        if ("ar", temperature) in self.graphs:
            return self.graphs[("ar", temperature)]
        S, b, tgt = self.state, self.b, self.target
        vis1 = b.from_host(causal_visibility(1))

        def fn():
            with b.bind_start(self.tcache.k + self.tcache.v, S.d("start")):
                self.tcache.length = 0
                h, _ = tgt.forward(self.tcache, S.d("ar_id"), S.d("ar_pos"), vis1)
            return {"tokens": self._pick(tgt.logits(h), temperature, S.d("ar_pos")), "vis": vis1}
        return self._capture(("ar", temperature), fn, readback=("tokens",))

    def _verify_graph(self, bkt, temperature):
        S, b, tgt, d = self.state, self.b, self.target, self.drafter
        t, w = bkt + 1, (bkt + 1 + 31) // 32

        def fn():
            with b.bind_start(self.tcache.k + self.tcache.v, S.d("start")):
                self.tcache.length = 0
                h, tapped = tgt.forward(self.tcache, S.d(("ids", bkt)), S.d(("pos", bkt)),
                                        S.d(("vis", bkt), (t, w), np.uint32), d.target_layer_ids)
            tokens = self._pick(tgt.logits(h), temperature, S.d(("pos", bkt)))
            taps = [tapped[i] for i in d.target_layer_ids]
            return {"tokens": tokens, "taps": b.materialize(b.concat(taps) if len(taps) > 1 else taps[0])}
        return self._capture(("verify", bkt, temperature), fn, readback=("tokens",))

    def _draft_graph(self, bkt, k, temperature):
        S, b, tgt, d = self.state, self.b, self.target, self.drafter
        taps = self._verify_graph(bkt, temperature).out["taps"]
        dkv = self.dcache.k + self.dcache.v

        def fn():
            dk.kv_compact(self.planes, S.d("compact_src"), meta=S.d("meta"), stream=b.stream)
            ctx = b.embedding(taps, S.d("ctx_rows"))
            with b.bind_start(dkv, S.d("meta", (1,))):               # context goes at ctx_start = meta[0]
                self.dcache.length = 0
                d.add_context(self.dcache, ctx, S.d("ctx_pos"))
            with b.bind_start(dkv, S.d("start")):
                self.dcache.length = 0
                dh = d.draft(self.dcache, tgt.embed(S.d("draft_ids")), S.d("draft_pos"))
            logp, ids = b.log_softmax_topk(tgt.logits(dh[1:]), k)
            return {"logp": logp, "ids": ids}
        return self._capture(("draft", bkt, k, temperature), fn, readback=("logp", "ids"))

    # ---- decoding -----------------------------------------------------------------------------------------
    def prepare(self, prompt_len: int, mode: str, max_new_tokens: int, budget: int, temperature: float,
                seed: int = 0):
        """Caches sized, the sampling key of `seed` in the state block, and every graph this generate call
        needs captured. Returns (bucket, k, n)."""
        bkt = k = n = 0
        if mode == "ddtree":
            k = min(budget, self.target.vocab_size, 1024)
            n = min(budget, (self.block - 1) * k)
        elif mode == "chain":
            k, n = 1, self.block - 1                # best-first with top-1 rows is the argmax chain
        if mode != "ar":
            bkt = bucket_for(n, BUCKETS)
        self._ensure_capacity(prompt_len + max_new_tokens + max(bkt + 1, self.block) + 2)
        S = self.state
        S.h("start")[0] = 0
        S.h("meta")[:] = 0
        S.h("key", np.uint32)[:] = seed_key(seed)
        S.upload(0, S.head_words)
        if mode == "ar":
            self._ar_graph(temperature)
        else:
            self._verify_graph(bkt, temperature)
            self._draft_graph(bkt, k, temperature)
        return bkt, k, n

    def generate(self, prompt, *, mode, max_new_tokens, temperature, seed, stop_token_ids, budget, on_tokens):
        from runtime.engine import decode_rounds, pick_tokens, prefill
        b, tgt, d = self.b, self.target, self.drafter
        stops = set(int(t) for t in stop_token_ids)
        p = len(prompt)
        bkt, k, n = self.prepare(p, mode, max_new_tokens, budget, temperature, seed)

        # prefill: eager ops through the model code (variable length; not graph material)
        t0 = time.perf_counter()
        self.tcache.length = 0
        if d is not None:
            self.dcache.length = 0
        h_last, pos_last = prefill(b, tgt, self.tcache, prompt, self.prefill_chunk, d,
                                   self.dcache if d is not None else None)
        first = int(pick_tokens(b, tgt.logits(h_last), temperature, pos_last, self._key)[0])
        prefill_s = time.perf_counter() - t0

        self.start, self.commit = p, (p, np.zeros(1, np.int32)[:0])     # nothing to commit before round 1
        if mode == "ar":
            step = lambda last: self._ar_step(last, temperature)
        else:
            step = lambda last: self._spec_round(last, bkt, k, n, temperature)
        return decode_rounds(first, step, max_new_tokens=max_new_tokens, stops=stops, on_tokens=on_tokens,
                             prefill_s=prefill_s, sync=b.stream.synchronize)

    def _wait(self):
        t = time.perf_counter()
        self.b.stream.synchronize()
        return time.perf_counter() - t

    def _ar_step(self, last: int, temperature):
        RoundStats = self._RoundStats
        S, g = self.state, self.graphs[("ar", temperature)]
        t0 = time.perf_counter()
        if self.start + 1 > self.capacity:
            raise ValueError(f"KV cache overflow: {self.start} + 1 > capacity {self.capacity}")
        head = self._h_ar                       # start | ar_id ar_pos
        head[0] = self.start
        head[1] = last
        head[2] = self.start
        S.upload(0, 3)
        g.exec.launch(self.b.stream)
        g.read(self.b.stream)
        wait = self._wait()
        tok = int(g.host["tokens"][0])
        self.start += 1
        total = time.perf_counter() - t0
        return [tok], RoundStats(committed=1, tree_size=1, times={"verify": total, "host": total - wait})

    def _round(self, bkt: int, k: int, temperature):
        """The graphs and host views one round uses (looked up once per generate configuration)."""
        key = (bkt, k, temperature)
        ctx = self._round_ctx.get(key)
        if ctx is None:
            g_draft, g_verify = self.graphs[("draft", bkt, k, temperature)], self.graphs[("verify", bkt, temperature)]
            slots = self._slots.get(bkt)
            if slots is None:
                slots = self._slots[bkt] = _BucketSlots(self.state, bkt)
            ctx = self._round_ctx[key] = (g_draft, g_verify, slots, g_draft.host["logp"], g_draft.host["ids"],
                                          g_verify.host["tokens"])
        return ctx

    def _spec_round(self, bonus: int, bkt: int, k: int, n: int, temperature):
        RoundStats = self._RoundStats
        S, b, B = self.state, self.b, self.block
        stream = b.stream
        g_draft, g_verify, slots, top_logp, top_ids, target_tokens = self._round(bkt, k, temperature)
        times, waits = {}, 0.0
        start = self.start
        if start + bkt + 1 > self.capacity or start + B > self.capacity:
            raise ValueError(f"KV cache overflow at prefix {start} (capacity {self.capacity})")

        # draft: last round's commit + this round's block
        t = time.perf_counter()
        ctx_start, accepted = self.commit
        fill_draft_head(self._h_start, self._h_meta, self._h_compact, self._h_ctx_rows, self._h_ctx_pos,
                        self._h_draft_ids, self._h_draft_pos, start, ctx_start, accepted, bonus, self._prev_m)
        self._prev_m = len(accepted)
        S.upload(0, S.head_words)
        g_draft.exec.launch(stream)
        g_draft.read(stream)
        waits += self._wait()
        times["draft"] = (t2 := time.perf_counter()) - t

        # tree, written into the bucket's slots (padded slots: token 0 at `start`, seeing only themselves)
        if self._tree is None or self._tree.capacity < n:
            self._tree = DraftTree(max(n, BUCKETS[-1]))
        tree = build_tree(top_logp, top_ids, n, bonus, out=self._tree)
        nodes, T = tree.n + 1, slots.T
        fill_verify_slots(tree, slots.ids, slots.pos, slots.vis, start)
        times["tree"] = (t3 := time.perf_counter()) - t2

        # verify
        S.upload(slots.lo, slots.hi)
        g_verify.exec.launch(stream)
        g_verify.read(stream, rows=nodes)
        waits += self._wait()
        times["verify"] = (t4 := time.perf_counter()) - t3

        accepted, new_bonus = walk(tree, target_tokens if nodes == T else target_tokens[:nodes])
        m = len(accepted)
        self.commit = (start, accepted)          # walk returns a fresh int32 array; applied by the next draft
        self.start = start + m
        new, first_moved = committed_tokens(tree, accepted, new_bonus)   # first_moved: accepted[i] != i from there
        times["walk"] = (t5 := time.perf_counter()) - t4
        times["host"] = (t5 - t) - waits
        return new, RoundStats(committed=len(new), tree_size=nodes, times=times, kv_moved=m - first_moved)

    # ---- measurement --------------------------------------------------------------------------------------
    def replay_ms(self, iters: int = 20) -> dict:
        """Median replay time of every captured graph (GPU time between events), in ms. Replays run on the
        current state, so call it after a generate (the next generate re-prefills)."""
        out = {}
        for key, g in self.graphs.items():
            name = "/".join(str(x) for x in key)
            out[name] = bench(lambda: g.exec.launch(self.b.stream), warmup=3, iters=iters, stream=self.b.stream)
        return out
