"""The git state a benchmark report records (its provenance): shared by the bench scripts."""

from __future__ import annotations

import subprocess
from pathlib import Path


ARCHIVED_COMMIT = Path(__file__).resolve().parent / "ARCHIVED_COMMIT"
"""Holds ``$Format:%H$`` in a checkout; ``git archive`` writes the archived commit there (.gitattributes export-subst)."""


def archived_commit(path: Path = ARCHIVED_COMMIT) -> str | None:
    """The commit a ``git archive`` copy of the tree was made from, or None (a checkout, or no such file)."""
    try:
        lines = path.read_text().split()
    except OSError:
        return None
    commit = lines[-1] if lines else ""
    return commit if len(commit) == 40 and all(c in "0123456789abcdef" for c in commit) else None


def git_state(repo: Path) -> tuple[str | None, bool | None]:
    """``(HEAD commit, tracked files changed)`` of the git tree holding ``repo``. Where no git tree tracks ``repo`` (a
    ``git archive`` copy, also one in an ignored folder of a checkout, such as the ``ab_new/`` the device runs use,
    whose checkout's HEAD says nothing about it; or no git installed): ``(the archived commit, None)`` from
    :data:`ARCHIVED_COMMIT`, or ``(None, None)``. Untracked files (results being written) do not count as changes."""
    def git(*args: str) -> str | None:
        try:
            proc = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, timeout=20)
        except (OSError, subprocess.SubprocessError):
            return None
        return proc.stdout if proc.returncode == 0 else None

    head = git("rev-parse", "HEAD")
    if head is None or git("ls-files", "--error-unmatch", "--", ".") is None:
        return archived_commit(), None
    status = git("status", "--porcelain", "--untracked-files=no")
    return head.strip(), (None if status is None else bool(status.strip()))
