"""A template's weights as ckptflow's chunks and back (engines/weight_chunks.py), and vLLM's worker
extension that does it inside each worker (engines/vllm_worker.py), on torch's and vLLM's CPU
builds (the vLLM install's environment).

The extension's GPU use, after a level-2 sleep, is bench/vllm_gpu.py row p on the H200; here the
same calls run in a real CPU vLLM: the weights written as chunks, a torn chunk loaded back makes
the engine answer otherwise (the load wrote into the parameters), the right chunks make it
answer as before, token for token.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from ckptflow.engines import vllm

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow

_CHUNKS = r"""
import hashlib, json, sys
from pathlib import Path
import torch
from ckptflow.engines import weight_chunks as wc

wc.SLOT = 1 << 20                      # several chunks per tensor, cheaply
out, res = Path(sys.argv[1]), {}
g = torch.Generator().manual_seed(7)
named = {"emb": torch.randn(700, 1000, generator=g).to(torch.bfloat16),      # 1.34 MiB: 2 chunks
         "w": torch.randn(3, 1 << 18, generator=g),                           # 3 MiB: 3 chunks
         "b": torch.arange(5, dtype=torch.int64)}
before = {k: v.clone() for k, v in named.items()}
(out / "a").mkdir(); (out / "b").mkdir()
recs, written = wc.export_tensors(named.items(), out / "a", set())
res["chunks"] = [len(r["chunks"]) for r in recs]
res["written"], res["total"] = written, sum(r["nbytes"] for r in recs)
res["names_are_sha256"] = all(hashlib.sha256(f.read_bytes()).hexdigest() == f.name for f in (out / "a").iterdir())
res["records"] = [{k: r[k] for k in ("name", "dtype", "shape", "nbytes")} for r in recs]
known = {d for r in recs for d in r["chunks"]}
recs2, written2 = wc.export_tensors(named.items(), out / "b", known)
res["written_again"], res["same_records"] = written2, recs2 == recs
res["files_again"] = sorted(p.name for p in (out / "b").iterdir())
for t in named.values():
    t.zero_()
res["loaded"] = wc.import_tensors(recs, named, out / "a")
res["equal_after_load"] = all(torch.equal(named[k], before[k]) for k in named)
torn = out / "a" / recs[1]["chunks"][2]
raw = bytearray(torn.read_bytes()); raw[100] ^= 1; torn.write_bytes(bytes(raw))
try:
    wc.import_tensors(recs, named, out / "a"); res["torn"] = None
except ValueError as e:
    res["torn"] = str(e)
res["torn_digest"] = recs[1]["chunks"][2]
other = dict(named, w=torch.zeros(3, 1 << 17))
for t in named.values():
    t.fill_(1)
try:
    wc.import_tensors(recs, other, out / "a"); res["other_shape"] = None
except ValueError as e:
    res["other_shape"] = str(e)
res["untouched_by_refusal"] = bool((named["emb"] == 1).all())
try:
    wc.export_tensors([("strided", torch.zeros(4, 8)[:, ::2])], out / "b", set()); res["strided"] = None
except ValueError as e:
    res["strided"] = str(e)
short = [dict(recs[1], chunks=recs[1]["chunks"][:2])]
try:
    wc.import_tensors(short, named, out / "a"); res["short"] = None
except ValueError as e:
    res["short"] = str(e)
# A transposed weight (as FP8 layers keep theirs) is its storage's bytes, and comes back into them.
base = torch.randn(300, 700, generator=g)
(out / "c").mkdir()
trecs, _ = wc.export_tensors([("wt", base.t())], out / "c", set())
into = torch.zeros(300, 700)
wc.import_tensors(trecs, {"wt": into.t()}, out / "c")
res["transposed_equal"] = torch.equal(into, base)
print(json.dumps(res))
"""


@pytest.fixture(scope="module")
def chunks(vllm_install, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("wchunks")
    run = subprocess.run([str(vllm_install.python), "-c", _CHUNKS, str(out)], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_tensors_leave_as_chunks_named_by_their_bytes_and_only_once(chunks):
    assert chunks["chunks"] == [2, 3, 1]
    assert chunks["names_are_sha256"] and chunks["written"] == chunks["total"] == 700 * 1000 * 2 + 3 * 4 * 2**18 + 40
    assert chunks["records"][0] == {"name": "emb", "dtype": "bfloat16", "shape": [700, 1000], "nbytes": 1_400_000}
    # The runner's known chunks are not written again; the records are the same.
    assert chunks["written_again"] == 0 and chunks["same_records"] and chunks["files_again"] == []


def test_chunks_load_back_into_the_same_tensors_every_chunk_checked(chunks):
    assert chunks["loaded"] == chunks["total"] and chunks["equal_after_load"]
    assert chunks["torn"] == f"chunk {chunks['torn_digest'][:12]}… is torn"


def test_a_record_of_another_shape_or_size_or_a_view_with_gaps_is_refused_naming_it(chunks):
    assert chunks["other_shape"] == "tensor w: the checkpoint holds float32 [3, 262144], this engine float32 [3, 131072]"
    assert chunks["untouched_by_refusal"]   # refused before any copy
    assert chunks["short"] == ("tensor w: the checkpoint's record holds 2 chunk(s) for 3145728 bytes; this engine's "
                               "tensor is 3145728 bytes in 3 chunk(s) of 1048576")
    assert chunks["strided"] == ("tensor strided is not contiguous and does not cover its storage: its chunks would "
                                 "be a copy's")


def test_a_transposed_weight_goes_out_and_back_as_its_storage(chunks):
    assert chunks["transposed_equal"]


_ENGINE = r"""
import json, shutil, sys
from pathlib import Path
from vllm import LLM, SamplingParams
from ckptflow.engines.vllm_worker import EXTENSION

model, out, dtype = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
llm = LLM(model=model, skip_tokenizer_init=True, dtype=dtype, max_model_len=512, seed=0,
          enable_prefix_caching=False, worker_extension_cls=EXTENSION)
sp = SamplingParams(max_tokens=16, temperature=0.0, detokenize=False)
prompt = [{"prompt_token_ids": [1, 17, 230, 41, 99, 7, 512, 3, 64, 128]}]
gen = lambda: list(llm.generate(prompt, sp, use_tqdm=False)[0].outputs[0].token_ids)
res = {"ref": gen()}
stage = out / "stage"; stage.mkdir()
[exp] = llm.collective_rpc("ckptflow_export_weights", args=(str(stage), []))
recs = exp["tensors"]
res["n_records"], res["names"] = len(recs), sorted(r["name"] for r in recs)[:3]
res["written"], res["total"] = exp["written_bytes"], exp["total_bytes"]
res["stage_bytes"] = sum(f.stat().st_size for f in stage.iterdir())
# Every chunk torn (a constant fill): whatever the prompt and the model, the answer must change.
keep = out / "keep"; shutil.copytree(stage, keep)
for f in stage.iterdir():
    f.write_bytes(b"\x3f" * f.stat().st_size)
try:
    llm.collective_rpc("ckptflow_import_weights", args=(str(stage), recs)); res["torn"] = None
except Exception as e:
    res["torn"] = f"{type(e).__name__}: {e}"
res["first_chunk"] = recs[0]["chunks"][0]
res["after_torn"] = gen()
shutil.rmtree(stage); shutil.copytree(keep, stage)
[imp] = llm.collective_rpc("ckptflow_import_weights", args=(str(stage), recs))
res["loaded"] = imp["loaded_bytes"]
res["after_load"] = gen()
print("RESULT " + json.dumps(res))
"""


@pytest.fixture(scope="module")
def engine(vllm_install, vllm_model, io_uring_off, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("wext")
    env = {**os.environ, **vllm.CPU_ENV, "PYTHONPATH": str(ROOT)}
    run = subprocess.run([str(vllm_install.python), "-c", _ENGINE, str(vllm_model.path), str(out), vllm.CPU_DTYPE],
                         capture_output=True, text=True, env=env, timeout=900)
    lines = [ln for ln in run.stdout.splitlines() if ln.startswith("RESULT ")]
    assert run.returncode == 0 and lines, (run.stdout[-2000:], run.stderr[-4000:])
    return json.loads(lines[-1].removeprefix("RESULT "))


def test_vllm_writes_its_parameters_as_chunks_through_the_worker_extension(engine):
    assert engine["n_records"] > 5 and all(n.startswith("0:model.") or n.startswith("0:lm_head")
                                            for n in engine["names"])
    # Each distinct chunk once: parameters with equal bytes (the layer norms' ones) share theirs.
    assert engine["written"] == engine["stage_bytes"] and 0 < engine["written"] <= engine["total"]


def test_a_torn_chunk_is_named_and_the_right_ones_bring_back_the_engine_token_for_token(engine):
    assert engine["torn"] is not None and f"chunk {engine['first_chunk'][:12]}… is torn" in engine["torn"]
    # The load wrote into the parameters (a torn tensor changes the answer) ...
    assert engine["after_torn"] != engine["ref"]
    # ... and the template's chunks make it the same engine again.
    assert engine["loaded"] == engine["total"] and engine["after_load"] == engine["ref"]
