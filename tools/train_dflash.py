"""Train a DFlash drafter for a target model on the target's own greedy answers (torch: the `train` extra; CPU or GPU).

    pip install -e .[train]
    python -m tools.train_dflash            # embedded SmolLM2-135M-Instruct -> runtime.api.default_drafter_dir()
    ddtree-run --stats "Why is the sky blue?"    # takes that drafter (DDTree) when no --model / --draft is given
    python -m tools.train_dflash --model DIR|FILE.gguf --out DIR --layers 3 --steps 3000 --device cuda
    ddtree-run --model DIR|FILE.gguf --draft DIR --stats "prompt"

The drafter is runtime.models.dflash.DFlashDrafter's architecture (its docstring): the target's residual stream at
the tap layers -> fc -> hidden_norm -> per-layer K/V context; a block [bonus, MASK x (B-1)] embedded with the
target's (frozen) embedding attends to that context and to itself; norm -> the target's (frozen) lm_head gives the
draft distributions of the next B-1 tokens. The output directory (config.json + model.safetensors: bf16 like the
published DFlash checkpoints, or float32 with --save-dtype float32) is what loader.load_model reads for --draft.

Data (phase 1): prompts (built-in varied questions and tasks, or --prompts FILE, one per line) through the target's
chat template, answered greedily by the target (--new-tokens each, batched, KV-cached), recording the target's
hidden states at the tap layers for every position. Greedy answers make the labels exactly what DDTree must guess:
the token at position s + k is the target's greedy choice after the first s + k - 1 tokens.
Training (phase 2): per step, --anchors random positions s of --batch sequences; each anchor is one block (the token
at s clean, the rest MASK) that sees the context before s and its own block; cross-entropy on the block's rows
1..B-1 against the tokens at s+1..s+B-1, row k weighted exp(-(k-1)/--decay) (the first rows decide most of the
accepted length). AdamW, warm-up then cosine decay.
Evaluation (phase 3, held-out answers): per-depth accuracy of the drafter's top-1 and the mean accepted length of a
greedy chain (1 + leading correct drafts), the number DDTree's trees improve on.
"""
from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path

import numpy as np

TOPICS = ("the ocean", "volcanoes", "photosynthesis", "the Roman Empire", "black holes", "bees", "the internet",
          "climate change", "vaccines", "the moon", "electricity", "chess", "coffee", "the human heart",
          "machine learning", "earthquakes", "the printing press", "rainbows", "dinosaurs", "the stock market",
          "gravity", "music theory", "the immune system", "airplanes", "recycling", "the French Revolution",
          "DNA", "solar panels", "sleep", "mountains", "the Olympic Games", "bread baking", "friendship",
          "time zones", "batteries", "the water cycle", "Python programming", "prime numbers", "libraries",
          "the brain", "forests", "deserts", "plastic", "satellites", "languages", "democracy", "tea", "cats")
TASKS = ("Explain {t} to a ten-year-old.", "Write a short poem about {t}.", "What are three facts about {t}?",
         "Why is {t} important?", "Give me a short summary of {t}.", "Write a story that involves {t}.",
         "What is the history of {t}?", "List some common misconceptions about {t}.",
         "How would you describe {t} in one paragraph?", "What questions do scientists still ask about {t}?")
EXTRA = ("Write a Python function that reverses a string.", "What is 17 times 23? Show your steps.",
         "Translate 'good morning, how are you?' into French and Spanish.", "Write a haiku about autumn.",
         "Give me a recipe for pancakes.", "How do I sort a list in Python?", "What is the capital of Japan?",
         "Write an email asking for a day off.", "Explain the difference between a list and a tuple.",
         "Count from one to twenty in words.", "What are the planets of the solar system?",
         "Write a limerick about a cat.", "How does a for loop work?", "Summarize the plot of Romeo and Juliet.")


def builtin_prompts() -> list:
    return [task.format(t=t) for t in TOPICS for task in TASKS] + list(EXTRA)


# ------------------------------------------------------------------------------------------ target (frozen)
def rope_tables(positions, inv_freq):
    """(cos, sin) [..., d/2] of default RoPE at `positions` (the torch target covers no scaled RoPE)."""
    import torch
    f = positions[..., None].float() * inv_freq
    return torch.cos(f), torch.sin(f)


def apply_rope(x, cos, sin):
    """x [..., T, d] with NeoX halves (HF's rotate_half, as runtime's rope): cos/sin [..., T, d/2]."""
    import torch
    d = x.shape[-1] // 2
    x1, x2 = x[..., :d], x[..., d:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def rmsnorm(x, w, eps):
    import torch
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


class TorchTarget:
    """The llama-family target in float32 torch, from loader weights (HF names): greedy batched generation with a KV
    cache that records the residual stream at the tap layers. Frozen (no grad)."""

    def __init__(self, spec, weights, device):
        import torch
        from runtime.models.common import Weights, as_f32, rope_parameters
        if spec.rope_scaling.type != "default" or spec.qk_norm or spec.attention_bias:
            raise SystemExit("train_dflash: the torch target covers llama / SmolLM2-style models (default RoPE, no "
                             "q/k norm, no attention bias)")
        w = Weights(weights)
        t = lambda name: torch.from_numpy(as_f32(w.get(name))).to(device)
        self.spec, self.device = spec, device
        self.embed = t("model.embed_tokens.weight")
        self.lm_head = self.embed if spec.tie_word_embeddings else t("lm_head.weight")
        self.norm = t("model.norm.weight")
        self.layers = []
        for i in range(spec.num_hidden_layers):
            p, a = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
            self.layers.append({k: t(p + n) for k, n in (
                ("in", "input_layernorm.weight"), ("q", "self_attn.q_proj.weight"), ("k", "self_attn.k_proj.weight"),
                ("v", "self_attn.v_proj.weight"), ("o", "self_attn.o_proj.weight"),
                ("post", "post_attention_layernorm.weight"), ("gate", "mlp.gate_proj.weight"),
                ("up", "mlp.up_proj.weight"), ("down", "mlp.down_proj.weight"))})
        inv_freq, _ = rope_parameters(spec.head_dim, spec.rope_theta, spec.rope_scaling)
        self.inv_freq = torch.from_numpy(inv_freq).to(device)

    def step(self, ids, positions, pad_mask, cache, taps):
        """One forward of ids [B, T] at positions [B, T] after the cached keys (cache: per layer (k, v) [B, kv, S,
        d] or None); pad_mask [B, S + T] True where a key is real. Returns (last-row logits [B, V], the tap layers'
        outputs {layer: [B, T, hidden]}, the new cache)."""
        import torch
        import torch.nn.functional as F
        s = self.spec
        B, T = ids.shape
        x = self.embed[ids]
        cos, sin = rope_tables(positions, self.inv_freq)
        cos, sin = cos[:, None], sin[:, None]
        S = 0 if cache[0] is None else cache[0][0].shape[2]
        causal = torch.ones(T, S + T, dtype=torch.bool, device=ids.device).tril(S)
        own = torch.zeros(T, S + T, dtype=torch.bool, device=ids.device)
        own[:, S:] = torch.eye(T, dtype=torch.bool, device=ids.device)
        # a padding row sees itself (else its softmax is over nothing: NaN, which 0-weights would carry on)
        mask = (causal[None, None] & pad_mask[:, None, None, :]) | own[None, None]
        g = s.num_attention_heads // s.num_key_value_heads
        tapped, new_cache = {}, []
        for i, L in enumerate(self.layers):
            h = rmsnorm(x, L["in"], s.rms_norm_eps)
            q = (h @ L["q"].T).view(B, T, s.num_attention_heads, s.head_dim).transpose(1, 2)
            k = (h @ L["k"].T).view(B, T, s.num_key_value_heads, s.head_dim).transpose(1, 2)
            v = (h @ L["v"].T).view(B, T, s.num_key_value_heads, s.head_dim).transpose(1, 2)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            if cache[i] is not None:
                k, v = torch.cat([cache[i][0], k], 2), torch.cat([cache[i][1], v], 2)
            new_cache.append((k, v))
            o = F.scaled_dot_product_attention(q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1), attn_mask=mask)
            x = x + o.transpose(1, 2).reshape(B, T, -1) @ L["o"].T
            h = rmsnorm(x, L["post"], s.rms_norm_eps)
            x = x + (F.silu(h @ L["gate"].T) * (h @ L["up"].T)) @ L["down"].T
            if i in taps:
                tapped[i] = x
        logits = rmsnorm(x[:, -1], self.norm, s.rms_norm_eps) @ self.lm_head.T
        return logits, tapped, new_cache


def generate_answers(target, prompt_ids: list, new_tokens: int, taps, stop_ids, batch: int, log):
    """Greedy answers, batched (left padding): per sequence (token ids [n], tap states float16 [n, n_taps*hidden],
    prompt length). The answer stops after a stop token."""
    import torch
    out = []
    order = sorted(range(len(prompt_ids)), key=lambda i: len(prompt_ids[i]))   # similar lengths together
    t0 = time.perf_counter()
    for b0 in range(0, len(order), batch):
        idx = order[b0:b0 + batch]
        P = max(len(prompt_ids[i]) for i in idx)
        ids = torch.zeros(len(idx), P, dtype=torch.long)
        real = torch.zeros(len(idx), P, dtype=torch.bool)
        for r, i in enumerate(idx):
            n = len(prompt_ids[i])
            ids[r, P - n:] = torch.tensor(prompt_ids[i])
            real[r, P - n:] = True
        ids, real = ids.to(target.device), real.to(target.device)
        pos = (real.long().cumsum(1) - 1).clamp(min=0)
        cache = [None] * len(target.layers)
        tap_rows = []
        seqs = [list(prompt_ids[i]) for i in idx]
        done = [False] * len(idx)
        with torch.no_grad():
            logits, tapped, cache = target.step(ids, pos, real, cache, taps)
            tap_rows.append(torch.cat([tapped[t] for t in taps], -1))
            for _ in range(new_tokens):
                nxt = logits.argmax(-1)
                for r, t in enumerate(nxt.tolist()):     # one device-to-host copy per step
                    if not done[r]:
                        seqs[r].append(t)
                        done[r] = t in stop_ids
                if all(done):
                    break
                pos = pos[:, -1:] + 1
                real = torch.cat([real, torch.ones(len(idx), 1, dtype=torch.bool, device=real.device)], 1)
                logits, tapped, cache = target.step(nxt[:, None], pos, real, cache, taps)
                tap_rows.append(torch.cat([tapped[t] for t in taps], -1))
        states = torch.cat(tap_rows, 1)                       # [B, P + steps, taps * hidden]
        for r, i in enumerate(idx):
            n = len(prompt_ids[i])
            m = len(seqs[r])
            # row j of states is the state after token j of the padded sequence; our token j' = P - n + j'
            out.append((np.asarray(seqs[r], np.int64), states[r, P - n:P - n + m].to(torch.float16).cpu().numpy(), n))
        log(f"answers {min(b0 + batch, len(order))}/{len(order)} ({time.perf_counter() - t0:.0f} s)")
    return out


def save_answers(path: Path, data, taps) -> None:
    """The phase-1 answers as one .npz: tokens and tap states concatenated, with offsets and prompt lengths."""
    lens = np.asarray([len(t) for t, _, _ in data], np.int64)
    rows = np.asarray([s.shape[0] for _, s, _ in data], np.int64)
    np.savez(path, taps=np.asarray(taps), lens=lens, rows=rows, prompt_lens=np.asarray([p for _, _, p in data]),
             tokens=np.concatenate([t for t, _, _ in data]), states=np.concatenate([s for _, s, _ in data]))


def load_answers(path: Path, taps, hidden: int):
    z = np.load(path)
    if list(z["taps"]) != list(taps) or z["states"].shape[1] != hidden * len(taps):
        raise SystemExit(f"train_dflash: {path} holds answers for taps {list(z['taps'])}, this run taps {taps}")
    t_off, s_off = np.concatenate([[0], np.cumsum(z["lens"])]), np.concatenate([[0], np.cumsum(z["rows"])])
    return [(z["tokens"][t_off[i]:t_off[i + 1]], z["states"][s_off[i]:s_off[i + 1]], int(z["prompt_lens"][i]))
            for i in range(len(z["lens"]))]


# ------------------------------------------------------------------------------------------ drafter (trained)
def drafter_config(spec, layers: int, block: int, taps, mask_token_id: int) -> dict:
    return {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": spec.hidden_size,
            "intermediate_size": spec.intermediate_size, "num_hidden_layers": layers,
            "num_attention_heads": spec.num_attention_heads, "num_key_value_heads": spec.num_key_value_heads,
            "head_dim": spec.head_dim, "rms_norm_eps": spec.rms_norm_eps, "rope_theta": spec.rope_theta,
            "max_position_embeddings": spec.max_position_embeddings, "block_size": block,
            "num_target_layers": spec.num_hidden_layers, "vocab_size": spec.vocab_size,
            "dflash_config": {"target_layer_ids": list(taps), "mask_token_id": mask_token_id}}


class Drafter:
    """The trainable DFlash drafter (torch parameters named as the checkpoint's tensors)."""

    def __init__(self, cfg: dict, device, seed: int, final_norm=None):
        """Random weights (norm weights 1), the output norm a copy of the target's final norm when given (so the
        first logits through the frozen lm_head are on the target's scale, not tens of nats off)."""
        import torch
        g = torch.Generator().manual_seed(seed)
        h, f, n_taps = cfg["hidden_size"], cfg["intermediate_size"], len(cfg["dflash_config"]["target_layer_ids"])
        hq = cfg["num_attention_heads"] * cfg["head_dim"]
        hk = cfg["num_key_value_heads"] * cfg["head_dim"]
        d = cfg["head_dim"]

        def lin(o, i):
            return (torch.randn(o, i, generator=g) / math.sqrt(i)).to(device).requires_grad_()

        def ones(n):
            return torch.ones(n, device=device).requires_grad_()
        self.cfg = cfg
        self.p = {"fc.weight": lin(h, h * n_taps), "hidden_norm.weight": ones(h), "norm.weight": ones(h)}
        for i in range(cfg["num_hidden_layers"]):
            a = f"layers.{i}."
            self.p.update({a + "input_layernorm.weight": ones(h), a + "post_attention_layernorm.weight": ones(h),
                           a + "self_attn.q_proj.weight": lin(hq, h), a + "self_attn.k_proj.weight": lin(hk, h),
                           a + "self_attn.v_proj.weight": lin(hk, h),
                           a + "self_attn.o_proj.weight": lin(h, hq) * 0.5,
                           a + "self_attn.q_norm.weight": ones(d), a + "self_attn.k_norm.weight": ones(d),
                           a + "mlp.gate_proj.weight": lin(f, h), a + "mlp.up_proj.weight": lin(f, h),
                           a + "mlp.down_proj.weight": lin(h, f) * 0.5})
        if final_norm is not None:
            self.p["norm.weight"] = final_norm.detach().clone().to(device)
        for k, v in self.p.items():
            if not v.is_leaf or not v.requires_grad:
                self.p[k] = v.detach().requires_grad_()

    def params(self):
        return list(self.p.values())

    def forward(self, target, ctx_states, tokens, anchors, block: int):
        """Final-normed hidden of every anchor's block rows [A, block, hidden]. ctx_states [T, taps*hidden] (one
        sequence), tokens [T], anchors [A] (block a = token at anchors[a], then MASK; it sees the context before
        anchors[a] and its own rows)."""
        import torch
        import torch.nn.functional as F
        c, p = self.cfg, self.p
        eps, d = c["rms_norm_eps"], c["head_dim"]
        H, KV = c["num_attention_heads"], c["num_key_value_heads"]
        T, A = ctx_states.shape[0], anchors.shape[0]
        dev = ctx_states.device
        mask_id = c["dflash_config"]["mask_token_id"]
        blk = torch.full((A, block), mask_id, dtype=torch.long, device=dev)
        blk[:, 0] = tokens[anchors]
        x = target.embed[blk].reshape(A * block, -1)
        bpos = (anchors[:, None] + torch.arange(block, device=dev)[None]).reshape(-1)
        cpos = torch.arange(T, device=dev)
        bcos, bsin = rope_tables(bpos, target.inv_freq)
        ccos, csin = rope_tables(cpos, target.inv_freq)
        ctx = rmsnorm(ctx_states @ p["fc.weight"].T, p["hidden_norm.weight"], eps)
        # key j of the context is visible to block a iff j < anchors[a]; block keys only within the block
        see_ctx = (cpos[None, :] < anchors[:, None]).repeat_interleave(block, 0)          # [A*block, T]
        own = torch.arange(A, device=dev).repeat_interleave(block)
        see_blk = own[:, None] == own[None, :]                                           # [A*block, A*block]
        mask = torch.cat([see_ctx, see_blk], 1)[None]
        for i in range(c["num_hidden_layers"]):
            a = f"layers.{i}."
            kn, qn = p[a + "self_attn.k_norm.weight"], p[a + "self_attn.q_norm.weight"]
            ck = rmsnorm((ctx @ p[a + "self_attn.k_proj.weight"].T).view(T, KV, d), kn, eps)
            ck = apply_rope(ck.transpose(0, 1), ccos, csin)                               # [KV, T, d]
            cv = (ctx @ p[a + "self_attn.v_proj.weight"].T).view(T, KV, d).transpose(0, 1)
            h = rmsnorm(x, p[a + "input_layernorm.weight"], eps)
            q = rmsnorm((h @ p[a + "self_attn.q_proj.weight"].T).view(-1, H, d), qn, eps)
            k = rmsnorm((h @ p[a + "self_attn.k_proj.weight"].T).view(-1, KV, d), kn, eps)
            v = (h @ p[a + "self_attn.v_proj.weight"].T).view(-1, KV, d).transpose(0, 1)
            q = apply_rope(q.transpose(0, 1), bcos, bsin)
            k = apply_rope(k.transpose(0, 1), bcos, bsin)
            keys = torch.cat([ck, k], 1).repeat_interleave(H // KV, 0)
            vals = torch.cat([cv, v], 1).repeat_interleave(H // KV, 0)
            o = F.scaled_dot_product_attention(q, keys, vals, attn_mask=mask)               # [H, A*block, d]
            x = x + o.transpose(0, 1).reshape(A * block, H * d) @ p[a + "self_attn.o_proj.weight"].T
            h = rmsnorm(x, p[a + "post_attention_layernorm.weight"], eps)
            x = x + (F.silu(h @ p[a + "mlp.gate_proj.weight"].T) * (h @ p[a + "mlp.up_proj.weight"].T)) \
                @ p[a + "mlp.down_proj.weight"].T
        return rmsnorm(x, p["norm.weight"], eps).view(A, block, -1)

    def load(self, src: Path) -> None:
        """Weights of a drafter directory with this configuration (as save writes it)."""
        import torch
        import loader
        _, ckpt = loader.load_model(src)        # checks the tensors against its config.json
        want = {k: v for k, v in self.cfg.items() if k != "dflash_config"}
        got = json.loads((Path(src) / "config.json").read_text())
        if any(got.get(k) != v for k, v in want.items()) or got.get("dflash_config") != self.cfg["dflash_config"]:
            raise SystemExit(f"train_dflash: --init {src} has another configuration than this run's")
        from runtime.models.common import as_f32      # a bf16 checkpoint comes as uint16 bits
        with torch.no_grad():
            for k, v in self.p.items():
                v.copy_(torch.from_numpy(np.array(as_f32(ckpt.tensor(k)))).reshape(v.shape))   # a writable copy

    def save(self, out: Path, dtype: str = "bf16") -> None:
        """config.json + model.safetensors with the weights in bf16 (rounded to nearest even) or float32."""
        from loader import save_safetensors
        from runtime.bf16 import to_bf16
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text(json.dumps(self.cfg, indent=2) + "\n")
        arrays = {k: v.detach().float().cpu().numpy() for k, v in self.p.items()}
        if dtype == "bf16":
            arrays = {k: ("BF16", to_bf16(a).reshape(a.shape)) for k, a in arrays.items()}
        save_safetensors(out / "model.safetensors", arrays)


def block_loss(drafter, target, seq, anchors, block: int, decay: float):
    """(weighted loss, per-depth correct counts [block-1], per-depth counts [block-1]) for anchors of one sequence."""
    import torch
    import torch.nn.functional as F
    tokens, states = seq
    T = tokens.shape[0]
    anchors = anchors.to(tokens.device)
    hidden = drafter.forward(target, states, tokens, anchors, block)[:, 1:]             # rows 1..B-1
    lab_pos = anchors[:, None] + torch.arange(1, block, device=tokens.device)[None]
    valid = lab_pos < T
    labels = torch.where(valid, tokens[lab_pos.clamp(max=T - 1)], torch.full_like(lab_pos, -100))
    logits = hidden.reshape(-1, hidden.shape[-1]) @ target.lm_head.T
    ce = F.cross_entropy(logits, labels.reshape(-1), ignore_index=-100, reduction="none").view(labels.shape)
    w = torch.exp(-torch.arange(block - 1, device=tokens.device, dtype=torch.float32) / decay)[None] * valid
    loss = (ce * w).sum() / w.sum().clamp(min=1e-6)
    with torch.no_grad():
        hit = (logits.argmax(-1).view(labels.shape) == labels) & valid
    return loss, hit, valid


def evaluate(drafter, target, seqs, block: int, anchors_per_seq: int, rng) -> tuple:
    """(per-depth top-1 accuracy, mean accepted length of a greedy chain incl. the bonus) on held-out answers."""
    import torch
    hits, valids, accepted = torch.zeros(block - 1), torch.zeros(block - 1), []
    with torch.no_grad():
        for tokens, states, plen in seqs:
            anchors = sample_anchors(len(tokens), plen, anchors_per_seq, rng)
            if anchors is None:
                continue
            _, hit, valid = block_loss(drafter, target, (tokens, states), anchors, block, 1.0)
            hits += hit.sum(0).float().cpu()
            valids += valid.sum(0).float().cpu()
            lead = torch.cumprod(hit.long(), 1).sum(1)     # leading correct drafts per anchor
            accepted += (1 + lead).tolist()
    return (hits / valids.clamp(min=1)).tolist(), float(np.mean(accepted)) if accepted else float("nan")


def sample_anchors(n: int, prompt_len: int, count: int, rng):
    """Anchor positions in the answer (as at decode time: the block's clean token is a generated token, the context
    everything before it)."""
    import torch
    lo, hi = max(1, prompt_len), n - 2
    if hi < lo:
        return None
    return torch.tensor(sorted(rng.sample(range(lo, hi + 1), min(count, hi - lo + 1))))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="train_dflash", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="target: HF directory or .gguf (default: the embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--out", type=Path, help="drafter directory to write (default with no --model: "
                    "runtime.api.default_drafter_dir(), where ddtree-run looks for the default model's drafter)")
    ap.add_argument("--layers", type=int, default=2, help="drafter layers (default 2)")
    ap.add_argument("--block", type=int, default=16, help="block size: the bonus + block-1 drafted tokens (16)")
    ap.add_argument("--taps", default="", help="target layers to tap, comma-separated (default: DFlash's rule "
                    "for 3 taps: layers 1 .. n-3 evenly)")
    ap.add_argument("--mask-token", type=int, help="token id of MASK (default: <empty_output> if the vocabulary "
                    "has it, else the last id)")
    ap.add_argument("--prompts", type=Path, help="a text file of prompts, one per line (default: built-in set)")
    ap.add_argument("--new-tokens", type=int, default=160, help="tokens of each greedy answer (default 160)")
    ap.add_argument("--gen-batch", type=int, default=16, help="answers generated together (default 16)")
    ap.add_argument("--held-out", type=int, default=24, help="answers kept for evaluation (default 24)")
    ap.add_argument("--steps", type=int, default=1500, help="optimizer steps (default 1500)")
    ap.add_argument("--batch", type=int, default=2, help="answers per step (default 2)")
    ap.add_argument("--anchors", type=int, default=24, help="blocks per answer per step (default 24)")
    ap.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (default 3e-3)")
    ap.add_argument("--decay", type=float, default=4.0, help="loss weight exp(-(k-1)/decay) of block row k")
    ap.add_argument("--answers", type=Path, help="an .npz of the phase-1 answers: read when it exists (the prompts, "
                    "target and taps must be the same), else written after phase 1")
    ap.add_argument("--init", type=Path, help="start from this drafter directory's weights (continue training)")
    ap.add_argument("--save-dtype", choices=("bf16", "float32"), default="bf16",
                    help="weights of the written drafter (default bf16, as DFlash checkpoints are; the CPU and CUDA "
                         "backends run bf16 weights at their full speed)")
    ap.add_argument("--device", default="cpu", help="torch device (default cpu)")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (default: torch's choice)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    bad = [f"--{k.replace('_', '-')} {getattr(args, k)}" for k, low in (
        ("layers", 1), ("block", 2), ("new_tokens", 1), ("gen_batch", 1), ("held_out", 1), ("steps", 1),
        ("batch", 1), ("anchors", 1)) if getattr(args, k) < low]
    bad += [f"--{k} {getattr(args, k)}" for k in ("lr", "decay") if not getattr(args, k) > 0]
    if bad:
        print(f"train_dflash: out of range: {', '.join(bad)} (--block >= 2, the other counts >= 1, --lr and --decay "
              "> 0)", file=sys.stderr)
        return 2
    try:
        import torch
    except ImportError:
        print("train_dflash: needs torch (pip install -e .[train])", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    t_start = time.perf_counter()

    def log(msg):
        print(f"[{time.perf_counter() - t_start:7.1f} s] train_dflash: {msg}", file=sys.stderr, flush=True)

    import loader
    if args.out is None:
        if args.model:
            print("train_dflash: --out is needed with --model", file=sys.stderr)
            return 2
        from runtime.api import default_drafter_dir
        args.out = default_drafter_dir()
    path = Path(args.model) if args.model else loader.default_model_path()
    spec, weights = loader.load_model(path)
    tok = weights.tokenizer if path.suffix == ".gguf" else loader.load_tokenizer(path)
    target = TorchTarget(spec, weights, args.device)
    n = spec.num_hidden_layers
    try:
        taps = [int(x) for x in args.taps.split(",") if x] or loader.config.default_target_layer_ids(n, 3)
        taps_ok = all(0 <= t < n for t in taps)
    except ValueError:
        taps_ok = False
    if not taps_ok:
        print(f"train_dflash: --taps {args.taps!r}: comma-separated target layers in 0 .. {n - 1}", file=sys.stderr)
        return 2
    mask_id = args.mask_token if args.mask_token is not None else (tok.token_to_id("<empty_output>")
                                                                   or spec.vocab_size - 1)
    stops = set(tok.eos_token_ids) | set(spec.eos_token_id)
    log(f"target {path.name} ({n} layers), taps {taps}, MASK {mask_id}, block {args.block}, {args.layers} drafter "
        f"layers, device {args.device}")

    prompts = (args.prompts.read_text().splitlines() if args.prompts else builtin_prompts())
    prompts = [p for p in prompts if p.strip()]
    rng = random.Random(args.seed)
    rng.shuffle(prompts)
    if args.answers is not None and args.answers.is_file():
        data = load_answers(args.answers, taps, spec.hidden_size)
        log(f"phase 1: {len(data)} answers read from {args.answers}")
    else:
        log(f"phase 1: greedy answers to {len(prompts)} prompts ({args.new_tokens} tokens each at most)")
        prompt_ids = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}]),
                                 add_special_tokens=False) for p in prompts]
        data = generate_answers(target, prompt_ids, args.new_tokens, taps, stops, args.gen_batch, log)
        if args.answers is not None:
            save_answers(args.answers, data, taps)
            log(f"answers written to {args.answers}")
    data = [(torch.from_numpy(t).to(args.device), torch.from_numpy(s.astype(np.float32)).to(args.device), p)
            for t, s, p in data]
    rng.shuffle(data)
    held, train = data[:args.held_out], data[args.held_out:]
    if len(train) < args.batch:
        print(f"train_dflash: {len(data)} answers: fewer than --held-out {args.held_out} + --batch {args.batch}",
              file=sys.stderr)
        return 2
    log(f"{sum(len(t) - p for t, _, p in train)} answer tokens to train on, {len(held)} answers held out")

    cfg = drafter_config(spec, args.layers, args.block, taps, mask_id)
    drafter = Drafter(cfg, args.device, args.seed, final_norm=target.norm)
    if args.init is not None:
        drafter.load(args.init)
        log(f"weights from {args.init}")
    opt = torch.optim.AdamW(drafter.params(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01)
    warm = max(1, args.steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warm) * 0.5 * (
        1 + math.cos(math.pi * min(1.0, s / args.steps))))
    acc0, tau0 = evaluate(drafter, target, held, args.block, args.anchors, random.Random(1))
    log(f"phase 2: {args.steps} steps; before training: depth-1 accuracy {acc0[0]:.3f}, chain accepted {tau0:.2f}")
    run_loss = None
    for step in range(1, args.steps + 1):
        opt.zero_grad()
        total = 0.0
        for tokens, states, plen in rng.sample(train, args.batch):
            anchors = sample_anchors(len(tokens), plen, args.anchors, rng)
            if anchors is None:
                continue
            loss, _, _ = block_loss(drafter, target, (tokens, states), anchors, args.block, args.decay)
            (loss / args.batch).backward()
            total += float(loss.detach()) / args.batch
        torch.nn.utils.clip_grad_norm_(drafter.params(), 1.0)
        opt.step()
        sched.step()
        run_loss = total if run_loss is None else 0.95 * run_loss + 0.05 * total
        if step % max(1, args.steps // 20) == 0 or step == args.steps:
            log(f"step {step}/{args.steps}: loss {run_loss:.3f}, lr {sched.get_last_lr()[0]:.2e}")
        if step % max(1, args.steps // 4) == 0 or step == args.steps:
            acc, tau = evaluate(drafter, target, held, args.block, args.anchors, random.Random(1))
            log(f"  held out: top-1 accuracy by depth {' '.join(f'{a:.2f}' for a in acc[:8])} ...; chain "
                f"accepted {tau:.2f}")
            drafter.save(args.out, args.save_dtype)
    log(f"wrote {args.out} (config.json, model.safetensors); try: ddtree-run --draft {args.out} --stats \"...\"")
    return 0


if __name__ == "__main__":
    sys.exit(main())
