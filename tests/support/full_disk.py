"""A really full disk for a test: a small tmpfs mounted in a private mount namespace
(`unshare --mount`), so nothing is left mounted on the machine when the command ends. Needs
root or CAP_SYS_ADMIN (CI runs as root); ``available()`` says whether this machine allows it."""

from __future__ import annotations

import functools
import shlex
import shutil
import subprocess
from pathlib import Path


@functools.cache
def available() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                            "mount -t tmpfs -o size=64k tmpfs /mnt 2>/dev/null || "
                            "mount -t tmpfs -o size=64k tmpfs /tmp"],
                           capture_output=True, timeout=30)
    return probe.returncode == 0


def run_on_full_disk(mountpoint: Path, size_kib: int, cmd: list[str], *, after: str = "",
                     timeout: float = 600, readonly: bool = False
                     ) -> subprocess.CompletedProcess:
    """Run ``cmd`` with a ``size_kib`` tmpfs at ``mountpoint`` (read-only with ``readonly``);
    ``after`` (a shell line) runs in the same namespace once it ends (e.g. copy the files out to
    look at them)."""
    mountpoint.mkdir(parents=True, exist_ok=True)
    opts = f"size={size_kib}k" + (",ro" if readonly else "")
    script = (f"mount -t tmpfs -o {opts} tmpfs {shlex.quote(str(mountpoint))} || "
              "exit 97; " + shlex.join(cmd) + "; rc=$?; " + (after or "true") + "; exit $rc")
    return subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
                          capture_output=True, text=True, timeout=timeout)
