"""Remote accuracy checks: judge a node against another node or the local reference; record and replay.

    from lutb_client.check import NodeSide, ReferenceSide, run_check
    report = run_check(NodeSide("10.0.0.7:50051"), ReferenceSide("/models/ds-v3-lutb"), tokens=256)
    print(report.format_text()); report.write_json("check.json")

Modules: :mod:`~lutb_client.check.suites` (input suites), :mod:`~lutb_client.check.compare`
(error statistics), :mod:`~lutb_client.check.report` (verdict, text, JSON, PNG),
:mod:`~lutb_client.check.record` (record files), :mod:`~lutb_client.check.runner`
(sides, :func:`run_check`, :func:`record_node`). The reference side needs
``lutb_kernels``; the PNG needs matplotlib (``pip install 'lutb-moe[plot]'``).
See docs/checking.md.
"""

from lutb_client.check.compare import ErrorStats
from lutb_client.check.record import RECORD_FORMAT, RECORD_VERSION, RecordError, Recording, read_recording, write_recording
from lutb_client.check.report import GROSS_FACTOR, MIN_TOKENS, SCHEMA, TOLERANCE, CheckReport, Row
from lutb_client.check.runner import (
    CheckError,
    IdentityMismatch,
    NodeSide,
    RecordedSide,
    ReferenceSide,
    Side,
    model_info_dict,
    open_recording,
    record_node,
    run_check,
)
from lutb_client.check.suites import SUITES, Batch, NodeShape, make_batches, resolve_suites

__all__ = [
    "GROSS_FACTOR",
    "MIN_TOKENS",
    "RECORD_FORMAT",
    "RECORD_VERSION",
    "SCHEMA",
    "SUITES",
    "TOLERANCE",
    "Batch",
    "CheckError",
    "CheckReport",
    "ErrorStats",
    "IdentityMismatch",
    "NodeShape",
    "NodeSide",
    "RecordError",
    "RecordedSide",
    "Recording",
    "ReferenceSide",
    "Row",
    "Side",
    "make_batches",
    "model_info_dict",
    "open_recording",
    "read_recording",
    "record_node",
    "resolve_suites",
    "run_check",
    "write_recording",
]
