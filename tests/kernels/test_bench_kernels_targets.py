"""bench/kernels.py's pure logic on the CPU: targets and their correctness gate, failed cells, display, provenance,
and the reference the GPU outputs are checked against (the benchmark itself needs a GPU)."""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from bench_scripts import load_bench

ROOT = Path(__file__).resolve().parents[2]


bk = load_bench("kernels.py")
NAN = float("nan")


def _run(packed: float = 10.0, emulated: float = 11.0, gmm: float = 30.0, tri: float = 40.0, touched_tbps: float = 3.5,
         check: dict | None = None, errors: dict | None = None) -> dict:
    """One (shape, T) run as bench_tokens writes it; ``errors``: backend -> error text (its time NaN)."""
    run: dict = {"touched_experts": 8, "touched_packed_bytes": 1, "rotations": 1, "rotation_union_packed_bytes": 1,
                 "l2_resident": False}
    if check is not None:
        run["correctness"] = check
    for backend, us in (("packed", packed), ("emulated", emulated), ("bf16_grouped_mm", gmm), ("bf16_triton", tri)):
        err = (errors or {}).get(backend)
        run[backend] = {"us": NAN, "method": "failed", "error": err} if err else {"us": us, "method": "cuda-graph"}
    run["packed_touched_TBps"] = touched_tbps
    peers = [run[p]["us"] for p in bk.PEERS if not math.isnan(run[p]["us"])]
    run["fastest_peer_us"] = min(peers) if peers else NAN
    return run


def _ok_check(packed: float = 3e-3, emulated: float = 2e-3) -> dict:
    return {"tokens_checked": 1, "tolerance": 1e-2, "reference_nonfinite": 0, "packed_rel_l2": packed, "packed_nonfinite": 0,
            "emulated_rel_l2": emulated, "emulated_nonfinite": 0, "ok": packed <= 1e-2 and emulated <= 1e-2}


def _results(runs: dict[int, dict], name: str = "mixtral-8x7b", bits: float = 3.26, hbm: float = 5.0) -> dict:
    sh = {"experts": 8, "hidden": 4096, "intermediate": 14336, "top_k": 2, "correctness_tokens": bk.check_tokens_of(list(runs)),
          "memory_bytes": {b: 1 for b in bk.BACKENDS}, "bits_per_weight": {b: bits if b == "packed" else 16.0 for b in bk.BACKENDS},
          "per_expert_packed_bytes": 1, "runs": runs}
    return {"device": "test", "torch": "t", "triton": "t", "shapes": {name: sh},
            "hbm": {"copy_read_plus_write_TBps": 8.0, "copy_read_TBps": 4.0, "sum_read_TBps": hbm}}


def _by_target(targets: list[dict]) -> dict[str, dict]:
    return {t["target"]: t for t in targets}


def _all_met_runs() -> dict[int, dict]:
    # T=1 and 32: 70% of read, 3x the fastest peer; T=8192: packed 1.2x the peer; emulated 1.1x everywhere
    return {1: _run(check=_ok_check()), 32: _run(check=_ok_check()),
            8192: _run(packed=36.0, emulated=33.0, gmm=30.0, check=_ok_check())}


# ----------------------------------------------------------------------------- targets


def test_targets_met() -> None:
    results = _results(_all_met_runs())
    targets = bk.evaluate_targets(results)
    assert len(targets) == 3 + 3 + 2 + 1  # T=1 and 32: HBM, peer, emulated; T=8192: packed, emulated; bits
    t = _by_target(targets)
    assert all(x["met"] for x in targets), [x for x in targets if not x["met"]]
    assert t["mixtral-8x7b T=1: packed >= 60% HBM read BW on touched bytes"]["value"].startswith("70.0% of read 5.00 TB/s")
    assert t["mixtral-8x7b T=32: packed >= 2.5x faster than fastest bf16 peer"]["value"] == "3.00x"
    assert t["mixtral-8x7b T=8192: packed within 1.5x of fastest bf16 peer"]["value"] == "1.20x"
    assert t["mixtral-8x7b T=8192: emulated within 1.25x of fastest bf16 peer"]["value"] == "1.10x"
    assert t["mixtral-8x7b: packed weights <= 3.3 bits/weight"]["value"] == "3.260"
    assert not bk.run_failed(results) and bk.failed_cells(results) == []
    assert "targets met: 9/9" in bk.short_table(results, targets)


def test_targets_missed_never_show_a_passing_number() -> None:
    # 59.7% of read (0.597), 2.4997x, 1.5001x, 1.2502x, 3.3004 bits: each printed on its failing side
    runs = {1: _run(touched_tbps=0.597 * 5.0, packed=10.0, gmm=24.997, emulated=1.2502 * 24.997, tri=40.0, check=_ok_check()),
            32: _run(touched_tbps=0.59996 * 5.0, check=_ok_check()),
            8192: _run(packed=45.003, gmm=30.0, emulated=33.0, check=_ok_check())}
    targets = bk.evaluate_targets(_results(runs, bits=3.3004))
    t = _by_target(targets)
    read1 = t["mixtral-8x7b T=1: packed >= 60% HBM read BW on touched bytes"]
    assert not read1["met"] and read1["value"].startswith("59.7% of read")
    read32 = t["mixtral-8x7b T=32: packed >= 60% HBM read BW on touched bytes"]
    assert not read32["met"] and read32["value"].startswith("59.9% of read")  # not "60.0%"
    peer = t["mixtral-8x7b T=1: packed >= 2.5x faster than fastest bf16 peer"]
    assert not peer["met"] and peer["value"] == "2.49x"  # not "2.50x"
    assert t["mixtral-8x7b T=1: emulated within 1.25x of fastest bf16 peer"]["value"] == "1.26x"
    prefill = t["mixtral-8x7b T=8192: packed within 1.5x of fastest bf16 peer"]
    assert not prefill["met"] and prefill["value"] == "1.51x"
    bits = t["mixtral-8x7b: packed weights <= 3.3 bits/weight"]
    assert not bits["met"] and bits["value"] == "3.301"
    table = bk.short_table(_results(runs, bits=3.3004), targets)
    assert "NOT MET: mixtral-8x7b T=1: packed >= 2.5x faster than fastest bf16 peer (2.49x)" in table


def test_targets_exactly_at_threshold_are_met() -> None:
    # 3.0 / 5.0 TB/s = 60%, 25 / 10 = 2.5x, 15 / 10 = 1.5x, 12.5 / 10 = 1.25x, 3.3 bits/weight
    runs = {1: _run(touched_tbps=3.0, packed=10.0, gmm=25.0, tri=25.0, emulated=31.25, check=_ok_check()),
            8192: _run(packed=15.0, gmm=10.0, tri=10.0, emulated=12.5, check=_ok_check())}
    targets = bk.evaluate_targets(_results(runs, bits=3.3))
    assert all(t["met"] for t in targets), [t for t in targets if not t["met"]]
    t = _by_target(targets)
    assert t["mixtral-8x7b T=1: packed >= 60% HBM read BW on touched bytes"]["value"].startswith("60.0% of read")
    assert t["mixtral-8x7b T=1: packed >= 2.5x faster than fastest bf16 peer"]["value"] == "2.50x"
    assert t["mixtral-8x7b T=8192: packed within 1.5x of fastest bf16 peer"]["value"] == "1.50x"
    assert t["mixtral-8x7b T=1: emulated within 1.25x of fastest bf16 peer"]["value"] == "1.25x"
    assert t["mixtral-8x7b: packed weights <= 3.3 bits/weight"]["value"] == "3.300"


def test_failed_correctness_gate_fails_every_performance_target_of_the_shape() -> None:
    runs = _all_met_runs()
    runs[32]["correctness"] = _ok_check(packed=0.0105)  # one check over 1e-2: the whole shape's timings mean nothing
    results = _results(runs)
    targets = bk.evaluate_targets(results)
    perf = [t for t in targets if t["tokens"] is not None]
    assert perf and not any(t["met"] for t in perf)
    assert all("correctness FAILED: T=32 packed rel-L2 1.05e-02 (tol 0.01)" in t["value"] for t in perf), perf[0]["value"]
    assert _by_target(targets)["mixtral-8x7b: packed weights <= 3.3 bits/weight"]["met"]  # bytes, not gated
    assert bk.run_failed(results) and bk.failed_cells(results) == []  # a verdict, not a failed cell
    table = bk.short_table(results, targets)
    assert "correctness FAILED mixtral-8x7b: T=32 packed rel-L2 1.05e-02" in table
    assert "1.05e-02!" in table  # the rel-L2 column marks it
    md = bk.markdown(results, targets)
    assert "| rel-L2 packed | rel-L2 emulated |" in md and "| 1.05e-02! | 2.00e-03 |" in md


@pytest.mark.parametrize("check", [None, {"error": "OutOfMemoryError: CUDA out of memory", "ok": False},
                                   {**_ok_check(), "packed_nonfinite": 3, "ok": False}])
def test_correctness_gate_fails_unchecked_errored_or_nonfinite(check: dict | None) -> None:
    runs = _all_met_runs()
    if check is None:
        del runs[1]["correctness"]
    else:
        runs[1]["correctness"] = check
    sh = _results(runs)["shapes"]["mixtral-8x7b"]
    ok, why = bk.correctness_gate(sh)
    assert not ok and why.startswith("T=1 ")
    assert not any(t["met"] for t in bk.evaluate_targets(_results(runs)) if t["tokens"] is not None)


def test_correctness_gate_just_below_tolerance_shows_the_margin() -> None:
    assert bk.sci(0.0100004, 1e-2) == "1.000040e-02"  # "1.00e-02" would read as passing
    assert bk.sci(0.0099996, 1e-2) == "1.00e-02"  # passing, shown as the tolerance itself: no contradiction
    assert bk.sci(3.1e-3, 1e-2) == "3.10e-03"


def test_failed_cell_is_recorded_and_fails_its_targets_only() -> None:
    runs = _all_met_runs()
    runs[1] = _run(check=_ok_check(), errors={"packed": "RuntimeError: boom"})
    runs[1]["packed_touched_TBps"] = NAN
    results = _results(runs)
    targets = _by_target(bk.evaluate_targets(results))
    for name in ("mixtral-8x7b T=1: packed >= 60% HBM read BW on touched bytes",
                 "mixtral-8x7b T=1: packed >= 2.5x faster than fastest bf16 peer"):
        assert not targets[name]["met"] and targets[name]["value"] == "error: packed: RuntimeError: boom"
    assert targets["mixtral-8x7b T=1: emulated within 1.25x of fastest bf16 peer"]["met"]
    assert targets["mixtral-8x7b T=32: packed >= 2.5x faster than fastest bf16 peer"]["met"]
    assert bk.failed_cells(results) == [{"shape": "mixtral-8x7b", "tokens": 1, "cell": "packed", "error": "RuntimeError: boom"}]
    assert bk.run_failed(results)
    text = bk.short_table(results, list(targets.values()))
    assert "FAILED cell mixtral-8x7b T=1 packed: RuntimeError: boom" in text
    row = next(line for line in text.splitlines() if line.startswith("mixtral-8x7b        1 "))
    assert "error" in row
    md = bk.markdown(results, list(targets.values()))
    assert "| mixtral-8x7b | 1 | error |" in md and "- mixtral-8x7b T=1 packed: RuntimeError: boom" in md
    json.dumps(results)  # still serialisable


def test_failed_peer_fails_the_peer_targets() -> None:
    """A peer that failed might have been the fastest: no verdict against the slower one that ran."""
    runs = _all_met_runs()
    runs[32] = _run(check=_ok_check(), errors={"bf16_grouped_mm": "OutOfMemoryError: x"})
    targets = _by_target(bk.evaluate_targets(_results(runs)))
    got = targets["mixtral-8x7b T=32: packed >= 2.5x faster than fastest bf16 peer"]
    assert not got["met"] and got["value"] == "error: bf16_grouped_mm: OutOfMemoryError: x"
    assert targets["mixtral-8x7b T=32: packed >= 60% HBM read BW on touched bytes"]["met"]


def test_failed_run_and_shape_setup_and_hbm() -> None:
    runs = _all_met_runs()
    runs[32] = {"error": "RuntimeError: illegal memory access"}
    results = _results(runs)
    results["shapes"]["deepseek-v3"] = {"correctness_tokens": [1, 32], "runs": {}, "error": "OutOfMemoryError: setup"}
    results["hbm"] = {"copy_read_plus_write_TBps": NAN, "copy_read_TBps": NAN, "sum_read_TBps": NAN, "error": "RuntimeError: hbm"}
    targets = bk.evaluate_targets(results)
    t = _by_target(targets)
    assert not t["deepseek-v3: benchmarked"]["met"] and t["deepseek-v3: benchmarked"]["value"] == "error: OutOfMemoryError: setup"
    assert t["mixtral-8x7b T=32: emulated within 1.25x of fastest bf16 peer"]["value"].startswith(
        "error: run: RuntimeError: illegal memory access")
    assert t["mixtral-8x7b T=1: packed >= 60% HBM read BW on touched bytes"]["value"] == "error: hbm: RuntimeError: hbm"
    assert not any(x["met"] for x in targets if x["tokens"] is not None)  # T=32 unchecked: the gate fails too
    cells = {(f["shape"], f["tokens"], f["cell"]) for f in bk.failed_cells(results)}
    assert cells == {(None, None, "hbm"), ("deepseek-v3", None, "setup"), ("mixtral-8x7b", 32, "run")}
    text = bk.short_table(results, targets)
    assert "deepseek-v3         - setup error: OutOfMemoryError: setup" in text
    assert "mixtral-8x7b       32 error: RuntimeError: illegal memory access" in text
    md = bk.markdown(results, targets)
    assert "| deepseek-v3 | setup failed" in md and "| deepseek-v3 | - | setup error: OutOfMemoryError: setup |" in md
    assert "| mixtral-8x7b | 32 | error: RuntimeError: illegal memory access |" in md


def test_targets_after_a_json_round_trip() -> None:
    """results.json has string keys for T: the gate and the targets read it the same way."""
    runs = _all_met_runs()
    runs[32]["correctness"] = _ok_check(emulated=0.02)
    results = json.loads(json.dumps(_results(runs)))
    targets = bk.evaluate_targets(results)
    assert [t["met"] for t in targets] == [t["met"] for t in bk.evaluate_targets(_results(runs))]
    assert not bk.correctness_gate(results["shapes"]["mixtral-8x7b"])[0]


@pytest.mark.parametrize("value,threshold,higher,decimals,want", [
    (59.7, 60, True, 1, (False, "59.7")), (59.996, 60, True, 1, (False, "59.9")), (60.0, 60, True, 1, (True, "60.0")),
    (60.04, 60, True, 1, (True, "60.0")), (2.4997, 2.5, True, 2, (False, "2.49")), (2.5, 2.5, True, 2, (True, "2.50")),
    (1.5001, 1.5, False, 2, (False, "1.51")), (1.5, 1.5, False, 2, (True, "1.50")), (1.4999, 1.5, False, 2, (True, "1.50")),
    (0.597 * 100, 60, True, 0, (False, "59")), (NAN, 1.0, True, 2, (False, "nan")), (math.inf, 1.0, True, 2, (True, "inf")),
])
def test_judged(value: float, threshold: float, higher: bool, decimals: int, want: tuple[bool, str]) -> None:
    assert bk.judged(value, threshold, higher_is_better=higher, decimals=decimals) == want


# ----------------------------------------------------------------------------- cells


def test_guarded_and_timed_cell(monkeypatch: pytest.MonkeyPatch) -> None:
    assert bk.guarded("ok", lambda: 3) == (3, None)
    got, error = bk.guarded("bad", lambda: 1 / 0)
    assert got is None and error == "ZeroDivisionError: division by zero"

    def boom(fns: list) -> tuple[float, str]:
        raise ValueError("triton compile failed\n  at line 3")

    monkeypatch.setattr(bk, "time_graph_rot", boom)
    cell = bk.timed_cell("x", [lambda: None])
    assert math.isnan(cell["us"]) and cell["error"] == "ValueError: triton compile failed at line 3"
    monkeypatch.setattr(bk, "time_graph_rot", lambda fns: (12.5, "cuda-graph"))
    assert bk.timed_cell("x", [lambda: None]) == {"us": 12.5, "method": "cuda-graph"}


# ----------------------------------------------------------------------------- provenance, settings, CLI


def test_provenance_in_this_repo_and_without_git(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    prov = bk.provenance(argv=["bench/kernels.py", "--out", "x"])
    when = datetime.datetime.fromisoformat(prov["utc"])
    assert when.utcoffset() == datetime.timedelta(0)
    assert prov["argv"] == ["bench/kernels.py", "--out", "x"]
    if (ROOT / ".git").exists():
        head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
        assert prov["git_head"] == head and isinstance(prov["git_dirty"], bool)
    assert bk.git_state(tmp_path) == (None, None)  # not a git tree
    if shutil.which("git"):  # a copy in an ignored folder of a checkout (ab_new/ on the device) is not that checkout's HEAD
        repo = tmp_path / "checkout"
        (repo / "bench").mkdir(parents=True)
        (repo / "ab_new" / "bench").mkdir(parents=True)
        (repo / ".gitignore").write_text("/ab_new/\n")
        (repo / "bench" / "kernels.py").write_text("")
        (repo / "ab_new" / "bench" / "kernels.py").write_text("")
        for cmd in (["init", "-q"], ["add", "."],
                    ["-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false", "commit", "-q", "-m", "x"]):
            subprocess.run(["git", "-C", str(repo), *cmd], check=True, capture_output=True)
        head, dirty = bk.git_state(repo / "bench")
        assert head is not None and len(head) == 40 and dirty is False
        assert bk.git_state(repo / "ab_new" / "bench") == (None, None)

    def no_git(*args: object, **kwargs: object) -> None:
        raise FileNotFoundError("git")

    monkeypatch.setattr(subprocess, "run", no_git)  # what bench/repo_state.git_state runs
    prov = bk.provenance()
    assert prov["git_head"] is None and prov["git_dirty"] is None and prov["argv"] == sys.argv
    json.dumps(prov)


def test_an_archived_copy_names_its_commit(tmp_path: Path) -> None:
    """`git archive` writes the commit into bench/ARCHIVED_COMMIT (.gitattributes export-subst), which the provenance
    of a run from that copy reads back; a checkout's file holds the placeholder, which names no commit."""
    repo_state = load_bench("repo_state.py")
    archived_commit = repo_state.archived_commit
    assert archived_commit(repo_state.ARCHIVED_COMMIT) is None or not (ROOT / ".git").exists()  # this checkout: the placeholder
    assert archived_commit(tmp_path / "missing") is None
    if not (ROOT / ".git").exists() or shutil.which("git") is None:
        pytest.skip("not a git checkout")
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    listed = subprocess.run(["git", "-C", str(ROOT), "ls-tree", "--name-only", "HEAD", "bench/ARCHIVED_COMMIT"],
                            capture_output=True, text=True).stdout.strip()
    if not listed:
        pytest.skip("HEAD predates bench/ARCHIVED_COMMIT")
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", "HEAD", "bench/ARCHIVED_COMMIT"],
                             capture_output=True, check=True).stdout
    import io
    import tarfile

    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(tmp_path, filter="data")
    assert archived_commit(tmp_path / "bench" / "ARCHIVED_COMMIT") == head


def test_settings_of() -> None:
    args = argparse.Namespace(out=Path("/tmp/o"), quick=True, shapes=["qwen3-30b-a3b"], tokens=None, tune=False, ab=["pdl"])
    got = bk.settings_of(args, bk.QUICK_TOKENS)
    assert got["out"] == "/tmp/o" and got["quick"] is True and got["tune"] is False and got["shapes"] == ["qwen3-30b-a3b"]
    assert got["tokens"] == list(bk.QUICK_TOKENS) and got["tokens_arg"] is None and got["correctness_tolerance"] == 1e-2
    json.dumps(got)


def test_help_and_no_gpu_exit(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "kernels")}
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "kernels.py"), "--help"], capture_output=True, text=True,
                          env=env, timeout=120)
    assert proc.returncode == 0 and "--out" in proc.stdout and "--quick" in proc.stdout, proc.stderr
    if not torch.cuda.is_available():
        proc = subprocess.run([sys.executable, str(ROOT / "bench" / "kernels.py"), "--out", str(tmp_path)], capture_output=True,
                              text=True, env=env, timeout=120)
        assert proc.returncode == 2 and "needs a CUDA GPU" in proc.stderr


# ----------------------------------------------------------------------------- the correctness check's pieces


def test_check_tokens_and_rows() -> None:
    assert bk.check_tokens_of(bk.TOKENS) == (1, 32, 8192)
    assert bk.check_tokens_of(bk.QUICK_TOKENS) == (1, 32, 8192)
    assert bk.check_tokens_of([8, 1]) == (1, 8)
    assert bk.check_tokens_of([128]) == (128,)
    assert bk.check_tokens_of([]) == ()
    assert bk.check_rows(64) is None
    rows = bk.check_rows(8192)
    assert rows.numel() == 64 and int(rows[0]) == 0 and int(rows[-1]) == 8191 and bool((rows.diff() > 0).all())


def test_token_groups() -> None:
    ids = [[0, 1], [1, 2], [3, 4], [0, 5], [6, 7, 8]]
    assert bk.token_groups(ids, 3) == [[0, 1], [2], [3], [4]]
    assert bk.token_groups(ids, 100) == [[0, 1, 2, 3, 4]]
    assert bk.token_groups(ids, 1) == [[0], [1], [2], [3], [4]]  # a token over the limit is a group of its own
    assert bk.token_groups([], 4) == []


def test_correctness_record() -> None:
    want = torch.randn(8, 64, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    close = (want.float() * 1.001).to(torch.bfloat16)
    far = (want.float() * 1.02).to(torch.bfloat16)
    rec = bk.correctness_record({"packed": close, "emulated": want}, want)
    assert rec["ok"] and rec["packed_rel_l2"] <= 2e-3 and rec["emulated_rel_l2"] == 0.0 and "packed_vs_emulated_rel_l2" in rec
    rec = bk.correctness_record({"packed": far, "emulated": want}, want)
    assert not rec["ok"] and rec["packed_rel_l2"] > 1e-2
    nan = want.clone()
    nan[3, 5] = float("nan")
    rec = bk.correctness_record({"packed": nan, "emulated": want}, want)
    assert not rec["ok"] and rec["packed_nonfinite"] == 1
    assert not bk.correctness_record({"packed": want[:4], "emulated": want}, want)["ok"]
    assert not bk.correctness_record({"packed": want, "emulated": want}, nan)["ok"]  # the judge's own NaN


def test_reference_output_equals_the_reference_backend() -> None:
    """Dequantizing only the routed experts, a few tokens at a time, gives the reference backend's answer exactly."""
    from lutb_kernels.checkpoint import CheckpointConfig, LayerWeights
    from lutb_kernels.experts.reference import ReferenceExperts
    from lutb_kernels.lut_b_gemm import random_tiles

    experts, hidden, inter, top_k, tokens = 8, 256, 128, 2, 9
    cfg = CheckpointConfig(hidden_size=hidden, intermediate_size=inter, num_experts=experts, activation="silu", dtype="bfloat16")
    gen = torch.Generator().manual_seed(4)
    layer = LayerWeights(random_tiles(cfg.w13_tiles_shape(experts), k=hidden, generator=gen),
                         random_tiles(cfg.w2_tiles_shape(experts), k=inter, generator=gen), torch.arange(experts, dtype=torch.int32))
    x = torch.randn(tokens, hidden, generator=gen).to(torch.bfloat16)
    ids = torch.rand(tokens, experts, generator=gen).topk(top_k, dim=1).indices.to(torch.int32)
    weights = torch.softmax(torch.randn(tokens, top_k, generator=gen), dim=1)
    want = ReferenceExperts(cfg, layer, "cpu").forward(x, ids, weights)
    per_expert = (2 * inter * hidden + hidden * inter) * 2
    for budget in (per_expert * 2, per_expert * 3, 1 << 30):  # 2 experts at a time (one token a group), then more
        got = bk.reference_output(layer.w13, layer.w2, x, ids, weights, num_experts=experts, budget_bytes=budget)
        assert got.dtype == want.dtype and torch.equal(got, want), budget
    rows = torch.tensor([1, 4, 8])
    got = bk.reference_output(layer.w13, layer.w2, x[rows], ids[rows], weights[rows], num_experts=experts)
    assert torch.equal(got, want[rows])  # tokens are independent: rows of a batch are the rows' own answer


class _FakeExperts:
    """A backend whose forward_unchecked is the reference backend's, times ``scale`` (1: right, else wrong)."""

    def __init__(self, ref, scale: float = 1.0) -> None:  # noqa: ANN001
        self.ref, self.scale = ref, scale

    def forward_unchecked(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return (self.ref.forward(x, ids, weights).float() * self.scale).to(x.dtype)


@pytest.mark.parametrize("tokens", [5, 100])  # all rows; 64 of 100
def test_check_correctness_on_the_cpu(tokens: int) -> None:
    from lutb_kernels.checkpoint import CheckpointConfig, LayerWeights
    from lutb_kernels.experts.reference import ReferenceExperts
    from lutb_kernels.lut_b_gemm import random_tiles

    experts, hidden, inter, top_k = 4, 128, 128, 2
    cfg = CheckpointConfig(hidden_size=hidden, intermediate_size=inter, num_experts=experts, activation="silu", dtype="bfloat16")
    gen = torch.Generator().manual_seed(5)
    layer = LayerWeights(random_tiles(cfg.w13_tiles_shape(experts), k=hidden, generator=gen),
                         random_tiles(cfg.w2_tiles_shape(experts), k=inter, generator=gen), torch.arange(experts, dtype=torch.int32))
    ref = ReferenceExperts(cfg, layer, "cpu")
    tiles = {"w13": layer.w13, "w2": layer.w2, "scale_mode": cfg.mxfp8_scale_mode}
    x = torch.randn(tokens, hidden, generator=gen).to(torch.bfloat16)
    ids = torch.rand(tokens, experts, generator=gen).topk(top_k, dim=1).indices.to(torch.int32)
    weights = torch.softmax(torch.randn(tokens, top_k, generator=gen), dim=1)
    rec = bk.check_correctness(_FakeExperts(ref), _FakeExperts(ref), tiles, x, ids, weights, experts)
    assert rec["ok"] and rec["packed_rel_l2"] == 0.0 and rec["tokens_checked"] == min(tokens, bk.CHECK_TOKENS)
    rec = bk.check_correctness(_FakeExperts(ref, 1.03), _FakeExperts(ref), tiles, x, ids, weights, experts)
    assert not rec["ok"] and 0.02 < rec["packed_rel_l2"] < 0.04 and rec["emulated_rel_l2"] == 0.0


def test_a_capture_that_failed_is_named_in_the_short_table() -> None:
    """A timing that fell back to do_bench because its CUDA graph capture failed (a capture-safe op that stopped being
    one: 88d9473's routing) is listed where the device call's output shows it, not only in results.md."""
    runs = _all_met_runs()
    runs[8192]["emulated"]["method"] = "do_bench (graph capture failed: RuntimeError: Cannot copy between CPU and CUDA)"
    results = _results(runs)
    table = bk.short_table(results, bk.evaluate_targets(results))
    assert "NOT IN A CUDA GRAPH (capture failed; timed eagerly by do_bench, launches included): mixtral-8x7b T=8192 emulated" in table
    assert "NOT IN A CUDA GRAPH" not in bk.short_table(_results(_all_met_runs()), [])


def test_a_capture_that_failed_outside_the_main_table_is_named_too() -> None:
    """The breakdown's stages and GEMM configs, the packed-path timings, the A/Bs and the tune records keep their
    timing method too, so a capture that failed there is named (by the path to it) beside the main table's cells."""
    failed = "do_bench (graph capture failed: RuntimeError: x)"
    graph = "cuda-graph x8 rotated routings"
    runs = _all_met_runs()
    runs[1]["packed_paths"] = {"in_kernel": 1.0, "in_kernel_method": graph, "dense": 2.0, "dense_method": failed}
    runs[32]["ab"] = {"pdl": {"on": [1.0], "off": [1.0], "method": failed}}
    results = _results(runs)
    results["breakdown"] = {"deepseek-v3 T=1": {"stages_us": {"gemm1": 3.0}, "stages_method": {"gemm1": failed, "combine": graph},
                                                "gemm_configs": {"gemm2 default": {"us": 1.0, "method": failed}}}}
    results["tune"] = [{"shape": "mixtral-8x7b", "gemm": "w2", "tokens": 32, "not_in_a_graph": [f"cfg(block_m=16): {failed}"]}]
    results["breakdown"]["deepseek-v3 T=8"] = {"error": "the graph capture failed, and then the stage raised"}  # not a method
    shape = next(iter(results["shapes"]))
    assert bk._uncaptured_cells(results) == [
        f"shapes/{shape}/runs/1/packed_paths/dense_method", f"shapes/{shape}/runs/32/ab/pdl/method",
        "breakdown/deepseek-v3 T=1/stages_method/gemm1", "breakdown/deepseek-v3 T=1/gemm_configs/gemm2 default/method",
        "tune mixtral-8x7b w2 T=32 cfg(block_m=16)"]
    runs[8192]["emulated"]["method"] = failed
    assert f"{shape} T=8192 emulated" in bk._uncaptured_cells(results)


def test_graph_timings_are_not_listed_as_fallbacks() -> None:
    """results.md's "Timing fallbacks" names timings not made by graph replay; "cuda-graph x8 rotated routings" is one
    made by it (it was listed, so a run with no fallback printed one)."""
    runs = _all_met_runs()
    for run in runs.values():
        for b in bk.BACKENDS:
            run[b]["method"] = "cuda-graph x8 rotated routings"
    results = _results(runs)
    assert "Timing fallbacks" not in bk.markdown(results, bk.evaluate_targets(results))
    runs[1]["packed"]["method"] = "do_bench (graph capture failed: RuntimeError: x)"
    results = _results(runs)
    assert "Timing fallbacks: do_bench (graph capture failed: RuntimeError: x)" in bk.markdown(results, bk.evaluate_targets(results))
