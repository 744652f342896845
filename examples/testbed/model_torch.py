"""GPU model runner (torch): the same random-weight transformer as model_numpy (same seed, same
weights), run with real CUDA kernels.

* KV cache on the device, laid out per block: ``k_cache[block, layer, offset, head, dim]`` (one
  extra scratch block at the end takes the writes of padded CUDA-graph rows). A block's K (and V)
  for all layers is contiguous, so offloading one block is one D2H ``cudaMemcpyAsync`` per tensor.
* Each step: KV copies (D2H offload to / H2D onload from a *pinned* host pool, then a stream
  synchronise so the copy span is real), then the forward pass:
    - decode rows (1 new token each) batched together: embedding, QKV GEMM, scatter of the new K/V
      into their slots ("reshape_and_cache"), gather of each row's paged context, SDPA with a length
      mask, MLP; optionally replayed from a CUDA graph captured per batch-size bucket
      (``--cuda-graphs``, contexts up to ``graph_max_len`` tokens);
    - prefill chunks one request at a time (causal mask offset by the cached prefix);
  then sampling on the device (greedy argmax or inverse-CDF with a host-drawn uniform, so seeded
  requests are reproducible), and — as vLLM does — the sampled ids are copied into a small pinned
  host buffer (non_blocking D2H) followed by an event synchronize, which ends the step.
* ``device="cpu"`` runs the same code on the CPU (``--device torch-cpu``) for testing without a GPU.
"""

from __future__ import annotations

import math
import time
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F

from .model_numpy import BatchPlan, CopyRecord, ModelConfig, SeqPlan, init_weights, make_logit_bias

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class TorchModelRunner:
    def __init__(self, mcfg: ModelConfig, num_blocks: int, block_size: int, host_blocks: int = 0,
                 device: str = "cuda", dtype: str = "auto", cuda_graphs: bool = False, max_num_seqs: int = 32,
                 graph_max_len: int = 4096):
        if device == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("--device cuda: torch.cuda.is_available() is False")
        self.cfg = mcfg
        self.is_cuda = device == "cuda"
        self.dev = torch.device("cuda", torch.cuda.current_device()) if self.is_cuda else torch.device("cpu")
        self.device = "cuda" if self.is_cuda else "torch-cpu"
        if dtype == "auto":
            dtype = "bfloat16" if self.is_cuda else "float32"
        self.dtype = _DTYPES[dtype]
        self.dtype_name = dtype
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.scratch_block = num_blocks  # padded graph rows write here
        d, L, H = mcfg.d_model, mcfg.n_layers, mcfg.n_heads
        self.H, self.Dh, self.L, self.d = H, d // H, L, d
        w = init_weights(mcfg)

        def t(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(a).to(self.dev, self.dtype)

        self.emb = t(w["emb"])
        self.layers = [{k: t(v) for k, v in lw.items()} for lw in w["layers"]]
        self.lm_head = t(w["lm_head"])
        inv = 1.0 / (10000.0 ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
        self.inv_freq = inv.to(self.dev, torch.float32)
        self.k_cache = torch.zeros((num_blocks + 1, L, block_size, H, self.Dh), dtype=self.dtype, device=self.dev)
        self.v_cache = torch.zeros_like(self.k_cache)
        pin = self.is_cuda
        self.host_k: Optional[torch.Tensor] = None
        self.host_v: Optional[torch.Tensor] = None
        if host_blocks > 0:
            self.host_k = torch.zeros((host_blocks, L, block_size, H, self.Dh), dtype=self.dtype, pin_memory=pin)
            self.host_v = torch.zeros(self.host_k.shape, dtype=self.dtype, pin_memory=pin)
        self.block_bytes = 2 * self.k_cache[0].numel() * self.k_cache.element_size()
        self.bias = torch.from_numpy(make_logit_bias(mcfg.vocab_size, False)).to(self.dev)
        self.bias_eos = torch.from_numpy(make_logit_bias(mcfg.vocab_size, True)).to(self.dev)
        self.max_rows = max(1, max_num_seqs)
        self.sampled_host = torch.zeros((self.max_rows,), dtype=torch.int64, pin_memory=pin)
        self.step_event = torch.cuda.Event() if self.is_cuda else None
        self.offs = torch.arange(block_size, device=self.dev)
        self.graphs: dict[int, tuple] = {}
        self.graph_mb = max(1, min(graph_max_len, mcfg.max_model_len) // block_size)
        if cuda_graphs and self.is_cuda:
            self._capture_graphs(max_num_seqs)

    # ---------------------------------------------------------------- helpers
    def _sync(self) -> None:
        if self.is_cuda:
            torch.cuda.current_stream(self.dev).synchronize()

    def _pos_enc(self, pos: torch.Tensor) -> torch.Tensor:
        ang = pos.to(torch.float32)[:, None] * self.inv_freq[None, :]
        return torch.stack((torch.sin(ang), torch.cos(ang)), dim=-1).reshape(pos.shape[0], self.d).to(self.dtype)

    @staticmethod
    def _rmsnorm(x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)

    def _tensor(self, data, dtype=torch.int64) -> torch.Tensor:
        t = torch.tensor(data, dtype=dtype)
        if self.is_cuda:
            return t.pin_memory().to(self.dev, non_blocking=True)
        return t

    # ------------------------------------------------------------- KV copies
    def run_copies(self, ops) -> list[CopyRecord]:
        """Offload/onload whole blocks through the pinned host pool, in issue order, then wait for
        them so each record spans the real transfer."""
        recs: list[CopyRecord] = []
        if not ops:
            return recs
        assert self.host_k is not None and self.host_v is not None
        t_start = time.monotonic_ns()
        groups: list[tuple[str, str, int]] = []  # (req, dir, blocks) in issue order
        for op in ops:
            if op.dir == "d2h":
                self.host_k[op.host_slot].copy_(self.k_cache[op.device_block], non_blocking=True)
                self.host_v[op.host_slot].copy_(self.v_cache[op.device_block], non_blocking=True)
            else:
                self.k_cache[op.device_block].copy_(self.host_k[op.host_slot], non_blocking=True)
                self.v_cache[op.device_block].copy_(self.host_v[op.host_slot], non_blocking=True)
            if groups and groups[-1][0] == op.req_id and groups[-1][1] == op.dir:
                groups[-1] = (op.req_id, op.dir, groups[-1][2] + 1)
            else:
                groups.append((op.req_id, op.dir, 1))
        self._sync()
        t_end = time.monotonic_ns()
        # one stream: the copies ran back to back; split the span by bytes
        total = sum(g[2] for g in groups)
        t = t_start
        for req, dr, n in groups:
            dt = (t_end - t_start) * n // total
            recs.append(CopyRecord(req, dr, t, t + dt, n * self.block_bytes, n))
            t += dt
        return recs

    # ------------------------------------------------------------ decode path
    def _decode_core(self, ids, pos, blk, off, block_table, ctx_len) -> torch.Tensor:
        """Batched single-token rows. All shapes depend only on (B, MB): CUDA-graph capturable."""
        B, MB = block_table.shape
        bs = self.block_size
        S = MB * bs
        x = self.emb[ids] + self._pos_enc(pos)
        key_blk = block_table.repeat_interleave(bs, dim=1)  # B,S
        key_off = self.offs.repeat(MB).unsqueeze(0).expand(B, S)  # B,S
        key_pos = torch.arange(S, device=ids.device)
        mask = (key_pos.unsqueeze(0) < ctx_len.unsqueeze(1)).view(B, 1, 1, S)
        H, Dh, d = self.H, self.Dh, self.d
        for li, lw in enumerate(self.layers):
            h = self._rmsnorm(x)
            qkv = h @ lw["wqkv"]
            q, k, v = qkv[:, :d].view(B, H, Dh), qkv[:, d:2 * d].view(B, H, Dh), qkv[:, 2 * d:].view(B, H, Dh)
            self.k_cache[blk, li, off] = k  # reshape_and_cache: scatter this step's K/V
            self.v_cache[blk, li, off] = v
            K = self.k_cache[key_blk, li, key_off].transpose(1, 2)  # B,H,S,Dh
            V = self.v_cache[key_blk, li, key_off].transpose(1, 2)
            o = F.scaled_dot_product_attention(q.unsqueeze(2), K, V, attn_mask=mask)  # B,H,1,Dh
            x = x + o.reshape(B, d) @ lw["wo"]
            h = self._rmsnorm(x)
            x = x + torch.relu(h @ lw["w1"]) @ lw["w2"]
        return (self._rmsnorm(x) @ self.lm_head).float()

    def _capture_graphs(self, max_num_seqs: int) -> None:
        sizes = [1, 2, 4, 8] + list(range(16, max(16, max_num_seqs) + 1, 16))
        sizes = sorted({b for b in sizes if b <= max(1, max_num_seqs)} | {max(1, max_num_seqs)}, reverse=True)
        pool = torch.cuda.graph_pool_handle()
        MB = self.graph_mb
        for B in sizes:
            inp = {
                "ids": torch.zeros((B,), dtype=torch.int64, device=self.dev),
                "pos": torch.zeros((B,), dtype=torch.int64, device=self.dev),
                "blk": torch.full((B,), self.scratch_block, dtype=torch.int64, device=self.dev),
                "off": torch.zeros((B,), dtype=torch.int64, device=self.dev),
                "bt": torch.full((B, MB), self.scratch_block, dtype=torch.int64, device=self.dev),
                "ctx": torch.ones((B,), dtype=torch.int64, device=self.dev),
            }
            s = torch.cuda.Stream(self.dev)
            s.wait_stream(torch.cuda.current_stream(self.dev))
            with torch.no_grad(), torch.cuda.stream(s):
                for _ in range(2):
                    self._decode_core(inp["ids"], inp["pos"], inp["blk"], inp["off"], inp["bt"], inp["ctx"])
            torch.cuda.current_stream(self.dev).wait_stream(s)
            torch.cuda.synchronize(self.dev)
            g = torch.cuda.CUDAGraph()
            with torch.no_grad(), torch.cuda.graph(g, pool=pool):
                out = self._decode_core(inp["ids"], inp["pos"], inp["blk"], inp["off"], inp["bt"], inp["ctx"])
            self.graphs[B] = (g, inp, out)
        torch.cuda.synchronize(self.dev)

    def _decode(self, seqs: list[SeqPlan], token_ids: list[int]) -> torch.Tensor:
        bs = self.block_size
        n = len(seqs)
        pos = [sp.start_pos for sp in seqs]
        ids = [token_ids[sp.row_start] for sp in seqs]
        blk = [sp.block_ids[p // bs] for sp, p in zip(seqs, pos)]
        off = [p % bs for p in pos]
        ctx = [p + 1 for p in pos]
        mb_needed = max(-(-c // bs) for c in ctx)
        bucket = None
        if self.graphs and mb_needed <= self.graph_mb:
            bucket = min((b for b in self.graphs if b >= n), default=None)
        if bucket is not None:
            g, inp, out = self.graphs[bucket]
            MB = self.graph_mb
            pad = bucket - n
            bt = [(sp.block_ids[:-(-c // bs)] + [self.scratch_block] * MB)[:MB] for sp, c in zip(seqs, ctx)]
            bt += [[self.scratch_block] * MB] * pad
            host = torch.tensor([ids + [0] * pad, pos + [0] * pad, blk + [self.scratch_block] * pad,
                                 off + [0] * pad, ctx + [1] * pad], dtype=torch.int64)
            inp["ids"].copy_(host[0], non_blocking=True)
            inp["pos"].copy_(host[1], non_blocking=True)
            inp["blk"].copy_(host[2], non_blocking=True)
            inp["off"].copy_(host[3], non_blocking=True)
            inp["ctx"].copy_(host[4], non_blocking=True)
            inp["bt"].copy_(torch.tensor(bt, dtype=torch.int64), non_blocking=True)
            g.replay()
            return out[:n]
        MB = mb_needed
        bt = [(sp.block_ids[:-(-c // bs)] + [self.scratch_block] * MB)[:MB] for sp, c in zip(seqs, ctx)]
        return self._decode_core(self._tensor(ids), self._tensor(pos), self._tensor(blk), self._tensor(off),
                                 self._tensor(bt), self._tensor(ctx))

    # ----------------------------------------------------------- prefill path
    def _prefill(self, sp: SeqPlan, token_ids: list[int]) -> torch.Tensor:
        bs = self.block_size
        n, start = sp.num_tokens, sp.start_pos
        ctx = start + n
        pos_l = list(range(start, ctx))
        ids = self._tensor(token_ids[sp.row_start:sp.row_start + n])
        pos = self._tensor(pos_l)
        blk = self._tensor([sp.block_ids[p // bs] for p in pos_l])
        off = self._tensor([p % bs for p in pos_l])
        nblk = -(-ctx // bs)
        kblk = self._tensor(sp.block_ids[:nblk]).repeat_interleave(bs)[:ctx]
        koff = self.offs.repeat(nblk)[:ctx]
        key_pos = torch.arange(ctx, device=self.dev)
        mask = (key_pos.unsqueeze(0) <= pos.unsqueeze(1)).view(1, 1, n, ctx)
        H, Dh, d = self.H, self.Dh, self.d
        x = self.emb[ids] + self._pos_enc(pos)
        for li, lw in enumerate(self.layers):
            h = self._rmsnorm(x)
            qkv = h @ lw["wqkv"]
            q, k, v = qkv[:, :d].view(n, H, Dh), qkv[:, d:2 * d].view(n, H, Dh), qkv[:, 2 * d:].view(n, H, Dh)
            self.k_cache[blk, li, off] = k
            self.v_cache[blk, li, off] = v
            K = self.k_cache[kblk, li, koff].permute(1, 0, 2).unsqueeze(0)  # 1,H,ctx,Dh
            V = self.v_cache[kblk, li, koff].permute(1, 0, 2).unsqueeze(0)
            o = F.scaled_dot_product_attention(q.permute(1, 0, 2).unsqueeze(0), K, V, attn_mask=mask)  # 1,H,n,Dh
            x = x + o[0].permute(1, 0, 2).reshape(n, d) @ lw["wo"]
            h = self._rmsnorm(x)
            x = x + torch.relu(h @ lw["w1"]) @ lw["w2"]
        return (self._rmsnorm(x[-1:]) @ self.lm_head).float()

    # ---------------------------------------------------------------- sample
    def _sample(self, logits: torch.Tensor, seqs: list[SeqPlan]) -> torch.Tensor:
        allow = torch.tensor([sp.allow_eos for sp in seqs], device=self.dev)
        z = logits + torch.where(allow.unsqueeze(1), self.bias_eos.unsqueeze(0), self.bias.unsqueeze(0))
        out = torch.argmax(z, dim=-1)
        rows = [i for i, sp in enumerate(seqs) if sp.temperature > 1e-5]
        if rows:
            us = []
            for i in rows:
                sp = seqs[i]
                rng = sp.rng if sp.rng is not None else np.random.default_rng()
                us.append(float(rng.random()))
            for j, i in enumerate(rows):
                sp = seqs[i]
                zi = z[i] / sp.temperature
                if sp.top_k and sp.top_k > 0:
                    kth = torch.topk(zi, sp.top_k).values[-1]
                    zi = torch.where(zi < kth, torch.full_like(zi, -math.inf), zi)
                p = torch.softmax(zi, dim=-1)
                if sp.top_p < 1.0:
                    ps, order = torch.sort(p, descending=True)
                    keep = torch.cumsum(ps, 0) - ps < sp.top_p
                    p = torch.zeros_like(p).scatter_(0, order, ps * keep)
                    p = p / p.sum()
                c = torch.cumsum(p, 0)
                u = torch.tensor([us[j]], device=self.dev, dtype=c.dtype) * c[-1]
                out[i] = torch.searchsorted(c, u).clamp_(max=p.shape[0] - 1)[0]
        return out

    # ---------------------------------------------------------------- step
    @torch.inference_mode()
    def execute(self, plan: BatchPlan, ops) -> tuple[dict[str, int], list[CopyRecord], dict[str, int]]:
        marks: dict[str, int] = {}
        recs = self.run_copies(ops)
        marks["copies_end_ns"] = time.monotonic_ns()
        decode = [sp for sp in plan.seqs if sp.num_tokens == 1]
        prefill = [sp for sp in plan.seqs if sp.num_tokens > 1]
        logit_rows: list[tuple[SeqPlan, torch.Tensor]] = []
        if decode:
            lg = self._decode(decode, plan.token_ids)
            for i, sp in enumerate(decode):
                if sp.needs_logits:
                    logit_rows.append((sp, lg[i]))
        for sp in prefill:
            lg = self._prefill(sp, plan.token_ids)
            if sp.needs_logits:
                logit_rows.append((sp, lg[0]))
        marks["forward_end_ns"] = time.monotonic_ns()  # enqueue time on CUDA; the sync below waits
        sampled: dict[str, int] = {}
        if logit_rows:
            seqs = [r[0] for r in logit_rows]
            tok = self._sample(torch.stack([r[1] for r in logit_rows]), seqs)
            n = tok.shape[0]
            if n > self.sampled_host.shape[0]:
                self.sampled_host = torch.zeros((n,), dtype=torch.int64, pin_memory=self.is_cuda)
            # as vLLM: sampled ids -> pinned host buffer, then wait for the step to finish
            self.sampled_host[:n].copy_(tok, non_blocking=True)
            if self.step_event is not None:
                self.step_event.record()
                self.step_event.synchronize()
            ids = self.sampled_host[:n].tolist()
            sampled = {sp.req_id: int(t) for sp, t in zip(seqs, ids)}
        else:
            self._sync()
        marks["sample_end_ns"] = time.monotonic_ns()
        return sampled, recs, marks
