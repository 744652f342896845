"""The torch model runner (the GPU code path), exercised on the CPU. Skipped when torch is not
installed (it is optional: see examples/requirements.txt). CUDA graphs cannot be captured on a
CPU, so a stand-in graph object replays the same static-shape decode function to check the
bucket/padding logic; the real capture runs only with --device cuda --cuda-graphs."""

import httpx
import pytest

torch = pytest.importorskip("torch")

from helpers import Testbed  # noqa: E402
from testbed.kv_cache import KVCacheManager  # noqa: E402
from testbed.model_numpy import ModelConfig, NumpyModelRunner  # noqa: E402
from testbed.model_torch import TorchModelRunner  # noqa: E402
from testbed.protocol import EngineCoreRequest, SamplingParams  # noqa: E402
from testbed.scheduler import Scheduler  # noqa: E402


def _ecr(rid, prompt, max_tokens):
    return EngineCoreRequest(rid, prompt, None, SamplingParams(max_tokens=max_tokens, temperature=0.0), None, 0.0,
                             None, None, None, external_req_id=rid)


def _run(runner, nb, reqs, budget=32, host=0):
    s = Scheduler(KVCacheManager(nb, 16, True, host), budget, 4, 1024)
    for r in reqs:
        s.add_request(r, 0)
    outs, copies = {}, []
    while s.has_work():
        so = s.schedule()
        sampled, recs, _ = runner.execute(s.build_plan(so), so.copy_ops)
        copies += recs
        o, _, _ = s.update_from_output(so, sampled, 0)
        for x in o:
            outs.setdefault(x.request_id, []).extend(x.new_token_ids)
    return outs, copies


def _reqs():
    return [_ecr("a", list(range(40, 140)), 20), _ecr("b", list(range(50, 90)), 25), _ecr("c", [70] * 33, 15)]


class _FakeGraph:
    def __init__(self, runner, inp):
        self.runner, self.inp = runner, inp
        self.out = torch.zeros((inp["ids"].shape[0], runner.cfg.vocab_size))

    def replay(self):
        i = self.inp
        self.out.copy_(self.runner._decode_core(i["ids"], i["pos"], i["blk"], i["off"], i["bt"], i["ctx"]))


def test_torch_cpu_matches_numpy_greedy_and_graph_padding():
    mc = ModelConfig(max_model_len=1024)
    ref, _ = _run(NumpyModelRunner(mc, 64, 16), 64, _reqs())
    eager, _ = _run(TorchModelRunner(mc, 64, 16, device="cpu"), 64, _reqs())
    assert eager == ref
    r = TorchModelRunner(mc, 64, 16, device="cpu")
    r.graph_mb = 12
    for b in (4, 2, 1):
        inp = {"ids": torch.zeros(b, dtype=torch.long), "pos": torch.zeros(b, dtype=torch.long),
               "blk": torch.full((b,), r.scratch_block), "off": torch.zeros(b, dtype=torch.long),
               "bt": torch.full((b, r.graph_mb), r.scratch_block), "ctx": torch.ones(b, dtype=torch.long)}
        g = _FakeGraph(r, inp)
        r.graphs[b] = (g, inp, g.out)
    graphed, _ = _run(r, 64, _reqs())
    assert graphed == ref


def test_torch_cpu_offload_copies():
    mc = ModelConfig(max_model_len=1024)
    outs, copies = _run(TorchModelRunner(mc, 12, 16, host_blocks=64, device="cpu"), 12,
                        [_ecr(f"p{i}", [60 + i] * 20, 60) for i in range(3)], host=64)
    assert all(len(v) == 60 for v in outs.values())
    assert {c.dir for c in copies} == {"d2h", "h2d"}


def test_testbed_serves_with_torch_cpu_device(tmp_path):
    with Testbed("--device", "torch-cpu", workdir=str(tmp_path)) as tb:
        r = httpx.post(tb.base_url + "/v1/chat/completions", json={
            "model": "hopscope-testbed", "messages": [{"role": "user", "content": "torch path"}],
            "max_tokens": 8, "temperature": 0}, timeout=60).json()
    assert r["usage"]["completion_tokens"] == 8
