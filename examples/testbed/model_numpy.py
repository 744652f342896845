"""CPU model runner: a small random-weight decoder-only transformer in numpy.

Pre-norm (RMSNorm) blocks with multi-head causal self-attention over a *paged* KV cache
(``k_cache[layer, slot, head, dim]``, slot = block_id * block_size + offset) and a ReLU MLP;
sinusoidal absolute positions; tied-free LM head. Weights come from a fixed seed, so every run of
the testbed generates the same tokens for the same prompt under greedy sampling.

Per step (the engine calls :meth:`execute`):
  1. KV copies queued by the KV manager (D2H offload, then H2D onload, in issue order);
  2. one forward pass over all scheduled tokens of all requests (prefill chunks + decodes):
     linear layers batched over the step's tokens, attention per request over its paged context;
     only the scheduled tokens are computed, cached prefix blocks are read from the cache;
  3. logits for the last token of every request whose scheduled tokens reach its end;
  4. sampling (greedy for temperature 0, else seeded top-k/top-p sampling).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from .tokenizer import EOS_ID, SAMPLEABLE_IDS


@dataclass
class ModelConfig:
    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 4
    d_ff: int = 512
    vocab_size: int = 320
    max_model_len: int = 16384
    seed: int = 0


@dataclass
class SeqPlan:
    req_id: str
    row_start: int  # first row of this request's tokens in the step's flat token array
    num_tokens: int  # tokens scheduled this step
    start_pos: int  # position of the first scheduled token (= tokens already computed)
    block_ids: list[int]
    needs_logits: bool
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    allow_eos: bool = False
    rng: Optional[np.random.Generator] = None


@dataclass
class BatchPlan:
    token_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slot_mapping: list[int] = field(default_factory=list)
    seqs: list[SeqPlan] = field(default_factory=list)


@dataclass
class CopyRecord:
    req_id: str
    dir: str
    start_ns: int
    end_ns: int
    bytes: int
    blocks: int


def init_weights(mcfg: ModelConfig) -> dict:
    """Random weights from a fixed seed (shared by the numpy and torch runners)."""
    d, L, F, V = mcfg.d_model, mcfg.n_layers, mcfg.d_ff, mcfg.vocab_size
    rng = np.random.default_rng(mcfg.seed)
    f32 = np.float32
    emb = rng.standard_normal((V, d)).astype(f32)
    layers = []
    for _ in range(L):
        layers.append(
            dict(
                wqkv=(rng.standard_normal((d, 3 * d)) / math.sqrt(d)).astype(f32),
                wo=(rng.standard_normal((d, d)) / math.sqrt(d)).astype(f32),
                w1=(rng.standard_normal((d, F)) / math.sqrt(d)).astype(f32),
                w2=(rng.standard_normal((F, d)) / math.sqrt(F)).astype(f32),
            )
        )
    lm_head = (rng.standard_normal((d, V)) * (3.0 / math.sqrt(d))).astype(f32)
    return {"emb": emb, "layers": layers, "lm_head": lm_head}


def make_logit_bias(vocab_size: int, allow_eos: bool) -> np.ndarray:
    bias = np.full((vocab_size,), -np.inf, dtype=np.float32)
    bias[SAMPLEABLE_IDS] = 0.0
    if allow_eos:
        bias[EOS_ID] = 0.0
    return bias


def sample_from_logits(logits: np.ndarray, sp: SeqPlan, bias: np.ndarray, bias_eos: np.ndarray) -> int:
    z = logits.astype(np.float64) + (bias_eos if sp.allow_eos else bias)
    if sp.temperature <= 1e-5:
        return int(np.argmax(z))
    z = z / sp.temperature
    if sp.top_k and sp.top_k > 0:
        kth = np.partition(z, -sp.top_k)[-sp.top_k]
        z = np.where(z < kth, -np.inf, z)
    z = z - np.max(z)
    p = np.exp(z)
    p /= p.sum()
    if sp.top_p < 1.0:
        order = np.argsort(-p)
        cum = np.cumsum(p[order])
        keep = order[: int(np.searchsorted(cum, sp.top_p)) + 1]
        q = np.zeros_like(p)
        q[keep] = p[keep]
        p = q / q.sum()
    rng = sp.rng if sp.rng is not None else np.random.default_rng()
    return int(rng.choice(len(p), p=p))


class NumpyModelRunner:
    device = "cpu"

    def __init__(self, mcfg: ModelConfig, num_blocks: int, block_size: int, host_blocks: int = 0):
        self.cfg = mcfg
        self.block_size = block_size
        d, L, H, V = mcfg.d_model, mcfg.n_layers, mcfg.n_heads, mcfg.vocab_size
        assert d % H == 0
        self.head_dim = d // H
        w = init_weights(mcfg)
        self.emb, self.layers, self.lm_head = w["emb"], w["layers"], w["lm_head"]
        num_slots = num_blocks * block_size
        f32 = np.float32
        # np.zeros is calloc-backed: untouched blocks cost no memory.
        self.k_cache = np.zeros((L, num_slots, H, self.head_dim), dtype=f32)
        self.v_cache = np.zeros((L, num_slots, H, self.head_dim), dtype=f32)
        self.host_k = np.zeros((L, max(host_blocks, 0) * block_size, H, self.head_dim), dtype=f32)
        self.host_v = np.zeros_like(self.host_k)
        self.block_bytes = 2 * L * block_size * d * 4
        inv = 1.0 / (10000.0 ** (np.arange(0, d, 2, dtype=np.float64) / d))
        self._inv_freq = inv
        self._bias = make_logit_bias(V, False)
        self._bias_eos = make_logit_bias(V, True)

    # ------------------------------------------------------------ KV copies
    def run_copies(self, ops) -> list[CopyRecord]:
        recs: list[CopyRecord] = []
        bs = self.block_size
        for op in ops:
            t0 = time.monotonic_ns()
            dsl = slice(op.device_block * bs, (op.device_block + 1) * bs)
            hsl = slice(op.host_slot * bs, (op.host_slot + 1) * bs)
            if op.dir == "d2h":
                self.host_k[:, hsl] = self.k_cache[:, dsl]
                self.host_v[:, hsl] = self.v_cache[:, dsl]
            else:
                self.k_cache[:, dsl] = self.host_k[:, hsl]
                self.v_cache[:, dsl] = self.host_v[:, hsl]
            t1 = time.monotonic_ns()
            # merge consecutive ops of the same request and direction into one record
            if recs and recs[-1].req_id == op.req_id and recs[-1].dir == op.dir:
                recs[-1].end_ns = t1
                recs[-1].bytes += self.block_bytes
                recs[-1].blocks += 1
            else:
                recs.append(CopyRecord(op.req_id, op.dir, t0, t1, self.block_bytes, 1))
        return recs

    # -------------------------------------------------------------- forward
    def _pos_enc(self, positions: np.ndarray) -> np.ndarray:
        ang = positions[:, None].astype(np.float64) * self._inv_freq[None, :]
        out = np.empty((len(positions), self.cfg.d_model), dtype=np.float32)
        out[:, 0::2] = np.sin(ang)
        out[:, 1::2] = np.cos(ang)
        return out

    @staticmethod
    def _rmsnorm(x: np.ndarray) -> np.ndarray:
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + 1e-6)

    def forward(self, plan: BatchPlan) -> np.ndarray:
        H, Dh, d = self.cfg.n_heads, self.head_dim, self.cfg.d_model
        bs = self.block_size
        ids = np.asarray(plan.token_ids, dtype=np.int64)
        pos = np.asarray(plan.positions, dtype=np.int64)
        slots = np.asarray(plan.slot_mapping, dtype=np.int64)
        T = len(ids)
        x = self.emb[ids] + self._pos_enc(pos)
        ctx_slots = []
        for sp in plan.seqs:
            ctx_len = sp.start_pos + sp.num_tokens
            blocks = np.asarray(sp.block_ids[: -(-ctx_len // bs)], dtype=np.int64)
            s = (blocks[:, None] * bs + np.arange(bs)[None, :]).reshape(-1)[:ctx_len]
            ctx_slots.append(s)
        scale = 1.0 / math.sqrt(Dh)
        for li, lw in enumerate(self.layers):
            h = self._rmsnorm(x)
            qkv = h @ lw["wqkv"]
            q = qkv[:, :d].reshape(T, H, Dh)
            k = qkv[:, d : 2 * d].reshape(T, H, Dh)
            v = qkv[:, 2 * d :].reshape(T, H, Dh)
            kc, vc = self.k_cache[li], self.v_cache[li]
            kc[slots] = k  # "reshape_and_cache": write this step's K/V into their slots
            vc[slots] = v
            attn = np.empty((T, H, Dh), dtype=np.float32)
            for sp, cs in zip(plan.seqs, ctx_slots):
                r0, n = sp.row_start, sp.num_tokens
                qh = q[r0 : r0 + n].transpose(1, 0, 2)  # H,n,Dh
                K = kc[cs].transpose(1, 2, 0)  # H,Dh,S
                V = vc[cs].transpose(1, 0, 2)  # H,S,Dh
                sc = (qh @ K) * scale  # H,n,S
                if n > 1:
                    S = len(cs)
                    mask = np.arange(S)[None, :] > (sp.start_pos + np.arange(n))[:, None]
                    sc = np.where(mask[None], -np.inf, sc)
                sc = sc - sc.max(axis=-1, keepdims=True)
                np.exp(sc, out=sc)
                sc /= sc.sum(axis=-1, keepdims=True)
                attn[r0 : r0 + n] = (sc @ V).transpose(1, 0, 2)
            x = x + attn.reshape(T, d) @ lw["wo"]
            h = self._rmsnorm(x)
            x = x + np.maximum(h @ lw["w1"], 0.0) @ lw["w2"]
        rows = [sp.row_start + sp.num_tokens - 1 for sp in plan.seqs if sp.needs_logits]
        if not rows:
            return np.zeros((0, self.cfg.vocab_size), dtype=np.float32)
        return self._rmsnorm(x[rows]) @ self.lm_head

    def execute(self, plan: BatchPlan, ops) -> tuple[dict[str, int], list[CopyRecord], dict[str, int]]:
        """Returns (sampled token per request, KV copy records, phase timestamps)."""
        marks: dict[str, int] = {}
        recs = self.run_copies(ops) if ops else []
        marks["copies_end_ns"] = time.monotonic_ns()
        logits = self.forward(plan) if plan.token_ids else np.zeros((0, self.cfg.vocab_size), np.float32)
        marks["forward_end_ns"] = time.monotonic_ns()
        sampled: dict[str, int] = {}
        i = 0
        for sp in plan.seqs:
            if sp.needs_logits:
                sampled[sp.req_id] = sample_from_logits(logits[i], sp, self._bias, self._bias_eos)
                i += 1
        marks["sample_end_ns"] = time.monotonic_ns()
        return sampled, recs, marks
