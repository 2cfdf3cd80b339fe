"""What every script under ``scripts/`` shows a user at the command line, in one place.

- :func:`run_script`: runs a script's body; a user error (a bad option, a missing file, a
  platform this machine does not have) becomes one line on rank 0, ``<script>: error: ...``, and
  exit code 2; SIGTERM or Ctrl-C becomes one line on rank 0, ``<script>: stopped by SIGTERM ...``
  (with what the script says about where it stopped), and exit code 128 + the signal's number.
  No traceback on any rank for either.
- :func:`route_framework_logs`: MindSpore's own log lines go to its log files, not the console
  (``GLOG_v`` or ``GLOG_logtostderr=1`` brings them back).
- :class:`Parser`: an ``ArgumentParser`` whose errors raise :class:`UsageError` (reported once,
  by rank 0, through :func:`run_script`) instead of printing the usage on every rank, and whose
  ``--help`` shows each option's default.
- :func:`option` and :func:`add_options`: a dataclass whose fields are a script's options (name,
  type, default and help in one place) and the parser derived from it.

Under ``torchrun`` the shell sees torchrun's own code, 1, whenever a worker exits non-zero; the
one line comes first, and torchrun's failure summary that follows repeats it as its root cause.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import sys
import time
import types
import typing
from collections.abc import Callable, Sequence
from typing import Any, NoReturn


class UsageError(ValueError):
    """A command-line error (unknown option, bad value, options that do not go together)."""


class Stopped(BaseException):  # noqa: N818 (a request, not a failure)
    """Raised in the main thread when the process gets SIGTERM (Ctrl-C raises KeyboardInterrupt).
    A ``BaseException``, as ``KeyboardInterrupt``: ``except Exception`` blocks (a checkpoint
    save's error report, say) let it through."""

    def __init__(self, signum: int) -> None:
        # args holds the number, not the name: a copy or unpickling (a checkpoint thread's error
        # carried to the main thread) rebuilds the exception as ``Stopped(*args)``.
        super().__init__(int(signum))
        self.signum = int(signum)

    def __str__(self) -> str:
        return signal.Signals(self.signum).name


# A launcher that reports a rank's error line itself (``hyperpar-train``) names a file here: rank 0
# writes its line there instead of to the console.
ERROR_LINE_FILE = "HP_ERROR_LINE_FILE"
USER_ERROR_GRACE_S = 10.0  # how long ranks other than 0 wait after a user error (see run_script)


def _launched_ranks() -> int:
    """The world size the launcher set (torchrun ``WORLD_SIZE``, msrun ``MS_WORKER_NUM``), else 1."""
    value = os.environ.get("WORLD_SIZE", os.environ.get("MS_WORKER_NUM", "1"))
    return int(value) if value.strip().isdigit() else 1


def ranks(count: int) -> str:
    """``"1 rank"``, ``"2 ranks"``: a count of ranks in a message."""
    return f"{count} rank{'' if count == 1 else 's'}"


def print_line(text: str) -> None:
    """``text`` and its newline to stderr in one write: lines that several ranks print into one
    pipe at once stay whole (``print`` writes the text and the newline separately)."""
    sys.stderr.flush()
    try:
        fd = sys.stderr.fileno()
    except (AttributeError, OSError):  # a stream without a descriptor (a test's capture): one write call
        sys.stderr.write(f"{text}\n")
        sys.stderr.flush()
        return
    os.write(fd, f"{text}\n".encode(errors="backslashreplace"))


def launch_rank() -> int:
    """This process's global rank as the launcher set it (torchrun ``RANK``, msrun ``RANK_ID``)."""
    value = os.environ.get("RANK", os.environ.get("RANK_ID", "0"))
    return int(value) if value.strip().isdigit() else 0


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each option's default, unless its help already says it (``default`` in the text,
    a flag that is off unless given, or a None that the help explains)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        help_text = action.help or ""
        if "default" in help_text or action.default is None or action.default is False:
            return help_text
        return super()._get_help_string(action) or help_text


class Parser(argparse.ArgumentParser):
    """``argparse`` with :class:`HelpFormatter`, raising :class:`UsageError` on a bad command line."""

    def __init__(self, **kwargs: object) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(**kwargs)  # type: ignore[arg-type]

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (see --help)")


def option(default: Any, *, help: str, choices: Sequence[str] | None = None, flag: str | None = None) -> Any:
    """A dataclass field that is also a command-line option of :func:`add_options`.

    Args:
        default: the field's default, shown by ``--help`` unless ``help`` says it.
        help: the option's ``--help`` text.
        choices: the values the option accepts (the dataclass still checks them itself).
        flag: the option's name when it is not the field's (``--model`` for ``model_dir``).
    """
    metadata = {"help": help, "choices": tuple(choices) if choices is not None else None, "flag": flag}
    return dataclasses.field(default=default, metadata=metadata)


def _value_type(annotation: Any) -> type:
    """``int`` for ``int`` and ``int | None``: the type a command-line value converts to."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        kinds = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(kinds) != 1:
            raise TypeError(f"an option's type is one type or it and None; got {annotation}")
        annotation = kinds[0]
    if annotation not in (bool, int, float, str):
        raise TypeError(f"an option's type is bool, int, float or str; got {annotation}")
    return annotation


def add_options(parser: argparse.ArgumentParser, options: type) -> None:
    """One command-line option per field of the dataclass ``options`` made by :func:`option`, in
    the fields' order: ``--<field name with dashes>`` (or the field's ``flag``), whose value has the
    field's type (``X | None``: X) and default; a bool field is a switch: ``--<name>`` when it
    defaults to False, ``--no-<name>`` when it defaults to True. ``options(**vars(namespace))``
    then builds the dataclass from the parsed command line."""
    hints = typing.get_type_hints(options)
    for field in dataclasses.fields(options):
        if "help" not in field.metadata:
            continue
        meta = field.metadata
        kind = _value_type(hints[field.name])
        name = field.name.replace("_", "-")
        if kind is bool:
            flag = meta["flag"] or (f"--no-{name}" if field.default else f"--{name}")
            action = "store_false" if field.default else "store_true"
            parser.add_argument(flag, dest=field.name, action=action, help=meta["help"])
            continue
        parser.add_argument(
            meta["flag"] or f"--{name}",
            dest=field.name,
            type=kind,
            choices=meta["choices"],
            default=field.default,
            help=meta["help"],
        )


def route_framework_logs() -> str | None:
    """Under ``HP_PLATFORM=mindspore``, send MindSpore's own log lines (its INFO, WARNING and
    ERROR lines, Python's and C++'s) to files in a log directory instead of the console, unless
    the user set ``GLOG_v``, ``GLOG_logtostderr`` or ``GLOG_log_dir``.

    The directory is the one of this worker's stdout file (msrun's ``--log_dir``), else
    ``./mindspore_log``: MindSpore writes ``rank_<R>/logs/`` there, and whatever its C++ code
    prints to the process's stderr goes to ``rank_<R>/stderr.log`` (file descriptor 2 is
    redirected; Python's ``sys.stderr`` keeps the console, so this project's lines and tracebacks
    stay visible). Must run before MindSpore is imported. Returns the directory, or None.
    """
    if os.environ.get("HP_PLATFORM", "").strip().lower() != "mindspore":
        return None
    if any(name in os.environ for name in ("GLOG_v", "GLOG_logtostderr", "GLOG_log_dir")):
        return None
    directory = "mindspore_log"
    try:
        stdout = os.readlink("/proc/self/fd/1")
        if stdout.endswith(".log"):
            directory = os.path.dirname(stdout) or "."
    except OSError:
        pass  # not Linux, or no stdout file: the default directory
    directory = os.path.abspath(directory)
    os.environ["GLOG_logtostderr"] = "0"
    os.environ["GLOG_log_dir"] = directory
    os.environ.setdefault("GLOG_stderrthreshold", "3")  # its Python logger: ERROR still on the console
    rank_dir = os.path.join(directory, f"rank_{launch_rank()}")
    os.makedirs(rank_dir, exist_ok=True)
    sys.stderr.flush()
    console = os.dup(2)
    with open(os.path.join(rank_dir, "stderr.log"), "ab") as log:
        os.dup2(log.fileno(), 2)
    sys.stderr = os.fdopen(console, "w", buffering=1)
    return directory


def _raise_stopped(signum: int, frame: object) -> None:
    raise Stopped(signum)


def _write_torchelastic_error(message: str) -> None:
    """Give torchrun's failure summary our line as the worker's error (it otherwise says "To enable
    traceback see ..."): torchrun reads the JSON file it names in ``TORCHELASTIC_ERROR_FILE``."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    info = {"py_callstack": message, "timestamp": str(int(time.time()))}
    record = {"message": {"message": message, "extraInfo": info}}
    try:
        with open(path, "w") as file:
            json.dump(record, file)
    except OSError:
        pass  # the summary then shows torchrun's generic text; the line was printed already


def _hand_to_launcher(message: str) -> bool:
    """Write ``message`` to the launcher's :data:`ERROR_LINE_FILE`; False when there is none."""
    path = os.environ.get(ERROR_LINE_FILE)
    if not path:
        return False
    try:
        with open(path, "w") as file:
            file.write(message + "\n")
    except OSError:
        return False
    return True


def run_script(
    name: str,
    body: Callable[[], int],
    *,
    user_errors: tuple[type[BaseException], ...],
    where: Callable[[], str] | None = None,
) -> int:
    """``body()``'s exit code, or 2 after a user error, or 128 + N after signal N.

    Args:
        name: the script's file name, the prefix of its lines (``"generate.py"``).
        body: the script's work; it returns the exit code.
        user_errors: the exception types a user can fix; any other exception keeps its traceback.
        where: after SIGTERM or Ctrl-C, what to add to the stop line (the step reached, the last
            checkpoint); it must not communicate (the other ranks are stopping too).
    """
    route_framework_logs()
    previous = signal.signal(signal.SIGTERM, _raise_stopped)
    rank = launch_rank()
    try:
        return body()
    except (UsageError, *user_errors) as err:
        message = f"{name}: error: {err}"
        if rank == 0:
            _write_torchelastic_error(message)
            if not _hand_to_launcher(message):
                print_line(message)
        elif _launched_ranks() > 1:
            # The launcher stops every worker once one exits: give rank 0 (which hits the same
            # check, maybe later under load) time to print the line. Its exit ends this wait.
            try:
                time.sleep(USER_ERROR_GRACE_S)
            except (Stopped, KeyboardInterrupt):
                pass  # the launcher ends this rank: expected, nothing to say
        return 2
    except (KeyboardInterrupt, Stopped) as stop:
        signum = stop.signum if isinstance(stop, Stopped) else signal.SIGINT
        if rank == 0:
            detail = where() if where is not None else ""
            print_line(f"{name}: stopped by {signal.Signals(signum).name}{detail}")
        return 128 + signum
    finally:
        signal.signal(signal.SIGTERM, previous)
