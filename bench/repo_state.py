"""The git state a benchmark report records (its provenance): shared by the bench scripts."""

from __future__ import annotations

import subprocess
from pathlib import Path


def git_state(repo: Path) -> tuple[str | None, bool | None]:
    """``(HEAD commit, tracked files changed)`` of the git tree holding ``repo``; ``(None, None)`` without git (a
    ``git archive`` copy, or no git installed) and where that tree does not track ``repo`` (an archived copy in an
    ignored folder of a checkout, such as the ``ab_new/`` the device runs use: the checkout's HEAD says nothing about
    it). Untracked files (results being written) do not count as changes."""
    def git(*args: str) -> str | None:
        try:
            proc = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, timeout=20)
        except (OSError, subprocess.SubprocessError):
            return None
        return proc.stdout if proc.returncode == 0 else None

    head = git("rev-parse", "HEAD")
    if head is None or not (git("ls-files", "--", ".") or "").strip():
        return None, None
    status = git("status", "--porcelain", "--untracked-files=no")
    return head.strip(), (None if status is None else bool(status.strip()))
