"""CI: README.md's shell commands, each from a new shell, in the README's order.

README.md's first ```bash block is the set-up, ``python3 -m venv .venv && .venv/bin/pip install -e
'.[extras]'``, then ``&& . .venv/bin/activate && `` and the first run; every other block is one command line that starts with ``. .venv/bin/activate && ``
(or makes its own environment), so that it runs from a new shell in the repository's root. Each
block runs under ``env -i`` (HOME, the system PATH, LANG and the ``--env`` variables only) with
``bash -c`` and a deadline. Cheap where it can be:

- the set-up's install is skipped when ``--venv`` already satisfies every requirement of its extras
  (CI's ``.venv``, which .ci/run made from '.[test,mindspore]'): a second ``pip install -e`` would
  only rebuild the editable wheel to install nothing. Otherwise it runs, installing into ``.venv``;
  the first run follows either way;
- ``. .venv/bin/activate`` activates ``--venv`` (the same environment by default);
- skipped, with the reason printed: the test-suite block (.ci/run runs the whole suite itself) and
  the MindSpore-only block (.ci/mindspore_only runs the same step in a fresh environment without
  torch);
- ``msrun`` gets a free ``--master_port`` (the README's commands use msrun's default port, which
  another job on the machine may hold).

What the commands write in the root (tiny-qwen35, tiny-qwen35-trained, msrun_log, mindspore_log)
is removed afterwards, unless it was there before. Exit code 1 at the first block that fails (the tail of its output
printed), else 0; each block's last output line is printed as its confirmation.

    python .ci/readme_commands.py                        # CI, after .ci/run's pytest
    python .ci/readme_commands.py --venv /path/to/venv --env PYTHONPATH=$PWD   # another checkout
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SETUP = re.compile(
    r"^python3 -m venv \.venv && \.venv/bin/pip install -e '\.\[(?P<extras>[\w,]+)\]'"
    r" && \. \.venv/bin/activate && (?P<run>.+)$"
)
ACTIVATE = ". .venv/bin/activate && "
SKIPPED = {
    "python -m pytest": "the test suite: .ci/run runs the whole of it (--full)",
    ".venv-mindspore": "MindSpore alone: .ci/mindspore_only runs this step in a fresh environment without torch",
}
WRITTEN = ("tiny-qwen35", "tiny-qwen35-trained", "msrun_log", "mindspore_log")
CHECK = """
import sys
from importlib import metadata
from packaging.requirements import Requirement
extras = sys.argv[1].split(",")
for line in metadata.requires("hyperpar-gdn") or []:
    req = Requirement(line)
    if req.marker is None or not any(req.marker.evaluate({"extra": e}) for e in extras):
        continue
    try:
        installed = metadata.version(req.name)
    except metadata.PackageNotFoundError:
        sys.exit(f"{req.name} is not installed")
    if not req.specifier.contains(installed, prereleases=True):
        sys.exit(f"{req.name} {installed} does not satisfy {req}")
"""


def readme_blocks() -> list[str]:
    """The ```bash blocks of README.md, each as one line (continuations joined)."""
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", text, flags=re.S)
    return [re.sub(r"\\\n", "", block).strip() for block in blocks]


def satisfied(venv: Path, extras: str) -> str | None:
    """None when ``venv`` holds every requirement of ``extras``, else why not."""
    python = venv / "bin" / "python"
    if not python.exists():
        return f"no environment at {venv}"
    result = subprocess.run([str(python), "-c", CHECK, extras], capture_output=True, text=True, timeout=120)
    return None if result.returncode == 0 else (result.stderr.strip().splitlines() or ["?"])[-1]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def stop(process: subprocess.Popen) -> None:
    """End a block's processes: SIGINT first (msrun then stops the workers it started in their own
    sessions; torchrun its workers), SIGKILL to what is left of the group after 20 s."""
    for signum, grace in ((signal.SIGINT, 20.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(process.pid, signum)
        except ProcessLookupError:
            return
        try:
            process.communicate(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            continue


def run(block: str, venv: Path, env: dict[str, str], timeout: float) -> bool:
    """Run one block from a new shell; print what ran and its last line; True if it exited 0."""
    match = SETUP.match(block)
    command = block
    if match:
        why_not = satisfied(venv, match["extras"])
        run_first = f". {venv}/bin/activate && {match['run']}"
        if why_not is None:
            print(f"== {block}\n   (install skipped: '.[{match['extras']}]' already satisfied by {venv})")
            command = run_first
        else:
            print(f"== {block}\n   (installing: {why_not})")
            command = (
                f"python3 -m venv {venv} && {venv}/bin/pip install -e '.[{match['extras']}]' && {run_first}"
            )
    elif block.startswith(ACTIVATE):
        command = f". {venv}/bin/activate && {block[len(ACTIVATE) :]}"
        print(f"== {block}")
    else:
        print(f"== {block}")
    command = command.replace("msrun ", f"msrun --master_port={free_port()} ")
    start = time.perf_counter()
    process = subprocess.Popen(
        ["bash", "-c", command], cwd=ROOT, env=env, text=True, start_new_session=True,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        stop(process)
        print(f"   FAILED: no end within {timeout:.0f} s")
        return False
    seconds = time.perf_counter() - start
    lines = output.strip().splitlines()
    if process.returncode != 0:
        print(f"   FAILED (exit code {process.returncode}, {seconds:.0f} s); its last lines:")
        print("\n".join(f"   | {line}" for line in lines[-30:]))
        return False
    print(f"   ok ({seconds:.0f} s): {lines[-1] if lines else '(no output)'}")
    return True


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--venv", type=Path, default=ROOT / ".venv", help="the environment that stands for .venv"
    )
    parser.add_argument(
        "--env", action="append", default=[], help="NAME=VALUE for every command (repeatable)"
    )
    parser.add_argument("--timeout-s", type=float, default=600.0, help="deadline of each command")
    parser.add_argument(
        "--only", action="append", default=[], help="run only the blocks that contain this text (repeatable)"
    )
    args = parser.parse_args()
    env = {
        "HOME": os.environ.get("HOME", str(ROOT)),
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "LANG": os.environ.get("LANG", "C.UTF-8"),
    }
    env.update(item.split("=", 1) for item in args.env)
    ours = [ROOT / name for name in WRITTEN if not (ROOT / name).exists()]
    ok = True
    try:
        for block in readme_blocks():
            if args.only and not any(text in block for text in args.only):
                continue
            reason = next((why for key, why in SKIPPED.items() if key in block), None)
            if reason is not None:
                print(f"== {block}\n   skipped: {reason}")
                continue
            if not run(block, args.venv.resolve(), env, args.timeout_s):
                ok = False
                break
    finally:
        for path in ours:
            shutil.rmtree(path, ignore_errors=True)
    print(f"readme_commands: {'ok' if ok else 'FAILED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
