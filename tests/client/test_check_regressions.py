"""`lutb check` findings of a review, each fixed: small requests judged strictly on their own, requests kept within
message limits (and split when a node refuses one as too large), the judge's own failures an exit 2 instead of a
verdict about the target, the output dtype checked, failing rows worst first, a node under two names refused."""

from __future__ import annotations

import json
from pathlib import Path

import grpc
import pytest
import torch

from lutb_client.check import CheckError, NodeSide, ReferenceSide, run_check
from lutb_client.check.compare import ErrorStats
from lutb_client.check.report import CheckReport, Row
from lutb_client.check.suites import SUITES, NodeShape, make_batches
from lutb_client.errors import ExpertServiceError
from lutb_kernels.checkpoint import Checkpoint, write_checkpoint
from lutb_server.testing import ServerThread

SMALL = {"tokens": 16, "topk": 4, "progress": False}


def _run(argv: list[str]) -> int:
    from lutb_server.cli import build_parser

    args = build_parser().parse_args(argv)
    return args.run(args)


# 1. small requests ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("wrong", ["T = 1", "2 <= T < 64"])
def test_a_node_wrong_only_on_small_requests_fails(server: ServerThread, client_checkpoint: Path, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch, wrong: str) -> None:
    """A node 5% off on every one-token request (the decode path) passed a default check: single_token sent one
    token, judged at 10x the tolerance, and the pooled row diluted it among hundreds of large-batch rows. Requests
    of 2 to 63 tokens were never sent by default at all. Now single_token sends 64 one-token requests and
    small_batches a sweep of 2..63, each a row of >= 64 tokens judged at the strict tolerance."""
    from lutb_client.client import ExpertClient

    original = ExpertClient.forward

    def skewed(self, layer, hidden_states, *args, **kwargs):
        out = original(self, layer, hidden_states, *args, **kwargs)
        tokens = hidden_states.shape[0]
        if (tokens == 1) if wrong == "T = 1" else (2 <= tokens < 64):
            out = (out.float() * 1.05).to(out.dtype)
        return out

    monkeypatch.setattr(ExpertClient, "forward", skewed)
    report = tmp_path / "r.json"
    assert _run(["check", server.address, "--checkpoint", str(client_checkpoint), "--json", str(report)]) == 1
    rows = {(r["suite"], r["layer"]): r for r in json.loads(report.read_text())["layers"]}
    part = "single_token" if wrong == "T = 1" else "small_batches"
    for layer in (0, 3):
        row = rows[(part, layer)]
        assert row["tokens"] >= 64 and row["judged"] == "strict" and not row["ok"] and row["rel_l2"] > 0.04
        assert rows[("normal", layer)]["ok"]  # the 64-token request is right


def test_small_request_rows_are_strict_whatever_the_cap() -> None:
    shape = NodeShape(hidden_size=128, num_experts=8, dtype=torch.bfloat16, experts={0: list(range(8))}, max_tokens=1024, topk=4)
    for cap in (1, 5, 16, 64, 1024):
        sizes: dict[str, list[int]] = {}
        for b in make_batches(["single_token", "small_batches"], shape, [0], cap=cap, seed=0):
            sizes.setdefault(b.part, []).append(b.tokens)
        assert sizes["single_token"] == [1] * 64
        assert sum(sizes["small_batches"]) >= 64 and max(sizes["small_batches"]) <= min(cap, 63)
    assert sorted(set(sizes["small_batches"])) == [2, 3, 4, 8, 9, 16, 17, 32, 33, 63]


# 2. message limits ------------------------------------------------------------------------------------------------


def test_batches_fit_the_message_bound() -> None:
    """Requests were split by token count only: a route-major response [T, k, H] could exceed any message limit."""
    bound = 96 * 1024
    shape = NodeShape(hidden_size=128, num_experts=8, dtype=torch.bfloat16, experts={0: list(range(8))}, max_tokens=1024,
                      topk=8, max_message_bytes=bound)
    batches = make_batches(list(SUITES), shape, [0], cap=1024, seed=0, headroom=lambda layer: 2.0**20)
    for b in batches:
        k = b.topk_ids.shape[1]
        response = b.tokens * 128 * 2 * (k if b.output_mode == "route_major" else 1)
        request = b.tokens * (128 * 2 + k * 8)
        assert max(response, request) <= bound, (b.part, b.tokens)
    # max_tokens (combined) is cut by its request: 256 bytes of hidden states and 64 of ids and weights a token
    assert max(b.tokens for b in batches if b.part == "max_tokens") == (bound - 16 * 1024) // 320


def test_a_node_with_a_small_message_limit_is_not_failed(client_checkpoint: Path) -> None:
    """A correct node whose max_message_bytes (4 MiB, the least a server takes) is below the check's requests was
    judged FAIL on RESOURCE_EXHAUSTED (a 20000-token combined request is 5.8 MB). The node now says its bound in
    ModelInfo, so the check's largest batch fits one message from the start; a node that does not say it is split
    on refusal (test_route_major_responses_refused_as_too_large_are_split)."""
    with ServerThread(checkpoint=client_checkpoint, max_message_bytes=4 * 1024 * 1024, max_tokens_per_request=32768) as node:
        side = NodeSide(node.address)
        assert side.message_bytes == 4 * 1024 * 1024  # from ModelInfo.max_message_bytes: fitted from the start
        report = run_check(side, ReferenceSide(client_checkpoint, device="cpu"), suites=["max_tokens"], layers=[0],
                           tokens=20000, topk=4, progress=False)
    assert report.ok and not report.errors, report.format_text()
    (tokens,) = [r.tokens for r in report.layer_rows if r.suite == "max_tokens"]
    assert 8192 < tokens < 20000  # as many as one 4 MiB message holds (with room for the rest of the message)
    assert side.message_bytes == 4 * 1024 * 1024


class _SmallResponses(NodeSide):
    """A node that refuses, as a server does, any response beyond ``limit`` bytes."""

    def __init__(self, address: str, limit: int) -> None:
        super().__init__(address)
        self.limit, self.refused = limit, 0

    def forward(self, batch):
        k = batch.topk_ids.shape[1] if batch.output_mode == "route_major" else 1
        size = batch.tokens * k * batch.hidden_states.shape[1] * batch.hidden_states.element_size()
        if size > self.limit:
            self.refused += 1
            raise ExpertServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                     f"the output takes {size} bytes: more than a message of max_message_bytes = "
                                     f"{self.limit} holds; send fewer tokens per request")
        return super().forward(batch)


def test_route_major_responses_refused_as_too_large_are_split(server: ServerThread, client_checkpoint: Path) -> None:
    """Coverage's first request (64 tokens, k = 6: a 96 KiB response) is refused and sent again as two of 32; the
    node's bound is learned, so every later request (route_major: k = 8, 128 KiB) goes in parts without a refusal."""
    target = _SmallResponses(server.address, 48 * 1024)
    report = run_check(target, ReferenceSide(client_checkpoint, device="cpu"), suites=["coverage", "route_major"],
                       tokens=1024, topk=8, progress=False)
    assert report.ok and not report.errors, report.format_text()
    assert target.refused == 1
    assert {r.tokens for r in report.layer_rows if r.suite in ("coverage", "route_major")} == {64}
    # a request that cannot be split (one token) and is still refused is the node's failure
    report = run_check(_SmallResponses(server.address, 1024), ReferenceSide(client_checkpoint, device="cpu"),
                       suites=["route_major"], layers=[0], tokens=1024, topk=8, progress=False)
    assert not report.ok and {(e["side"], e["code"]) for e in report.errors} == {("target", "RESOURCE_EXHAUSTED")}


# 3. the judge's own failures --------------------------------------------------------------------------------------


def test_a_cuda_index_the_host_lacks_is_refused(server: ServerThread, client_checkpoint: Path,
                                                 monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """--device cuda:7 on a host with one GPU: the first judge call failed, and that was counted as the target's
    failed request (exit 1) and the headroom probe fell silently to 1.0."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(CheckError, match=r"device 'cuda:7': this host has 1 CUDA device"):
        ReferenceSide(client_checkpoint, device="cuda:7")
    assert _run(["check", server.address, "--checkpoint", str(client_checkpoint), "--tokens", "16", "--topk", "4",
                 "--suite", "normal", "--device", "cuda:7"]) == 2
    assert "device 'cuda:7'" in capsys.readouterr().err


@pytest.mark.parametrize("suite", ["normal", "heavy_tailed"])
def test_a_bad_tile_of_the_judge_is_exit_2(server: ServerThread, client_checkpoint: Path, tmp_path: Path, suite: str,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    """A bad tile in the local checkpoint (docs: exit 2) was counted against the target (exit 1); in the headroom
    probe (heavy_tailed) it silently gave headroom 1.0."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    ckpt = Checkpoint(client_checkpoint)
    write_checkpoint(tmp_path / "bad", ckpt.config, {layer: ckpt.layer(layer) for layer in ckpt.layers})
    file = tmp_path / "bad" / "layer-00003.safetensors"
    with safe_open(str(file), framework="pt") as f:
        tensors = {k: f.get_tensor(k).clone() for k in f.keys()}
        meta = dict(f.metadata())
    tensors["layers.3.w2"][0, 0, 0, 16] = 255  # a reserved E8M0 scale byte
    save_file(tensors, str(file), metadata=meta)
    assert _run(["check", server.address, "--checkpoint", str(tmp_path / "bad"), "--force", "--tokens", "16",
                 "--topk", "4", "--suite", suite, "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "layers.3.w2: tile (0, 0, 0): scale byte 255" in err


def test_a_judge_node_that_goes_down_is_exit_2(server: ServerThread, client_checkpoint: Path) -> None:
    """A judge node that stops answering is the judge's failure, not the target's."""
    twin = ServerThread(checkpoint=client_checkpoint).start()
    try:
        judge = NodeSide(twin.address, timeout=5.0)
    finally:
        twin.stop()
    with pytest.raises(CheckError, match=r"the judge \(127\.0\.0\.1:\d+\) failed on batch 0 \(normal, layer 0\): UNAVAILABLE"):
        run_check(NodeSide(server.address), judge, suites=["normal"], **SMALL)


# 5. output dtype --------------------------------------------------------------------------------------------------


class _Float32Answers(NodeSide):
    def forward(self, batch):
        return super().forward(batch).float()


def test_an_output_in_another_dtype_fails(server: ServerThread, client_checkpoint: Path) -> None:
    """A node answering float32 for a bfloat16 model passed: only the shape was checked (the proto: the output is in
    the model dtype)."""
    report = run_check(_Float32Answers(server.address), ReferenceSide(client_checkpoint, device="cpu"),
                       suites=["normal", "route_major"], **SMALL)
    assert not report.ok and report.errors
    assert {(e["side"], e["code"]) for e in report.errors} == {("target", "DTYPE")}
    assert "output dtype float32 != the model dtype bfloat16" in report.errors[0]["message"]
    with ServerThread(checkpoint=client_checkpoint) as twin, pytest.raises(CheckError, match="DTYPE: output dtype float32"):
        run_check(NodeSide(server.address), _Float32Answers(twin.address), suites=["normal"], **SMALL)


# 5b. rows of very different magnitudes -------------------------------------------------------------------------


class _WrongSmallRows(NodeSide):
    """Right on the large rows, wrong on the others: ``huge`` doubles the output of each batch's token of the smallest
    input (100% off); ``tiny`` answers the tokens whose input is tiny throughout (the judge's output there is exactly
    zero) with small noise."""

    def __init__(self, address: str, mode: str) -> None:
        super().__init__(address)
        self.mode = mode

    def forward(self, batch):
        out = super().forward(batch)
        amax = batch.hidden_states.float().abs().amax(-1)
        bad = amax < 1e-30 if self.mode == "tiny" else amax == amax.min()
        if not bool(bad.any()):
            return out
        out = out.clone()
        if self.mode == "tiny":
            out[bad] = (1e-3 * torch.randn_like(out[bad].float())).to(out.dtype)
        else:
            out[bad] = (out[bad].float() * 2).to(out.dtype)
        return out


@pytest.mark.parametrize("mode", ["huge", "tiny"])
def test_rows_wrong_beside_much_larger_rows_fail(server: ServerThread, client_checkpoint: Path, mode: str) -> None:
    """The pooled rel L2 of a magnitudes part is its largest rows' alone: a node wrong on every smaller row passed
    (its pooled rel L2 stayed far under the tolerance, also with noise where the judge's output is exactly zero)."""
    report = run_check(_WrongSmallRows(server.address, mode), ReferenceSide(client_checkpoint, device="cpu"),
                       suites=["magnitudes"], tokens=64, topk=4, progress=False)
    part = f"magnitudes/{mode}"
    rows = [r for r in report.layer_rows if r.suite == part]
    assert rows and not any(r.ok for r in rows) and not report.ok
    reason = "an output row's rel L2" if mode == "huge" else "not zero where the judge's is exactly zero"
    assert all(any(reason in why for why in r.reasons) for r in rows), [r.reasons for r in rows]
    other = "magnitudes/tiny" if mode == "huge" else "magnitudes/huge"
    assert all(r.ok for r in report.layer_rows if r.suite == other)


def test_a_right_node_passes_the_row_by_row_judging(server: ServerThread, client_checkpoint: Path) -> None:
    report = run_check(NodeSide(server.address), ReferenceSide(client_checkpoint, device="cpu"),
                       suites=["magnitudes", "heavy_tailed"], tokens=64, topk=4, progress=False)
    assert report.ok, report.format_text()
    assert all(r.stats.worst_row <= r.limit for r in report.layer_rows) and report.layer_rows


# 6. worst first ---------------------------------------------------------------------------------------------------


def _row(rel: float, suite: str = "normal", expert: int | None = None, layer: int = 0) -> Row:
    stats = ErrorStats()
    ref = torch.ones(64, 128)
    stats.add(ref * (1 + rel), ref)
    return Row(suite=suite, layer=layer, stats=stats, tokens=64, expert=expert, held=None if expert is None else True)


def test_failing_rows_come_worst_first() -> None:
    """Failing rows were keyed 1e300 + ratio, equal for every ratio below ~1e284: they came in layer order."""
    side = {"address": "x", "kind": "node", "model_info": {}}
    report = CheckReport(
        target=side, against=side, dtype="bfloat16", suites=["normal"], seed=0, tokens=64, topk=8, layers_checked=[0, 1],
        layer_rows=[_row(0.02, "coverage"), _row(0.001, "route_major"), _row(0.9, "normal", layer=1), _row(0.05, "max_tokens")],
        expert_rows=[_row(0.02, "coverage", expert=1), _row(0.9, "coverage", expert=5), _row(0.0, "coverage", expert=2)],
    )
    assert [(r.suite, r.ok) for r in report.layer_rows] == [("normal", False), ("max_tokens", False), ("coverage", False),
                                                            ("route_major", True)]
    assert [r.expert for r in report.expert_rows] == [5, 1, 2]
    assert [r["suite"] for r in report.to_json()["layers"]] == ["normal", "max_tokens", "coverage", "route_major"]


# 4. one node under two names --------------------------------------------------------------------------------------


def test_one_node_under_two_names_is_refused(server: ServerThread, capsys: pytest.CaptureFixture[str]) -> None:
    """`lutb check 127.0.0.1:P --against localhost:P` compared a node with itself and passed whatever it computed."""
    from lutb_client.check.runner import same_node

    port = server.address.rsplit(":", 1)[1]
    assert _run(["check", server.address, "--against", f"localhost:{port}", "--tokens", "16", "--suite", "normal"]) == 2
    assert "against itself" in capsys.readouterr().err
    assert same_node(server.address, f"localhost:{port}") and same_node(f"0.0.0.0:{port}", f"dns:///127.0.0.1:{port}")
    assert not same_node(server.address, f"127.0.0.1:{int(port) + 1}")
    with pytest.raises(CheckError, match="judged against itself"):
        run_check(NodeSide(server.address), NodeSide(f"localhost:{port}"), suites=["normal"], **SMALL)


def test_one_node_behind_a_name_that_resolves_elsewhere_is_refused_by_its_instance_id(server: ServerThread,
                                                                                        client_checkpoint: Path) -> None:
    """A proxy or port forward gives one node a second address that resolves apart; ModelInfo.instance_id (one per
    server start, the same from every front end) shows it is one node. Another server has another id."""
    proxied = NodeSide(server.address)
    proxied.address = "proxy.invalid:443"  # what the check would see through a proxy: another name, the same node
    with pytest.raises(CheckError, match="one node .*judged against itself"):
        run_check(NodeSide(server.address), proxied, suites=["normal"], **SMALL)
    with ServerThread(checkpoint=client_checkpoint) as other:
        a, b = NodeSide(server.address), NodeSide(other.address)
        assert a.info["instance_id"] and b.info["instance_id"] and a.info["instance_id"] != b.info["instance_id"]


def test_a_device_out_of_memory_is_a_finding_not_a_size_to_split() -> None:
    """The server's OOM answer (RESOURCE_EXHAUSTED, "... send fewer tokens or routes per request ...") was taken for a
    message-size refusal: the check split the batch and lowered the node's message bound, hiding the OOM."""
    from lutb_client.check.runner import _too_large
    from lutb_server.errors import to_status

    code, oom = to_status(torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 8.00 GiB."))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert not _too_large(ExpertServiceError(code, oom))
    size = ("the output takes 9000000 bytes: more than a message of max_message_bytes = 4194304 holds; "
            "send fewer tokens per request")
    assert _too_large(ExpertServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED, size))
    assert _too_large(ExpertServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED, "Received message larger than max (5 vs. 4)"))


def test_a_node_that_merges_an_experts_two_routes_fails_only_duplicates(server: ServerThread, client_checkpoint: Path,
                                                                      tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No suite used to name one expert twice in a token, so a node that computed such an expert once (keeping the
    first route's weight) passed every suite. ``duplicates`` does, and fails it; the other suites still pass."""
    from lutb_client.client import ExpertClient

    original = ExpertClient.forward

    def merged(self, layer, hidden_states, topk_ids, topk_weights, *args, **kwargs):
        ids, weights = topk_ids.clone(), topk_weights.clone()
        repeated = ids[:, 1] == ids[:, 0] if ids.shape[1] > 1 else torch.zeros(0, dtype=torch.bool)
        if repeated.any():
            weights[repeated, 1] = 0.0  # the second route dropped
        return original(self, layer, hidden_states, ids, weights, *args, **kwargs)

    monkeypatch.setattr(ExpertClient, "forward", merged)
    report = tmp_path / "r.json"
    assert _run(["check", server.address, "--checkpoint", str(client_checkpoint), "--tokens", "16", "--topk", "4",
                 "--suite", "normal,duplicates", "--json", str(report)]) == 1
    rows = json.loads(report.read_text())["layers"]
    assert {r["suite"] for r in rows if not r["ok"]} >= {"duplicates"}
    assert all(r["ok"] for r in rows if r["suite"] == "normal")


def test_routes_per_token_stay_within_the_nodes_max_top_k(client_checkpoint: Path, tmp_path: Path) -> None:
    """A node started with ``max_top_k`` below ``--topk`` refused every request as INVALID_ARGUMENT and failed the
    check; ``duplicates`` sent two routes to a node taking one. Now the routes follow the smallest ``max_top_k`` the
    sides state, and a check left with nothing to send is exit 2, never a pass."""
    with ServerThread(checkpoint=client_checkpoint, max_top_k=2) as two, ServerThread(checkpoint=client_checkpoint,
                                                                                     max_top_k=1) as one:
        report = tmp_path / "r.json"
        assert _run(["check", two.address, "--checkpoint", str(client_checkpoint), "--tokens", "16", "--topk", "8",
                     "--suite", "normal,duplicates,coverage", "--device", "cpu", "--json", str(report)]) == 0
        assert {r["suite"] for r in json.loads(report.read_text())["layers"]} >= {"normal", "duplicates", "coverage"}
        assert _run(["check", one.address, "--checkpoint", str(client_checkpoint), "--tokens", "16",
                     "--suite", "normal,duplicates", "--device", "cpu", "--json", str(report)]) == 0
        assert "duplicates" not in {r["suite"] for r in json.loads(report.read_text())["layers"]}
        assert _run(["check", one.address, "--checkpoint", str(client_checkpoint), "--tokens", "16",
                     "--suite", "duplicates", "--device", "cpu"]) == 2
        assert _run(["record", one.address, "--out", str(tmp_path / "n.lutbrec"), "--suite", "duplicates"]) == 2
        # a record of 4 routes per token, judged by a node taking 2: no verdict about the record (exit 2, not 1)
        assert _run(["record", two.address, "--out", str(tmp_path / "n.lutbrec"), "--suite", "normal", "--topk", "4",
                     "--tokens", "16"]) == 0
    with ServerThread(checkpoint=client_checkpoint) as wide, ServerThread(checkpoint=client_checkpoint, max_top_k=2) as judge:
        assert _run(["record", wide.address, "--out", str(tmp_path / "w.lutbrec"), "--suite", "normal", "--topk", "4",
                     "--tokens", "16"]) == 0
        assert _run(["check", "--replay", str(tmp_path / "w.lutbrec"), "--against", judge.address]) == 2


def test_checking_a_path_writable_creates_and_changes_nothing(tmp_path: Path) -> None:
    """It opened the file to probe it: a link into an existing folder left an empty file behind, and a FIFO's reader
    got its end of file (review)."""
    import os

    from lutb_client.check.record import check_writable

    check_writable(tmp_path / "sub" / "new.json")  # its folder is made, the file is not
    assert (tmp_path / "sub").is_dir() and not (tmp_path / "sub" / "new.json").exists()
    (tmp_path / "target").mkdir()
    link = tmp_path / "link.json"
    link.symlink_to(tmp_path / "target" / "real.json")
    check_writable(link)
    assert not (tmp_path / "target" / "real.json").exists()
    kept = tmp_path / "kept.json"
    kept.write_text("precious")
    before = os.stat(kept)
    check_writable(kept)
    after = os.stat(kept)
    assert kept.read_text() == "precious" and (after.st_mtime_ns, after.st_ctime_ns) == (before.st_mtime_ns, before.st_ctime_ns)
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(OSError, match="not a regular file"):
        check_writable(tmp_path / "fifo")
    os.symlink(tmp_path / "loop", tmp_path / "loop")
    with pytest.raises(OSError, match="cannot be followed"):
        check_writable(tmp_path / "loop")
    os.symlink(tmp_path / "nowhere", tmp_path / "dangling-folder")
    with pytest.raises(OSError, match="is not a folder"):
        check_writable(tmp_path / "dangling-folder" / "r.json")
