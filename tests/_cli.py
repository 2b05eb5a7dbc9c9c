"""Helpers for tests that drive the ``edgeprune`` CLI in-process (unit and integration)."""

from __future__ import annotations

from edgeprune.cli import main


def run_cli(argv, capsys) -> tuple[int, str, str]:
    """Run ``edgeprune ARGV`` in this process; ``(exit code, stdout, stderr)``."""
    code = main([str(a) for a in argv])
    cap = capsys.readouterr()
    return code, cap.out, cap.err


def one_line_error(code: int, err: str, *needles: str) -> None:
    """The command failed with exactly one ``error: ...`` line on stderr (progress bars
    aside), no traceback, and that line contains every one of ``needles``."""
    assert code != 0
    assert "Traceback" not in err, err
    lines = [ln for ln in err.replace("\r", "\n").splitlines() if ln.strip() and "%|" not in ln]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for n in needles:
        assert n in lines[0], lines[0]
