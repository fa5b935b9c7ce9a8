"""bench/serving.py --smoke runs end to end on the CPU: server, echo and load processes, in-process baseline, report."""

from __future__ import annotations

import json
import os
import re
import shutil
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from bench_scripts import load_bench

ROOT = Path(__file__).resolve().parents[2]


def _run_bench(script: str, args: list[str], timeout: float, extra_env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run ``bench/<script>`` with the source tree importable (and ``extra_env``); fail with its output tails when it
    fails."""
    env = {**os.environ, **(extra_env or {})}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / d) for d in ("kernels", "client", "server")] + [env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / script), *args],
                          capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def test_serving_bench_smoke(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = _run_bench("serving.py", ["--smoke", "--out", str(out), "--concurrency", "1,2", "--tokens", "4", "--duration-s", "0.2",
                                     "--warmup-s", "0.05", "--profile"], timeout=120)
    report = json.loads((out / "serving.json").read_text())
    rows = report["rows"]
    assert sorted((r["wire"], r["api"], r["concurrency"], r["tokens"]) for r in rows) == sorted(
        (w, a, c, 4) for w in ("bf16", "mxfp8") for a in ("unary", "stream") for c in (1, 2))
    for r in rows:
        assert r["server"]["requests"] > 0 and not r["server"]["errors"], r
        assert r["server"]["p50_us"] > 0 and r["server"]["tokens_per_s"] > 0
        # the server's own timing: per request total >= compute (so their medians too), below the end-to-end latency
        s = r["server"]
        assert s["server_total_us_p50"] >= s["server_compute_us_p50"] and s["server_queue_us_p50"] >= 0
        assert s["server_handoff_us_p50"] >= 0 and s["server_prepare_us_p50"] > 0 and s["server_encode_us_p50"] >= 0
        assert s["server_handoff_us_p50"] >= s["server_wait_us_p50"] >= 0  # each response's wait is part of its hand-off
        assert s["server_total_us_p50"] >= s["server_prepare_us_p50"]
        assert 0 < s["server_total_us_p50"] < s["p50_us"]
        # every caller answered inside its process's window; the windows' start times recorded
        assert s["callers_measured"] == r["concurrency"] and s["window_start_spread_s"] >= 0
        assert r["echo"]["requests"] > 0 and r["echo"]["request_bytes"] == r["server"]["request_bytes"]
        assert r["echo"]["response_bytes"] == r["server"]["response_bytes"] and r["echo"]["tokens_per_s"] > 0
        assert r["inproc"]["us"] > 0 and r["inproc"]["batch_tokens"] >= 4
        # the baseline's batch: the calls' mean size (harmonic mean over requests), in whole requests of 4 tokens
        assert r["server"]["call_tokens_mean"] <= r["server"]["batch_tokens_mean"]
        assert r["inproc"]["batch_tokens"] == 4 * max(1, round(round(r["server"]["call_tokens_mean"]) / 4))
        assert r["inproc_p50"]["us"] > 0 and r["inproc_p50"]["batch_tokens"] >= 4
    by_wire = {r["wire"]: r["server"]["request_bytes"] for r in rows}
    assert by_wire["mxfp8"] < 0.7 * by_wire["bf16"]
    assert report["servers"]["smoke"]["backend"] == "reference"
    profile = Path(report["servers"]["smoke"]["profile"])
    assert profile.exists() and any(tool in profile.read_text() for tool in ("cProfile", "py-spy"))  # py-spy where installed
    # each row's echo ran on its own API: the stream and unary rows of a cell hold different echo runs
    for w in ("bf16", "mxfp8"):
        for c in (1, 2):
            unary, stream = (next(r["echo"] for r in rows if (r["wire"], r["api"], r["concurrency"]) == (w, a, c)) for a in ("unary", "stream"))
            assert unary != stream
    assert report["settings"]["echo_procs"] == 1  # one front end: one echo process
    for r in rows:  # who is busy: the server's threads from /proc (its event loop among them), the load processes
        cpu = r["server"]["cpu"]
        assert cpu["cpu_us_per_request"] > 0 and "root/main" in cpu["thread_busy"], cpu
        assert cpu["busiest_thread"] in cpu["thread_busy"] and 0 < cpu["busiest_thread_busy"] <= 2.0
        assert 0 < r["server"]["load_busy_max"] <= 2.0 and r["server"]["answered"] >= r["server"]["requests"]
    assert "## Who is busy" in (out / "serving.md").read_text()
    assert "| shape | wire | api | C | T |" in (out / "serving.md").read_text()
    assert "## Where the time goes" in (out / "serving.md").read_text()
    assert "| prepare | queue | compute | hand-off (wait) | encode | other |" in (out / "serving.md").read_text()
    assert proc.stdout.rstrip().splitlines()[-1].startswith("| smoke |")  # the short table comes last


def test_expert_parallel_bench_with_client_procs(tmp_path: Path) -> None:
    """bench/expert_parallel.py spreads a row's concurrency over spawned client processes and merges their rows."""
    out = tmp_path / "out"
    _run_bench("expert_parallel.py", ["--out", str(out), "--backend", "reference", "--device", "cpu", "--experts", "8", "--hidden", "128",
                                      "--intermediate", "128", "--shards", "2", "--concurrency", "3", "--duration", "0.5",
                                      "--warmup", "0.2", "--server-threads", "1", "--client-threads", "1", "--client-procs", "2"],
               timeout=240)
    report = json.loads((out / "expert_parallel.json").read_text())
    assert report["meta"]["client processes"] == 2
    (row,) = report["rows"]
    assert row["client_procs"] == 2 and row["concurrency"] == 3 and row["shards"] == 2
    assert row["requests"] > 0 and not row["errors"]
    assert row["shard_requests_per_call"] == 2.0  # top-8 of 8 experts: every forward needs both shards
    assert [s["requests"] for s in row["shard_stats"]] == [row["requests"]] * 2  # summed over the processes
    assert "latencies_s" not in row


def test_serving_bench_smoke_on_a_compute_process(tmp_path: Path) -> None:
    """bench/serving.py --compute-worker process --front-ends 2: the server's batches run in its child process, and
    the echo runs on as many processes as the server has front ends, sharing one port."""
    out = tmp_path / "out"
    _run_bench("serving.py", ["--smoke", "--out", str(out), "--concurrency", "2", "--tokens", "4", "--wires", "bf16",
                              "--apis", "stream", "--duration-s", "0.2", "--warmup-s", "0.05", "--compute-worker", "process",
                              "--front-ends", "2"],
               timeout=120, extra_env={"LUTB_COMPUTE_SPIN_US": "500"})  # the compute process polls between calls
    report = json.loads((out / "serving.json").read_text())
    (row,) = report["rows"]
    assert row["server"]["requests"] > 0 and not row["server"]["errors"]
    assert row["echo"]["requests"] > 0 and not row["echo"]["errors"]
    assert report["settings"]["compute_worker"] == "process" and report["settings"]["echo_procs"] == 2
    assert report["settings"]["server_env"]["LUTB_COMPUTE_SPIN_US"] == "500"  # what the environment set is recorded
    for i in range(2):
        assert "echo server ready" in (out / "logs" / f"echo-{i}.log").read_text()
    # the CPU meter follows the server's children: the root (front end 0), front end 1 and the compute process
    # (and multiprocessing's resource tracker)
    assert row["server"]["cpu"]["processes"] >= 3, row["server"]["cpu"]
    # the thread that runs the experts calls: the compute process's main thread, whose busy share the A/B reports
    compute_thread = report["servers"]["smoke"]["compute_thread"]
    assert re.fullmatch(r"pid \d+/main", compute_thread) and compute_thread in row["server"]["cpu"]["thread_busy"]
    # the compute process's calls and loop shares over the cell, from the server's metrics endpoint
    loop = row["server"]["compute_loop"]
    assert loop["calls"] > 0 and loop["calls_per_s"] > 0, loop
    assert set(loop["shares"]) == {"calls", "answering", "reading_or_waiting", "other"}
    assert abs(sum(loop["shares"].values()) - 1) < 0.01 and loop["shares"]["calls"] > 0, loop


def test_worker_pacing_bench_smoke(tmp_path: Path) -> None:
    """bench/worker_pacing.py runs every mode on the CPU (reference backend) and writes its table."""
    out = tmp_path / "out"
    _run_bench("worker_pacing.py", ["--out", str(out), "--device", "cpu", "--backend", "reference", "--shape", "smoke", "--tokens", "2",
                                    "--seconds", "0.05", "--busy-switch-intervals-us", "200", "20"], timeout=120)
    rows = json.loads((out / "worker_pacing.json").read_text())["rows"]
    modes = [r["mode"] for r in rows]
    assert modes == ["direct", "direct+gap 300us", "direct+gap 1000us", "direct+gap 3000us", "direct+spin 300us",
                     "direct+spin 1000us", "direct+spin 3000us", "thread", "thread+gap 1000us", "asyncio",
                     "asyncio+busy si=200us", "asyncio+busy si=20us", "process", "process+busy"]
    assert all(r["calls"] >= 1 and 0 < r["compute_us"] <= r["round_trip_us"] for r in rows)


def test_layer_switch_bench_smoke(tmp_path: Path) -> None:
    """bench/layer_switch.py on the CPU (reference backend, no graphs): one row per (T, gap, idle mode, layers, routing),
    sleep and spin only where there is a gap, and the table's last column the last layer count over the first."""
    out = tmp_path / "out"
    proc = _run_bench("layer_switch.py", ["--smoke", "--out", str(out), "--work-dir", str(tmp_path / "ckpt"),
                                          "--tokens", "2", "--gaps-us", "0,100", "--gap-modes", "sleep,spin",
                                          "--layer-counts", "1,2", "--seconds", "0.01"], timeout=180)
    report = json.loads((out / "layer_switch.json").read_text())
    cells = [(r["gap_us"], r["gap_mode"], r["layers"], r["routing"]) for r in report["rows"]]
    assert cells == [(0, "-", 1, "one"), (0, "-", 1, "distinct"), (0, "-", 2, "one"), (0, "-", 2, "distinct"),
                     (100, "sleep", 1, "one"), (100, "sleep", 1, "distinct"), (100, "sleep", 2, "one"),
                     (100, "sleep", 2, "distinct"), (100, "spin", 1, "one"), (100, "spin", 1, "distinct"),
                     (100, "spin", 2, "one"), (100, "spin", 2, "distinct")]
    assert all(r["graphs"] == 0 and r["tokens"] == 2 and r["calls"] >= 20 and r["p50_us"] > 0 for r in report["rows"])
    last = {(r["layers"], r["routing"]): r["p50_us"] for r in report["rows"] if r["gap_mode"] == "spin"}
    assert proc.stdout.rstrip().splitlines()[-1] == (
        f"| 0 | 2 | 100 | spin | one | {last[(1, 'one')]:.0f} | {last[(2, 'one')]:.0f} | {last[(2, 'one')] / last[(1, 'one')]:.2f} |")


@pytest.mark.parametrize("bad, says", [(["--layer-counts", "9"], "--layer-counts"), (["--layer-counts", "0"], "--layer-counts"),
                                       (["--gap-modes", "nap"], "--gap-modes"), (["--gap-modes", "gpu"], "CUDA device")])
def test_layer_switch_bench_refuses_what_it_cannot_run(tmp_path: Path, bad: list[str], says: str) -> None:
    """More layers than its checkpoint's 8, none, an unknown idle mode, or the GPU idle mode without a GPU: a usage
    error before anything is built, not a crash halfway."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(str(ROOT / d) for d in ("kernels", "client", "server"))}
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "layer_switch.py"), "--smoke", "--out", str(tmp_path), *bad],
                          capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
    assert proc.returncode == 2 and says in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "layer_switch.json").exists()


def test_response_splice_bench_smoke() -> None:
    """bench/response_splice.py: one row per size, each built whole and spliced (checked to parse alike), and which
    way the servicer sends it."""
    proc = _run_bench("response_splice.py", ["--tokens", "1,16", "--calls", "5"], timeout=120)
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| 1 |") or line.startswith("| 16 |")]
    assert len(rows) == 2 and rows[0].endswith("| whole |") and rows[1].endswith("| spliced |"), proc.stdout


def test_stream_budget_cost_bench_smoke() -> None:
    """bench/stream_budget_cost.py: one line per repeat, a positive time per request."""
    proc = _run_bench("stream_budget_cost.py", ["--requests", "100", "--repeats", "2"], timeout=60)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("room + take + give_back:")]
    assert len(lines) == 2 and all(float(line.split()[-4]) > 0 for line in lines), proc.stdout


def test_checksum_cost_bench_smoke() -> None:
    """bench/checksum_cost.py: one line per thread count and repeat, a positive rate."""
    proc = _run_bench("checksum_cost.py", ["--files", "2", "--experts", "1", "--threads", "1,2", "--repeats", "1"],
                      timeout=120)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("threads ")]
    assert len(lines) == 2 and all(float(line.split()[2]) > 0 for line in lines), proc.stdout


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_metrics_scrape_bench_smoke() -> None:
    """bench/metrics_scrape.py: one row, the merged answer holding every front end's lines (2 front ends, 2 layers
    with expert metrics: more lines than one front end alone writes)."""
    proc = _run_bench("metrics_scrape.py", ["--front-ends", "2", "--layers", "2", "--expert-metrics", "--experts", "4",
                                            "--scrapes", "1"], timeout=120)
    (row,) = [line for line in proc.stdout.splitlines() if line.startswith("| 2 | 2 | 4 experts |")]
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert len(cells) == 9 and int(cells[3]) > 400 and all(float(c) >= 0 for c in cells[4:]), row


def test_graph_limit_bench_smoke(tmp_path: Path) -> None:
    """bench/graph_limit.py on the CPU (no graphs: every run eager): one row per (limit, size), split runs as cut."""
    out = tmp_path / "out"
    proc = _run_bench("graph_limit.py", ["--out", str(out), "--work-dir", str(tmp_path / "ckpt"), "--shape", "smoke",
                                         "--device", "cpu", "--backend", "reference", "--graph-limits", "16,32",
                                         "--sizes", "16,48", "--repeats", "1"], timeout=120)
    rows = json.loads((out / "graph_limit.json").read_text())["rows"]
    assert [(r["limit"], r["tokens"], r["split_runs"]) for r in rows] == [(16, 16, 1), (16, 48, 3), (32, 16, 1), (32, 48, 2)]
    assert all(r["whole_us"] > 0 and r["split_us"] > 0 and r["path"] == "eager" and r["eager_us"] is None for r in rows)
    assert proc.stdout.rstrip().splitlines()[-1] == "| 32 | 48 | " + f"{rows[-1]['whole_us']:.0f} | eager | - | {rows[-1]['split_us']:.0f} | 2 |"


def test_serving_overhead_bench_smoke(tmp_path: Path) -> None:
    """bench/serving_overhead.py: the fake-backend server and the echo, each with its CPU per request."""
    out = tmp_path / "out"
    proc = _run_bench("serving_overhead.py", ["--out", str(out), "--concurrency", "1", "--tokens", "2", "--hidden", "256",
                                              "--duration-s", "0.5", "--warmup-s", "0.1", "--load-procs", "1"], timeout=120)
    (row,) = json.loads((out / "overhead.json").read_text())["rows"]
    assert row["requests"] > 0 and not row["errors"], row
    assert row["cpu_us_per_request"] > 0 and row["thread_cpu_us_per_request"]["main"] > 0
    assert row["echo_cpu_us_per_request"] >= row["echo_main_cpu_us_per_request"] > 0
    assert proc.stdout.rstrip().splitlines()[-1].startswith("| 1 | 2 |")  # the table comes last


def test_ab_serving_smoke(tmp_path: Path) -> None:
    """bench/ab_serving.py: each tree's own bench/serving.py, interleaved, then one table of the server's figures."""
    old = tmp_path / "old"
    for d in ("bench", "kernels", "client", "server"):
        shutil.copytree(ROOT / d, old / d, ignore=shutil.ignore_patterns("__pycache__", "results"))
    bench = old / "bench" / "serving.py"  # a mark showing which tree's bench wrote a report
    bench.write_text(bench.read_text().replace("TARGET_SLACK_US = 150.0", "TARGET_SLACK_US = 151.0"))
    out = tmp_path / "out"
    proc = _run_bench("ab_serving.py", ["--old", str(old), "--out", str(out), "--pairs", "1", "--",
                                        "--smoke", "--work-dir", str(tmp_path / "ckpt"), "--concurrency", "1", "--tokens", "4",
                                        "--wires", "bf16", "--apis", "stream", "--duration-s", "0.2", "--warmup-s", "0.05"],
                      timeout=240)
    report = json.loads((out / "ab_serving.json").read_text())
    (row,) = report["rows"]
    assert report["pairs"] == 1 and row["cell"] == {"shape": "smoke", "wire": "bf16", "api": "stream", "concurrency": 1, "tokens": 4}
    assert row["new_p50_us"][0] > 0 and row["old_p50_us"][0] > 0 and row["tokens_per_s_new_over_old"] > 0
    assert (out / "new1" / "serving.json").exists() and (out / "old1" / "serving.json").exists()
    assert "echo + 151 us" in (out / "old1" / "serving.md").read_text()
    assert "echo + 150 us" in (out / "new1" / "serving.md").read_text()
    assert proc.stdout.rstrip().splitlines()[-1].startswith("| smoke | bf16 | stream | 1 | 4 |")


def test_ab_serving_table_gives_each_pairs_ratio() -> None:
    """Pair i is new run i against old run i (they ran back to back); the means' ratio hides which pairs won."""
    ab_serving = load_bench("ab_serving.py")

    def report(p50: float, tps: float, inproc: float | None = None, wait: float | None = None) -> dict:
        server = {"p50_us": p50, "tokens_per_s": tps, "batch_tokens_p50": 240}
        if wait is not None:  # trees before timing.wait_us have none
            server["server_wait_us_p50"] = wait
        return {"rows": [{"shape": "s", "wire": "bf16", "api": "stream", "concurrency": 64, "tokens": 16, "server": server,
                          **({"inproc": {"tokens_per_s": inproc}} if inproc else {})}]}

    text, (row,) = ab_serving.table([report(900, 120.0), report(1000, 90.0)], [report(1000, 100.0), report(1000, 100.0)])
    assert row["tokens_per_s_new_over_old_by_pair"] == pytest.approx([1.2, 0.9])
    assert row["tokens_per_s_new_over_old"] == pytest.approx(1.05) and row["p50_new_over_old"] == pytest.approx(0.95)
    assert text.splitlines()[-1] == ("| s | bf16 | stream | 64 | 16 | 900 / 1000 | 1000 / 1000 | 0.95 | 120 / 90 | 100 / 100 "
                                     "| 1.05 | 1.20 / 0.90 | 240 / 240 | - / - | - / - | - / - | - / - | - / - | - / - |")
    # with in-process figures and the hand-off's wait: each run's ratio to the in-process rate, medians shown
    text, (row,) = ab_serving.table([report(900, 120.0, 200.0, 300), report(1000, 90.0, 300.0, 500)],
                                    [report(1000, 100.0, 400.0, 900), report(1000, 100.0)])
    assert row["new_ratio_to_in_process"] == pytest.approx([0.6, 0.3]) and row["old_ratio_to_in_process"] == [0.25, None]
    assert row["new_wait_us_p50"] == [300, 500] and row["old_wait_us_p50"] == [900, None]
    assert text.splitlines()[-1].endswith("| 400 / 900 | 0.45 / 0.25 | - / - | - / - | - / - |")


def test_ab_serving_table_gives_the_servers_cpu_and_its_compute_threads_busy_share() -> None:
    """Each run's CPU per request, the busy share of the thread that runs the experts calls (named by the report's
    ``servers[shape].compute_thread``) and the compute process's share of time in calls (``server.compute_loop``) reach
    the JSON, their medians the table; a report without them shows "-"."""
    ab_serving = load_bench("ab_serving.py")

    def report(cpu_us: float, busy: float, other: float) -> dict:
        server = {"p50_us": 1000.0, "tokens_per_s": 100.0, "batch_tokens_p50": 16,
                  "cpu": {"cpu_us_per_request": cpu_us, "thread_busy": {"pid 7/main": busy, "root/main": other}},
                  "compute_loop": {"calls": 10, "calls_per_s": 5.0, "shares": {"calls": busy / 2, "answering": 0.1,
                                                                              "reading_or_waiting": 0.3, "other": 0.1}}}
        return {"servers": {"s": {"compute_thread": "pid 7/main"}},
                "rows": [{"shape": "s", "wire": "bf16", "api": "stream", "concurrency": 1, "tokens": 16, "server": server}]}

    text, (row,) = ab_serving.table([report(2000, 0.9, 0.99), report(2200, 0.96, 0.1)], [report(1200, 0.3, 0.5), report(1400, 0.4, 0.5)])
    assert row["new_cpu_us_per_request"] == [2000, 2200] and row["old_compute_busy"] == [0.3, 0.4]
    assert row["new_in_calls"] == [0.45, 0.48] and row["old_in_calls"] == [0.15, 0.2]
    assert text.splitlines()[-1].endswith("| 2100 / 1300 | 0.93 / 0.35 | 0.46 / 0.17 |")
    bare = report(1000, 0.5, 0.5)
    del bare["servers"]
    del bare["rows"][0]["server"]["compute_loop"]
    assert ab_serving.table([bare], [bare])[0].splitlines()[-1].endswith("| 1000 / 1000 | - / - | - / - |")


STUB_SERVING = """
import json, os, sys
out = sys.argv[sys.argv.index("--out") + 1]
os.makedirs(out, exist_ok=True)
server = {"p50_us": 1000.0, "tokens_per_s": float(os.environ.get("STUB_TOKENS_PER_S", "100")), "batch_tokens_p50": 16}
row = {"shape": "s", "wire": "bf16", "api": "stream", "concurrency": 64, "tokens": 16, "server": server}
json.dump({"rows": [row]}, open(os.path.join(out, "serving.json"), "w"))
"""


def test_ab_serving_gives_each_side_its_environment(tmp_path: Path) -> None:
    """``--new-env`` / ``--old-env``: one tree A/B'd against itself, each side's runs with its own variables (here
    a stub bench/serving.py that reports tokens/s from the environment); a tree A/B'd against itself with the
    same environment is refused."""
    tree = tmp_path / "tree"
    for d in ("kernels", "client", "server"):
        (tree / d).mkdir(parents=True)
    (tree / "bench").mkdir()
    (tree / "bench" / "serving.py").write_text(STUB_SERVING)
    shutil.copy(ROOT / "bench" / "ab_serving.py", tree / "bench" / "ab_serving.py")
    shutil.copy(ROOT / "bench" / "ab_trees.py", tree / "bench" / "ab_trees.py")
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, str(tree / "bench" / "ab_serving.py"), "--old", str(tree), "--out", str(out),
                           "--pairs", "1", "--new-env", "STUB_TOKENS_PER_S=150", "--old-env", "STUB_TOKENS_PER_S=100"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads((out / "ab_serving.json").read_text())
    (row,) = report["rows"]
    assert row["new_tokens_per_s"] == [150.0] and row["old_tokens_per_s"] == [100.0]
    assert report["old_tree"] == f"{tree} STUB_TOKENS_PER_S=100"
    same = subprocess.run([sys.executable, str(tree / "bench" / "ab_serving.py"), "--old", str(tree), "--out", str(out)],
                          capture_output=True, text=True, timeout=60)
    assert same.returncode == 2 and "give the sides different" in same.stderr
    bad = subprocess.run([sys.executable, str(tree / "bench" / "ab_serving.py"), "--old", str(tree), "--out", str(out),
                          "--new-env", "NOEQUALS"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "KEY=VALUE" in bad.stderr


def test_serving_overhead_bench_on_a_compute_process(tmp_path: Path) -> None:
    """bench/serving_overhead.py --compute-worker process --api stream: the fake backend runs in the compute process
    (it is a backend by import path, timed from the environment), and the CPU counted includes that process."""
    out = tmp_path / "out"
    _run_bench("serving_overhead.py", ["--out", str(out), "--concurrency", "2", "--tokens", "2", "--hidden", "256",
                                       "--duration-s", "0.5", "--warmup-s", "0.1", "--load-procs", "1", "--api", "stream",
                                       "--compute-worker", "process", "--base-us", "2000"], timeout=120)
    (row,) = json.loads((out / "overhead.json").read_text())["rows"]
    assert row["requests"] > 0 and not row["errors"], row
    assert row["api"] == "stream" and row["compute_us_p50"] >= 2000  # the sleep set on the command line, in the child
    assert any(key.startswith("pid ") for key in row["thread_cpu_us_per_request"]), row["thread_cpu_us_per_request"]
    assert "SleepExperts" in (out / "server.log").read_text()


def test_ab_series_starts_no_pair_the_budget_cannot_finish(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """bench/ab_trees.run_ab (shared by ab_serving.py): with 20 s runs and a 100 s budget, two pairs run (80 s);
    a third would be cut short by the budget, so it does not start."""
    import argparse
    import types

    ab_trees = load_bench("ab_trees.py")
    clock = [0.0]
    monkeypatch.setattr(ab_trees, "time", types.SimpleNamespace(monotonic=lambda: clock[0]))
    runs: list[str] = []

    def run_once(tree: Path, out: Path, bench_args: list[str], left: float) -> dict:
        clock[0] += 20.0
        runs.append(out.name)
        return {"tree": tree.name}

    args = argparse.Namespace(out=tmp_path / "ab", pairs=3, budget_s=100.0, bench_args=[])
    rc = ab_trees.run_ab("ab_test", {"new": tmp_path / "new", "old": tmp_path / "old"}, run_once,
                         lambda new, old: (f"{len(new)} / {len(old)}", []), args, "test")
    assert rc == 0 and runs == ["new1", "old1", "new2", "old2"]
    assert json.loads((tmp_path / "ab" / "ab_test.json").read_text())["pairs"] == 2


def _serving_module(monkeypatch: pytest.MonkeyPatch) -> Any:
    """bench/serving.py imported as a module (registered in sys.modules for the test: its dataclasses look their
    module up there)."""
    return load_bench("serving.py", monkeypatch)


def test_py_spy_summary_splits_samples_by_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """bench/serving.summarize_py_spy: each sample goes to its innermost process (command lines holding quotes and
    ';' included), processes are named by their stacks, functions lose their line numbers, native frames known
    only by address are pooled per library, and shares are of that process's samples."""

    serving = _serving_module(monkeypatch)
    root = 'process 10:"python bench/serving.py serve {"port": 1}"'
    child = 'process 11:"python -c from multiprocessing.spawn import spawn_main; spawn_main(pipe_handle=6)"'
    fe = 'process 12:"python -c from multiprocessing.spawn import spawn_main; spawn_main(pipe_handle=8)"'
    raw = "\n".join([
        f"{root};thread (10): MainThread;main (serving.py:5);run (lutb_server/event_loop.py:9);decode (codec.py:3) 6",
        f"{root};thread (10): MainThread;main (serving.py:5);run (lutb_server/event_loop.py:9);decode (codec.py:4) 2",
        f"{root};{child};thread (11): MainThread;_child_main (lutb_server/worker_process.py:250);sync (torch.py:1) 9",
        f"{root};{child};thread (11): MainThread;_child_main (lutb_server/worker_process.py:260) 1",
        f"{root};{fe};thread (12): MainThread;front_end_main (lutb_server/front_ends.py:120);0x7f01 (libc.so.6) 3",
        f"{root};{fe};thread (12): MainThread;front_end_main (lutb_server/front_ends.py:120);0x7f02 (libc.so.6) 1",
        "not a sample line",
    ])
    text = serving.summarize_py_spy(raw)
    assert text.startswith("py-spy, the server's processes (server main, front ends, compute process), 22 samples")
    shares = [line.split() for line in text.splitlines()[2:5]]
    assert shares == [["45.45%", "process", "11", "compute", "process"],
                      ["36.36%", "process", "10", "server", "main", "(front", "end", "0)"],
                      ["18.18%", "process", "12", "front", "end"]]
    assert "100.00%  decode (codec.py)" in text  # lines 3 and 4 pooled: all 8 of process 10's samples
    assert " 90.00%  sync (torch.py)" in text and " 10.00%  _child_main (lutb_server/worker_process.py)" in text
    assert "100.00%  ? (libc.so.6)" in text
    assert "spawn_main" not in text.replace("front ends, compute process", "")  # no command line leaks into frames


def test_compute_loop_totals_take_the_freshest_front_end(monkeypatch: pytest.MonkeyPatch) -> None:
    """bench/serving.compute_loop_totals: the compute process's counters from a metrics page as prometheus_client
    writes it, each the largest any front end reports (each reports the process as of its own last answer), also
    unlabelled (one front end); None on a page without them."""
    serving = _serving_module(monkeypatch)
    page = """# TYPE lutb_compute_calls_total counter
lutb_compute_calls_total{front_end="1"} 7.0
lutb_compute_calls_total{front_end="0"} 9.0
# TYPE lutb_compute_loop_seconds_total counter
lutb_compute_loop_seconds_total{front_end="0",phase="calls"} 1.5
lutb_compute_loop_seconds_total{front_end="0",phase="answering"} 0.25
lutb_compute_loop_seconds_total{front_end="0",phase="reading_or_waiting"} 2.0
lutb_compute_loop_seconds_total{front_end="0",phase="other"} 0.25
lutb_compute_loop_seconds_total{front_end="1",phase="calls"} 1.25
lutb_compute_loop_seconds_total{front_end="1",phase="other"} 0.5
"""
    assert serving.compute_loop_totals(page) == {"calls": 9.0, "calls_s": 1.5, "answering_s": 0.25,
                                                 "reading_or_waiting_s": 2.0, "other_s": 0.5}
    single = "\n".join(line for line in page.splitlines() if 'front_end="1"' not in line)
    single = single.replace('front_end="0",', "").replace('{front_end="0"}', "") + "\n"
    assert serving.compute_loop_totals(single) == {"calls": 9.0, "calls_s": 1.5, "answering_s": 0.25,
                                                   "reading_or_waiting_s": 2.0, "other_s": 0.25}
    assert serving.compute_loop_totals("# TYPE lutb_queue_depth gauge\nlutb_queue_depth 0.0\n") is None


def test_compute_process_calls_read_from_the_server_log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """bench/serving.compute_process_calls: the compute process's exit line (the last one, if a log holds several), or
    None for a log without one and for no log."""
    serving = _serving_module(monkeypatch)
    log = tmp_path / "server.log"
    done = "2026-12-06 05:23:32,075 INFO lutb_server.worker_process [compute]: done: {} experts call(s) ran {} batch(es) of 8 serving process(es), x a call\n"
    log.write_text("[server] SERVING\n" + done.format(3, 4) + done.format(5466, 14824))
    assert serving.compute_process_calls(log) == {"calls": 5466, "batches": 14824, "front_ends": 8, "batches_per_call": 2.71}
    from lutb_server.worker_process import LoopTimes

    times = LoopTimes(calls_s=0.0, answering_s=0.0, reading_s=0.0)
    line = done.format(7, 21).replace("x a call", f"3.00 a call; {times.summary()}")
    log.write_text(line)
    read = serving.compute_process_calls(log)
    assert read is not None and read["calls"] == 7 and set(read["loop_shares"]) == {"calls", "answering", "reading_or_waiting", "other"}
    line = done.format(7, 21).replace("x a call", "3.00 a call; loop: calls 81.5%, answering 3.2%, reading or waiting 14.1%, other 1.2% of 12.3 s")
    log.write_text(line)
    assert serving.compute_process_calls(log)["loop_shares"] == {"calls": 81.5, "answering": 3.2, "reading_or_waiting": 14.1, "other": 1.2}
    # a reused --out: the log holds an earlier run's server; only this run's part (from its start) counts
    start = log.stat().st_size
    with log.open("a") as fh:
        fh.write("[server] SERVING\n")  # this run's server did not stop cleanly: no exit line of its own
    assert serving.compute_process_calls(log, start) is None
    assert serving.compute_process_calls(log)["calls"] == 7
    log.write_text("[server] SERVING\n[server] stopped\n")  # a thread worker's log
    assert serving.compute_process_calls(log) is None
    assert serving.compute_process_calls(tmp_path / "absent.log") is None


def test_saturation_says_where_tokens_stop_growing_and_the_compute_side_is_busy(tmp_path: Path,
                                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """bench/serving._saturation: per series, where tokens/s stop growing by 10%, and from which concurrency the
    thread running the experts calls is at least COMPUTE_BUSY busy (else its largest share); compute_thread_key finds
    that thread: the compute process's pid from the server log, or the thread worker by name."""
    serving = _serving_module(monkeypatch)
    log = tmp_path / "server.log"
    log.write_text("[server] x lutb_server.worker_process compute process 4242 ready: backend packed\n"
                   "INFO lutb_server.worker_process [front end 1]: compute process (shared) ready: backend packed\n")
    assert serving.compute_thread_key(log, "process") == "pid 4242/main"
    with log.open("a") as fh:  # another run into the same --out: its server's lines are appended
        fh.write("[server] x lutb_server.worker_process compute process 5151 ready: backend packed\n")
    assert serving.compute_thread_key(log, "process") == "pid 5151/main"
    assert serving.compute_thread_key(log, "process", start=len(log.read_bytes())) is None  # nothing of this run's yet
    log.write_text("[server] x lutb_server.worker_process compute process 4242 ready: backend packed\n")
    assert serving.compute_thread_key(log, "thread") == "root/lutb-compute"
    assert serving.compute_thread_key(tmp_path / "missing.log", "process") is None
    key = "pid 4242/main"

    def row(api: str, c: int, tok_s: float, busy: float) -> object:
        return serving.Row("s", "bf16", api, c, 16, {"tokens_per_s": tok_s, "cpu": {"thread_busy": {key: busy, "root/main": 0.99}}})

    rows = [row("stream", 8, 100.0, 0.5), row("stream", 64, 200.0, 0.93), row("stream", 128, 300.0, 0.97),
            row("unary", 8, 100.0, 0.3), row("unary", 64, 105.0, 0.6), row("unary", 128, 108.0, 0.62)]
    got = serving._saturation(rows, key)
    assert got == {"bf16 stream T=16": "still growing at C=128; compute busy >= 0.9 from C=64",
                   "bf16 unary T=16": "flat from C=8 (100 tok/s); compute at most 0.62 busy"}
    assert serving._saturation(rows) == {"bf16 stream T=16": "still growing at C=128", "bf16 unary T=16": "flat from C=8 (100 tok/s)"}


def test_codec_cpu_bench_runs() -> None:
    """bench/codec_cpu.py imports what the request path uses today (it once named a function the engine had renamed)."""
    proc = _run_bench("codec_cpu.py", ["--tokens", "2", "--hidden", "64"], timeout=120)
    assert "_nonfinite" in proc.stdout and "WireTensor.from_message" in proc.stdout


class _RegisteringWorker:
    """What ``_like_arenas`` asks of a ComputeWorker: page-locking host memory (here only recorded, or refused)."""

    def __init__(self, registers: bool) -> None:
        self.registers = registers
        self.registered: list[torch.Tensor] = []
        self.unregistered: list[torch.Tensor] = []

    def register_host_memory(self, memory: torch.Tensor) -> bool:
        if self.registers:
            self.registered.append(memory)
        return self.registers

    def unregister_host_memory(self, memory: torch.Tensor) -> None:
        self.unregistered.append(memory)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_in_process_baseline_puts_inputs_and_outputs_in_registered_memory(dtype: torch.dtype,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """bench/serving._like_arenas: each request's x copied (values intact) into one block of memory the worker
    registered, an output destination per request of its output's shape and dtype in the same block, no two
    overlapping; the block unregistered afterwards. A worker that registers nothing gets the requests as they were."""
    from lutb_server.engine import PreparedRequest

    serving = _serving_module(monkeypatch)
    gen = torch.Generator().manual_seed(11)
    prepared = []
    for tokens, mode in ((3, "combined"), (1, "route_major"), (5, "combined")):
        x = torch.randn(tokens, 64, generator=gen).to(dtype)
        ids = torch.randint(0, 8, (tokens, 2), dtype=torch.int32, generator=gen)
        w = torch.rand(tokens, 2, generator=gen)
        scales = torch.full((tokens, 2), 127, dtype=torch.uint8) if dtype == torch.float8_e4m3fn else None
        prepared.append(PreparedRequest(0, x, ids, w, False, mode, scales, torch.bfloat16 if scales is not None else None))
    worker = _RegisteringWorker(registers=True)
    with serving._like_arenas(worker, prepared) as (placed, into):
        [memory] = worker.registered
        start, end = memory.data_ptr(), memory.data_ptr() + memory.numel()
        assert start % 4096 == 0 and memory.is_contiguous()
        spans = []
        for r, p, dest in zip(prepared, placed, into):
            assert p.x.dtype == r.x.dtype and p.x.shape == r.x.shape and p.x is not r.x
            assert torch.equal(p.x.view(torch.uint8), r.x.view(torch.uint8))
            assert p.topk_ids is r.topk_ids and p.x_scales is r.x_scales and p.output_mode == r.output_mode
            assert list(dest.shape) == r.output_shape and dest.dtype == torch.bfloat16 and dest.is_contiguous()
            for t in (p.x, dest):
                at = t.data_ptr()
                spans.append((at, at + t.numel() * t.element_size()))
        assert all(start <= a and b <= end for a, b in spans)
        spans.sort()
        assert all(b <= a2 for (_, b), (a2, _) in zip(spans, spans[1:]))  # no two overlap
        assert worker.unregistered == []
    assert worker.unregistered == [memory]
    refusing = _RegisteringWorker(registers=False)
    with serving._like_arenas(refusing, prepared) as (same, into):
        assert same is prepared and into is None


def test_serving_window_and_targets_count_only_clean_answers(monkeypatch: pytest.MonkeyPatch) -> None:
    """The measured window is applied after the run (a window moved by a late first answer once kept the samples
    counted before it moved: +34% tokens/s in a review's replay), and a cell with failed requests or callers
    unanswered in the window meets no target (in-band stream errors once counted as answered tokens)."""
    serving = _serving_module(monkeypatch)
    samples = [(0.5, 0.9, 0), (1.0, 1.2, 0), (1.9, 2.1, 1), (2.0, 2.4, 1), (2.9, 3.1, 0)]
    assert serving.window_samples(samples, 1.0, 3.0) == [(1.0, 1.2, 0), (1.9, 2.1, 1), (2.0, 2.4, 1)]
    assert serving.window_samples(samples, 2.0, 4.0) == [(2.0, 2.4, 1), (2.9, 3.1, 0)]  # moved: earlier ones gone

    def row(concurrency: int, tokens: int, **server: Any) -> Any:
        base = {"p50_us": 100.0, "tokens_per_s": 1e6, "error_count": 0, "callers_measured": concurrency}
        r = serving.Row("s", "bf16", "stream", concurrency, tokens, {**base, **server},
                        echo={"p50_us": 50.0, "tokens_per_s": 1e6}, inproc={"us": 10.0, "tokens_per_s": 1e6})
        serving._targets(r)
        return r.targets

    assert row(1, 16)["latency"]["ok"] and row(64, 16)["throughput"]["ok"]
    assert not row(1, 16, p50_us=211.0)["latency"]["ok"]  # 10 + 50 + 150 = 210
    for bad in ({"error_count": 3}, {"callers_measured": 63}):
        targets = row(64, 16, **bad)
        assert not targets["throughput"]["ok"] and "callers answered" in targets["throughput"]["unclean"]
    assert not row(1, 16, error_count=1)["latency"]["ok"]


def test_the_throughput_target_compares_at_the_calls_mean_size(monkeypatch: pytest.MonkeyPatch) -> None:
    """Calls of 64 and 256 tokens answering 16-token requests: the 256-token call answers 4x the requests, so the
    requests' median batch is 256 while the calls' mean is 160, the harmonic mean over requests. The 80% target is
    checked against the in-process rate at the calls' mean (``inproc``); the ratio at the requests' median
    (``inproc_p50``) is reported beside it."""
    serving = _serving_module(monkeypatch)
    per_request = [64] * 4 + [256] * 16  # one call of each, as their requests report them
    assert statistics.harmonic_mean(per_request) == pytest.approx(160) and statistics.median(per_request) == 256
    r = serving.Row("s", "bf16", "stream", 64, 16, {"p50_us": 1.0, "p99_us": 2.0, "tokens_per_s": 85_000.0,
                                                     "batch_tokens_p50": 256, "error_count": 0, "callers_measured": 64},
                    echo={"p50_us": 1.0, "tokens_per_s": 1e6}, inproc={"tokens_per_s": 100_000.0, "batch_tokens": 160},
                    inproc_p50={"tokens_per_s": 120_000.0, "batch_tokens": 256})
    serving._targets(r)
    t = r.targets["throughput"]
    assert t["ok"] and t["min_tokens_per_s"] == pytest.approx(80_000)
    assert t["ratio"] == pytest.approx(0.85) and t["ratio_at_p50_batch"] == pytest.approx(85 / 120)
    assert "(0.85; 0.71 at p50)" in serving.short_table([r])


def test_serving_report_is_strict_json_with_provenance(monkeypatch: pytest.MonkeyPatch) -> None:
    """A cell without answers has NaN percentiles: the report writes them as null (strict JSON), and says when, from
    which commit and with which command it was made."""
    serving = _serving_module(monkeypatch)
    assert serving._json_safe({"a": [float("nan"), 1.0, (float("inf"),)], "b": "x"}) == {"a": [None, 1.0, [None]], "b": "x"}
    prov = serving.provenance()
    assert set(prov) == {"date_utc", "commit", "dirty", "argv"} and prov["date_utc"].endswith("Z")
    assert prov["commit"] is None or len(prov["commit"]) == 40


def test_serving_bench_records_a_shape_whose_server_fails(tmp_path: Path) -> None:
    """A server that fails to start (the packed backend on the CPU) once raised out of main, skipping the other
    shapes and writing nothing about it; now the failure is in serving.json and the exit status is 1."""
    out = tmp_path / "out"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / d) for d in ("kernels", "client", "server")] + [env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "serving.py"), "--smoke", "--backend", "packed", "--out",
                           str(out), "--concurrency", "1,1", "--tokens", "4"], capture_output=True, text=True,
                          timeout=180, env=env, cwd=ROOT)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    report = json.loads((out / "serving.json").read_text())
    assert "failed" in report["servers"]["smoke"] and report["rows"] == []
    assert "smoke FAILED" in proc.stdout


def test_saturation_takes_a_concurrency_given_twice(monkeypatch: pytest.MonkeyPatch) -> None:
    """`--concurrency 1,1` gave two rows of one concurrency, and sorting (concurrency, Row) pairs compared Rows."""
    serving = _serving_module(monkeypatch)
    rows = [serving.Row("s", "bf16", "stream", c, 16, {"tokens_per_s": tps}) for c, tps in ((1, 100.0), (1, 120.0), (8, 500.0))]
    assert serving._saturation(rows) == {"bf16 stream T=16": "still growing at C=8"}


def test_the_profiler_makes_its_log_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """bench/serving_overhead.py hands the Profiler its own --out, where no logs/ folder was made: attaching py-spy
    failed with FileNotFoundError once the logs moved to OUT/logs."""
    serving = _serving_module(monkeypatch)
    profiler = serving.Profiler(tmp_path / "out", "overhead")
    (tmp_path / "out").mkdir()
    profiler.py_spy = shutil.which("true")  # stands in for py-spy: starts and exits
    if profiler.py_spy is None:
        pytest.skip("no `true` program")
    profiler.attach(os.getpid())
    profiler.proc.wait(10)
    assert (tmp_path / "out" / "logs" / "profile-overhead.pyspy.log").exists()
    assert profiler.detach() is None  # no samples were written


def test_the_busy_table_shows_the_compute_process_shares(monkeypatch: pytest.MonkeyPatch) -> None:
    """bench/serving.busy_table: a cell with a compute process shows its calls per second, its shares in calls and
    in reading or waiting, and per call the tokens (tok/s over calls/s) and the microseconds in calls; a cell without
    one (the thread worker) shows dashes there."""
    serving = _serving_module(monkeypatch)
    loop = {"calls": 900, "calls_per_s": 1800.0,
            "shares": {"calls": 0.614, "answering": 0.05, "reading_or_waiting": 0.297, "other": 0.039}}
    rows = [serving.Row("s", "bf16", "stream", 64, 16, {"tokens_per_s": 5e4, "compute_loop": loop}),
            serving.Row("s", "bf16", "stream", 1, 16, {"tokens_per_s": 1e3})]
    head, rule, with_process, without = serving.busy_table(rows).splitlines()
    assert head.endswith("| compute calls/s | in calls | reading or waiting | tokens per call | us per call |")
    assert rule.count("---") == head.count("|") - 1
    assert with_process.endswith("| 1800 | 0.61 | 0.30 | 28 | 341 |"), with_process  # 5e4 / 1800; 0.614 / 1800 s
    assert without.endswith("| - | - | - | - | - |"), without
