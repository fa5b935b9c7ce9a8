"""The metrics endpoint of a server with several front ends, served by a small process of its own.

Why: each front end (a serving process with its own event loop) keeps its metrics in its own registry, on a
loopback port. Merging them at a scrape means reading N OpenMetrics answers and parsing them in Python, which
holds the merging process's GIL: done in front end 0, as it was, a scrape of 8 front ends holding 8 layers' series
took 359 ms of front end 0's CPU on the CPU sandbox and kept its event loop from running for 62 ms at a stretch
(median; bench/metrics_scrape.py, bench/results/2026-12-07-metrics-scrape-cpu.md), so requests on front end 0
stalled at every scrape. Here the merge runs in a process that serves no requests: front end 0 starts it
(:meth:`MetricsGateway.start`) with the loopback ports of every front end, its own included; it binds the server's
metrics address, and exits when front end 0 stops it or exits.

The process imports no torch (prometheus_client and the standard library), so it starts in a fraction of a second
and holds ~25 MB.
"""

from __future__ import annotations

import argparse
import http.client
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics
from prometheus_client.registry import Collector

_OPENMETRICS = "application/openmetrics-text; version=1.0.0; charset=utf-8"
_READ_CHUNK = 1 << 16  # bytes per read of a front end's answer


class FrontEndsCollector(Collector):
    """The metrics of front ends 0..N-1, read from their loopback endpoints at scrape time, merged family by family,
    every sample labelled ``front_end``, plus ``lutb_front_end_up{front_end}``.

    Args:
        ports: the loopback metrics ports of front ends 0..N-1, in order.
        timeout_s: how long the front ends' answers may take, all together: the endpoints are read in
            parallel, each read whole by one deadline (every socket operation waits at most until then), so a
            scrape takes at most about this long however many front ends hang or answer slowly. A front end that
            is late, fails, answers broken HTTP, or whose answer is not valid OpenMetrics, shows as
            ``lutb_front_end_up{front_end="k"} 0`` and contributes no samples.

    The endpoints are read directly, never through a proxy of the environment, in OpenMetrics, the
    format that keeps every family's type (info, counter with its ``_created`` sample): the families
    yielded are those a registry of all front ends' metrics would hold, so the endpoint serving this
    collector writes valid Prometheus text or valid OpenMetrics, whichever the scraper asks for.
    """

    def __init__(self, ports: list[int], timeout_s: float = 2.0) -> None:
        self.ports, self.timeout_s = list(ports), timeout_s

    def _read(self, port: int, deadline: float) -> list[Metric]:
        """The families of the front end whose metrics listen on loopback ``port``, read whole by ``deadline``
        (``time.monotonic()`` seconds); OSError if it does not answer in time (TimeoutError) or answers an HTTP error,
        ValueError if its answer is not OpenMetrics. Each socket operation waits at most until the deadline, so the
        read ends by then however the front end answers."""
        def remaining() -> float:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"front end metrics on port {port} not read within {self.timeout_s:g} s")
            return left

        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=remaining())  # loopback: no proxy to bypass
        try:
            conn.request("GET", "/metrics", headers={"Accept": _OPENMETRICS})
            sock = conn.sock  # the response reads it after the connection lets go of it (an answer that closes)
            sock.settimeout(remaining())
            response = conn.getresponse()
            if response.status != 200:
                raise OSError(f"front end metrics on port {port} answered HTTP {response.status}")
            body = bytearray()
            while not response.isclosed():  # closed once the whole answer is read
                sock.settimeout(remaining())
                chunk = response.read1(_READ_CHUNK)  # what one read brings: a trickle cannot hold it past the deadline
                if not chunk:
                    break
                body += chunk
            if response.length:  # the front end hung up before its Content-Length was read
                raise http.client.IncompleteRead(bytes(body), response.length)
        finally:
            conn.close()
        return list(parse_openmetrics(body.decode()))

    def _read_or_none(self, port: int, deadline: float) -> list[Metric] | None:
        """:meth:`_read`, None for a front end that is down, late, or answers anything but OpenMetrics over HTTP
        (one dying mid-answer: ``http.client.IncompleteRead``, not an OSError)."""
        try:
            return self._read(port, deadline)
        except (OSError, ValueError, http.client.HTTPException):
            return None

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {}
        up = GaugeMetricFamily("lutb_front_end_up", "1 when this front end's metrics were read at this scrape", labels=["front_end"])
        deadline = time.monotonic() + self.timeout_s
        # in parallel, under one deadline: late front ends cost one timeout together, not one each
        with ThreadPoolExecutor(max_workers=max(len(self.ports), 1), thread_name_prefix="lutb-scrape") as pool:
            answers = list(pool.map(lambda port: self._read_or_none(port, deadline), self.ports))
        for k, metrics in enumerate(answers):
            up.add_metric([str(k)], 0.0 if metrics is None else 1.0)
            for metric in metrics or ():
                family = families.get(metric.name)
                if family is None:
                    family = families[metric.name] = Metric(metric.name, metric.documentation, metric.type, metric.unit)
                family.samples.extend(sample._replace(labels={**sample.labels, "front_end": str(k)}) for sample in metric.samples)
        yield from families.values()
        yield up

class MetricsGateway:
    """Front end 0's handle on the metrics process (see the module docstring).

    :meth:`spawn` starts it and returns at once (so that a caller interrupted while it starts still holds the handle
    to :meth:`close`), :meth:`wait_serving` waits until it serves; :meth:`start` does both. Its stdin is a pipe that
    only this handle writes: it exits at the pipe's end, when :meth:`close` closes it or this process ends in any way
    (killed too), and ignores SIGINT and SIGTERM sent to the whole process group (Ctrl-C, systemd's
    ``KillMode=control-group``), so that it serves the metrics while front end 0 drains.

    Attributes:
        process: the ``subprocess.Popen`` of it.
        port: the port it serves ``/metrics`` on (the one asked for, or the one picked for 0); 0 until it serves.
    """

    def __init__(self, process: subprocess.Popen[bytes]) -> None:
        self.process, self.port = process, 0

    @classmethod
    def spawn(cls, host: str, port: int, front_end_ports: list[int]) -> MetricsGateway:
        """Start the process that will serve ``host:port`` (0: a free port) with the metrics of the front ends
        listening on loopback ``front_end_ports`` (front end k's at index k); do not wait for it."""
        # -I: none of this environment's PYTHON* variables (PYTHONOPTIMIZE, ...) nor a module in the working directory
        # reaches it; it imports from where this process does (lutb_server may be on a path set up in code)
        paths = [p for p in sys.path if p]
        args = ["--host", host, "--port", str(port), "--front-end-ports", ",".join(map(str, front_end_ports))]
        code = f"import sys; sys.path[:] = {paths!r}; from lutb_server.metrics_gateway import main; main({args!r})"
        process = subprocess.Popen([sys.executable, "-I", "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        return cls(process)

    def wait_serving(self, timeout_s: float = 30.0) -> None:
        """Wait until the process serves (sets :attr:`port`); blocking (a fraction of a second).

        Raises:
            OSError: it could not bind its address (``cannot bind metrics to ...``), exited, or did not answer
                within ``timeout_s`` seconds; it is stopped then.
        """
        out = self.process.stdout
        assert out is not None
        ready = bool(select.select([out], [], [], timeout_s)[0])
        line = out.readline() if ready else b""
        out.close()
        words = line.decode(errors="replace").split(maxsplit=1)
        if words[:1] == ["serving"] and len(words) == 2:
            self.port = int(words[1])
            return
        if ready and not line:  # its stdout ended: it is exiting
            try:
                self.process.wait(5)
            except subprocess.TimeoutExpired:
                pass
        exited = self.process.poll()
        self.close(0)
        if words[:1] == ["failed"] and len(words) == 2:
            raise OSError(words[1].strip())
        if line:
            raise OSError(f"the metrics process said {line[:200]!r} instead of serving")
        if exited is not None:
            raise OSError(f"the metrics process exited with code {exited} before serving (its error is in the log above)")
        raise OSError(f"the metrics process did not serve within {timeout_s:g} s")

    @classmethod
    def start(cls, host: str, port: int, front_end_ports: list[int], *, timeout_s: float = 30.0) -> MetricsGateway:
        """:meth:`spawn`, then :meth:`wait_serving`; returns the serving process's handle."""
        gateway = cls.spawn(host, port, front_end_ports)
        gateway.wait_serving(timeout_s)
        return gateway

    @property
    def running(self) -> bool:
        return self.process.poll() is None

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the process: end its stdin, then SIGKILL it if it has not exited within ``timeout_s``."""
        if self.process.stdin is not None and not self.process.stdin.closed:
            try:
                self.process.stdin.close()
            except OSError:
                pass
        try:
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def main(argv: list[str] | None = None) -> None:
    """The metrics process: serve the merged endpoint; say ``serving PORT`` (or ``failed MESSAGE``) on stdout; exit
    when stdin ends (front end 0 closed it, or is gone)."""
    # the process group's signals are front end 0's to act on: it drains (its metrics served meanwhile), then closes
    # this process's stdin
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    p = argparse.ArgumentParser(prog="python -m lutb_server.metrics_gateway",
                                description="serve the merged metrics of a server's front ends")
    p.add_argument("--host", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--front-end-ports", required=True, help="comma-separated loopback ports of front ends 0..N-1")
    args = p.parse_args(argv)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(FrontEndsCollector([int(port) for port in args.front_end_ports.split(",")]))
    try:
        http, _ = start_http_server(args.port, addr=args.host, registry=registry)
    except OSError as exc:
        where = f"[{args.host}]:{args.port}" if ":" in args.host else f"{args.host}:{args.port}"
        print(f"failed cannot bind metrics to {where}: {exc.strerror or exc}", flush=True)
        sys.exit(1)
    print(f"serving {http.server_port}", flush=True)
    sys.stdout.close()
    sys.stdin.buffer.read()  # until front end 0 closes it or exits


if __name__ == "__main__":
    main()

__all__ = ["FrontEndsCollector", "MetricsGateway"]
