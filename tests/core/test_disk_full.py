"""A full disk anywhere in a stage is one line naming where, exit status 2, not a traceback (issue 57)."""

from __future__ import annotations

import errno
import subprocess
import sys
import textwrap

import pytest

from tests.helpers.project import ROOT, env_with_venv


@pytest.mark.parametrize(
    "raise_it",
    [
        "raise OSError(errno.ENOSPC, 'No space left on device', 'data/shards/train-g0000-00ab.arrow')",
        # pyarrow's own: an OSError with no errno, the cause only in its words
        "raise OSError('Error writing bytes to file. Detail: [errno 28] No space left on device')",
    ],
)
def test_enospc_is_one_line(raise_it: str, tmp_path: object) -> None:
    script = textwrap.dedent(f"""
        import errno
        from tasks.core.cli import stage_main
        def body(params):
            {raise_it}
        stage_main("preprocess-tool", body)
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env_with_venv(), capture_output=True,
                          text=True)  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("[preprocess-tool] error: no space left on the device"), lines
    assert "Traceback" not in proc.stderr
    if "errno.ENOSPC" in raise_it:
        assert "writing data/shards/train-g0000-00ab.arrow" in lines[0]


def test_other_os_errors_are_not_taken_for_a_full_disk() -> None:
    from tasks.core.cli import is_disk_full

    assert is_disk_full(OSError(errno.ENOSPC, "No space left on device"))
    assert not is_disk_full(OSError(errno.EACCES, "Permission denied"))
