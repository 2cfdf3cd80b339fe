"""A model directory written whole or not at all (no framework here).

:func:`written_whole` hands out a temporary directory beside the target; when the block ends
without an error it is renamed to the target (an existing target is moved aside first and removed
after), and on an error it is removed, leaving the target as it was. A reader never sees a
directory with some of its files.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = ["written_whole"]


@contextmanager
def written_whole(out: str | Path) -> Iterator[Path]:
    """Yield a temporary directory that becomes ``out`` when the block succeeds.

    Example::

        with written_whole("out") as temp:
            (temp / "config.json").write_text("{}")
    """
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    temp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    try:
        yield temp
        if out.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".old", dir=out.parent))
            os.replace(out, old / out.name)
            os.replace(temp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(temp, out)
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise
