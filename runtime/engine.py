"""Decoding loops over a target model (and a DFlash drafter): prefill, autoregressive decode, DFlash chain
decode, DDTree decode. Batch 1. Greedy (temperature 0) or seeded sampling.

Sampling (temperature > 0) is keyed by sequence position (runtime/philox.py): the token after position p is
the inverse-CDF sample of softmax(logits / T) at the Philox uniform of (seed, p). An AR step and a tree node
at the same position with the same prefix draw the same token, so for a seed DDTree/chain output equals AR
output token for token, not only in distribution.

One speculative round (DESIGN.md, "One DDTree round"), with `start` = committed tokens in the target cache and
`bonus` = the last emitted token (at position start, not yet in the cache):
  draft   drafter over [bonus, MASK...] at positions start.., target lm_head on rows 1..      -> [B-1, V]
  tree    ddtree: log_softmax top-K per row -> build_tree (budget); chain: argmax -> chain_tree
  verify  target forward over the tree's tokens at positions start + depth with its visibility bitmask
  walk    the target's token at each node (argmax, or its position-keyed sample); follow matching
          children from the root; the first miss is the next bonus. Lossless at any temperature: every
          emitted token is the target's own choice at a node whose path is exactly the emitted prefix.
  commit  compact the accepted nodes' KV to slots start..start+m-1; their tap hidden states become drafter
          context at those positions.
Both caches keep `length` equal (the drafter's context covers exactly the committed tokens).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import numpy as np

from runtime.backends.base import causal_visibility
from runtime.philox import seed_key

MODES = ("ar", "chain", "ddtree")


@dataclass
class RoundStats:
    committed: int                      # tokens emitted this round (accepted drafts + the bonus)
    tree_size: int                      # nodes verified (incl. root); 1 for an AR step
    times: dict                         # stage -> seconds
    kv_moved: int = 0                   # KV slots compacted after the walk


@dataclass
class GenerationResult:
    tokens: list                        # generated token ids (stop token included when hit)
    stop_reason: str                    # "stop_token" | "max_new_tokens"
    prefill_s: float
    decode_s: float
    rounds: list = field(default_factory=list)
    reused_tokens: int = 0              # prompt tokens whose KV came from a kept cache (Engine.generate keep_cache)

    @property
    def mean_accepted(self) -> float:
        """Mean tokens committed per decode round (1.0 for AR)."""
        return float(np.mean([r.committed for r in self.rounds])) if self.rounds else 0.0

    def stage_times(self) -> dict:
        out: dict = {}
        for r in self.rounds:
            for k, v in r.times.items():
                out[k] = out.get(k, 0.0) + v
        return out


def pick_tokens(backend, logits, temperature: float, positions, key) -> np.ndarray:
    """The target's token per row: argmax at T=0, else the sample of softmax(logits / T) keyed by (key, the
    row's sequence position) (base.py `sample`). positions / key: backend arrays (int32 [T], uint32 [2])."""
    b = backend
    if temperature <= 0.0:
        return b.to_host(b.argmax(logits)).astype(np.int32)
    return b.to_host(b.sample(logits, temperature, positions, key)).astype(np.int32)


def concat_taps(backend, tapped: dict, layer_ids):
    """The drafter's context input: the target's hidden states at the tap layers, concatenated per row."""
    return backend.concat([tapped[i] for i in layer_ids]) if len(layer_ids) > 1 else tapped[layer_ids[0]]


def prefill(backend, target, cache, prompt, chunk_size: int, drafter=None, dcache=None):
    """Chunked prefill of `prompt` into `cache` after its `length` committed slots (and, with `dcache`, the
    drafter's context from the target's tap layers); returns the hidden state of the last prompt position and that
    position as a backend int32 array [1] (what the first token's sample is keyed by). In chunks so the attention scratch stays
    [chunk, prefix + chunk] however long the prompt."""
    b = backend
    taps = drafter.target_layer_ids if dcache is not None else ()
    base = cache.length                   # > 0 when a kept cache already holds the prompt's first tokens
    for c0 in range(0, len(prompt), chunk_size):
        chunk = prompt[c0:c0 + chunk_size]
        positions = b.from_host(np.arange(base + c0, base + c0 + len(chunk), dtype=np.int32))
        h, tapped = target.forward(cache, b.from_host(chunk), positions, b.from_host(causal_visibility(len(chunk))),
                                   taps)
        cache.length += len(chunk)
        if dcache is not None:
            drafter.add_context(dcache, concat_taps(b, tapped, taps), positions)
    return h[len(chunk) - 1:], positions[len(chunk) - 1:]


def decode_rounds(first: int, step: Callable, *, max_new_tokens: int, stops: set, on_tokens, prefill_s: float,
                  sync: Optional[Callable] = None) -> GenerationResult:
    """The decode loop every decoder shares: `step(last_token) -> (new tokens, RoundStats)` once per round;
    the output is cut at max_new_tokens and just after the first stop token. `sync` waits for queued device
    work before the decode time is read."""
    out = [first]
    if on_tokens:
        on_tokens([first])
    rounds: list = []
    stop_reason = "stop_token" if first in stops else ""
    t_decode = time.perf_counter()
    while not stop_reason and len(out) < max_new_tokens:
        new, stats = step(out[-1])
        new = new[:max_new_tokens - len(out)]
        for i, tok in enumerate(new):
            if tok in stops:
                new = new[:i + 1]
                stop_reason = "stop_token"
                break
        out.extend(new)
        stats.committed = len(new)          # what was emitted after max_new_tokens / stop truncation
        rounds.append(stats)
        if on_tokens:
            on_tokens(list(new))
    if sync is not None:
        sync()
    return GenerationResult(tokens=out, stop_reason=stop_reason or "max_new_tokens", prefill_s=prefill_s,
                            decode_s=time.perf_counter() - t_decode, rounds=rounds)


class Engine:
    def __init__(self, target, drafter=None, prefill_chunk: int = 512):
        if prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
        self.target, self.drafter, self.prefill_chunk = target, drafter, prefill_chunk
        self.backend = target.backend
        self._tree_workspace = None
        self._kept = None                 # (tokens held, cache, drafter cache) of the last keep_cache call

    # ---- helpers ------------------------------------------------------------------------------------------
    def _pick(self, logits, temperature: float, positions, key) -> np.ndarray:
        return pick_tokens(self.backend, logits, temperature, positions, key)

    def _taps_concat(self, tapped: dict):
        return concat_taps(self.backend, tapped, self.drafter.target_layer_ids)

    # ---- public -------------------------------------------------------------------------------------------
    def generate(self, prompt_ids: Sequence[int], *, mode: str = "ar", max_new_tokens: int = 64,
                 temperature: float = 0.0, seed: int = 0, stop_token_ids: Sequence[int] = (),
                 budget: int = 64, on_tokens: Optional[Callable[[list], None]] = None,
                 keep_cache: bool = False) -> GenerationResult:
        """Decode after prompt_ids. keep_cache: keep this call's KV caches, and start from the last kept ones where
        the prompt begins with the tokens they hold (a conversation's next turn prefills only its new tokens;
        the plain loop on any backend: the CUDA graph decoder prefills the whole prompt, which costs it little)."""
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if mode != "ar" and self.drafter is None:
            raise ValueError(f"mode {mode!r} needs a drafter")
        if budget < 1:
            raise ValueError(f"budget must be >= 1, got {budget}")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        key = seed_key(seed)                          # ValueError outside [0, 2**64)
        prompt = np.asarray(prompt_ids, dtype=np.int32)
        if prompt.ndim != 1 or len(prompt) == 0:
            raise ValueError("prompt_ids must be a non-empty 1-D token list")
        if getattr(self.backend, "graphs", False):   # CUDA backend: graph-captured rounds (runtime/cuda_engine.py)
            from runtime.cuda_engine import graph_decoder
            return graph_decoder(self).generate(prompt, mode=mode, max_new_tokens=max_new_tokens,
                                                temperature=temperature, seed=seed, stop_token_ids=stop_token_ids,
                                                budget=budget, on_tokens=on_tokens)
        b, tgt = self.backend, self.target
        stops = set(int(t) for t in stop_token_ids)
        key = b.from_host(key)
        p = len(prompt)
        block = self.drafter.block_size if self.drafter is not None else 1
        capacity = p + max_new_tokens + max(budget, block) + 2
        reused, cache, dcache = self._reuse(prompt, mode, capacity, block) if keep_cache else (0, None, None)
        if cache is None:
            if keep_cache:                # room for the turns to come: the next power of two, at least 1024
                capacity = max(1024, 1 << (capacity - 1).bit_length())
            cache = tgt.new_cache(capacity)
            dcache = self.drafter.new_cache(capacity + block) if mode != "ar" else None
        self._kept = None

        t0 = time.perf_counter()
        h_last, pos_last = prefill(b, tgt, cache, prompt[reused:], self.prefill_chunk, self.drafter, dcache)
        first = int(self._pick(tgt.logits(h_last), temperature, pos_last, key)[0])
        prefill_s = time.perf_counter() - t0

        if mode == "ar":
            step = lambda last: self._ar_step(cache, last, temperature, key)
        else:
            step = lambda last: self._spec_round(cache, dcache, last, mode, budget, temperature, key)
        result = decode_rounds(first, step, max_new_tokens=max_new_tokens, stops=stops, on_tokens=on_tokens,
                               prefill_s=prefill_s)
        result.reused_tokens = reused
        if keep_cache:                    # the cache holds the first cache.length tokens of prompt + output
            held = np.concatenate([prompt, np.asarray(result.tokens, np.int32)])[:cache.length]
            self._kept = (held, cache, dcache)
        return result

    def _reuse(self, prompt, mode: str, capacity: int, block: int):
        """(tokens reused, cache, drafter cache) from the kept caches: the longest common prefix of the prompt and
        the tokens they hold, less the prompt's last token (its logits start the decode); (0, None, None) where
        nothing is kept, the drafter context is missing (or not wanted) for this mode, or the room is short."""
        if self._kept is None:
            return 0, None, None
        held, cache, dcache = self._kept
        if (dcache is None) != (mode == "ar") or cache.capacity < capacity \
                or (dcache is not None and dcache.capacity < capacity + block):
            return 0, None, None
        n = min(len(held), len(prompt) - 1)
        diff = np.nonzero(held[:n] != prompt[:n])[0]
        reused = int(diff[0]) if len(diff) else n
        cache.length = reused
        if dcache is not None:
            dcache.length = reused
        return reused, cache, dcache

    def _ar_step(self, cache, last: int, temperature, key):
        b, tgt = self.backend, self.target
        t0 = time.perf_counter()
        pos = b.from_host(np.array([cache.length], np.int32))
        h, _ = tgt.forward(cache, b.from_host(np.array([last], np.int32)), pos, b.from_host(causal_visibility(1)))
        cache.length += 1
        tok = int(self._pick(tgt.logits(h), temperature, pos, key)[0])
        return [tok], RoundStats(committed=1, tree_size=1, times={"verify": time.perf_counter() - t0})

    def _spec_round(self, cache, dcache, bonus: int, mode: str, budget: int, temperature, key):
        from runtime.accept import walk
        from runtime.tree import DraftTree, build_tree, chain_tree
        b, tgt, d = self.backend, self.target, self.drafter
        times = {}
        start = cache.length
        assert dcache.length == start, "drafter context out of step with the target cache"

        t = time.perf_counter()
        block_ids = np.full(d.block_size, d.mask_token_id, np.int32)
        block_ids[0] = bonus
        dh = d.draft(dcache, tgt.embed(b.from_host(block_ids)),
                     b.from_host(start + np.arange(d.block_size, dtype=np.int32)))
        # a tree of `budget` nodes is at most `budget` deep, so rows past that never reach it (the lm_head over
        # the vocab is most of a draft's cost on the CPU backends)
        rows = d.block_size - 1 if mode != "ddtree" else min(d.block_size - 1, budget)
        draft_logits = tgt.logits(dh[1:1 + rows])
        times["draft"] = (t2 := time.perf_counter()) - t

        if mode == "ddtree":
            k = min(budget, tgt.vocab_size)
            logp, ids = b.log_softmax_topk(draft_logits, k)
            logp, ids = b.to_host(logp), b.to_host(ids)
            n = min(budget, logp.shape[0] * k)
            if self._tree_workspace is None or self._tree_workspace.capacity < n:
                self._tree_workspace = DraftTree(n)
            tree = build_tree(logp, ids, n, bonus, out=self._tree_workspace)
        else:
            tree = chain_tree(b.to_host(b.argmax(draft_logits)).astype(np.int32), bonus)
        tokens, depths, vis = tree.tokens.copy(), tree.depths.copy(), tree.visibility.copy()
        times["tree"] = (t3 := time.perf_counter()) - t2

        positions = b.from_host(start + depths)
        h, tapped = tgt.forward(cache, b.from_host(tokens), positions, b.from_host(vis), d.target_layer_ids)
        target_tokens = self._pick(tgt.logits(h), temperature, positions, key)
        times["verify"] = (t4 := time.perf_counter()) - t3

        accepted, new_bonus = walk(tree, target_tokens)
        times["walk"] = (t5 := time.perf_counter()) - t4

        m = len(accepted)
        moved = np.nonzero(accepted != np.arange(m))[0]
        if len(moved):
            first = int(moved[0])
            cache.compact(b, b.from_host((start + accepted[first:]).astype(np.int32)), start + first)
        cache.length = start + m
        ctx = b.embedding(self._taps_concat(tapped), b.from_host(accepted))      # gather the accepted rows
        d.add_context(dcache, ctx, b.from_host(start + np.arange(m, dtype=np.int32)))
        times["commit"] = time.perf_counter() - t5
        new = [int(x) for x in tokens[accepted[1:]]] + [int(new_bonus)]
        return new, RoundStats(committed=len(new), tree_size=len(tokens), times=times,
                               kv_moved=m - int(moved[0]) if len(moved) else 0)
