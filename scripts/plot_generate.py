"""Draw the JSON of one or more scripts/generate.py runs as one PNG.

    torchrun --nproc-per-node 2 scripts/generate.py --model M --prompt-file P --min-prompt-tokens 16384 \\
        --repeats 3 --compare-one-device --out results/gen-p2p.json
    torchrun --nproc-per-node 2 scripts/generate.py --model M --prompt-file P --min-prompt-tokens 65536 \\
        --decode-on cp-group --out results/gen-kv.json
    python scripts/plot_generate.py results/gen-p2p.json results/gen-kv.json --out results/generate.png

Three panels, one group of bars per run (named by mode, layout and T): the median prefill seconds
of the CP group (cp=N), of the same prefill on one rank (cp=1) and of the framework's own
one-device prefill (transformers'; the last two from ``--compare-one-device``, timed in the same
rounds); the attention K/V cache bytes of one device (the prompt's) and of each rank (the prompt's
and the decoded tokens', from ``--decode-on cp-group``); the decoding milliseconds per token.
"""

from __future__ import annotations

import json
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchkit.output import Panel, save_png

# The keys every generate.py result holds (a file without them is not one).
REQUIRED = ("framework", "mode", "layout", "cp", "prompt_tokens", "prefill_s", "decode_on")


def load_result(path: Path) -> dict[str, Any]:
    """One generate.py ``--out`` file (a ValueError naming the file when it is not one)."""
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file (expected a JSON file of generate.py --out)")
    try:
        result = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not JSON ({err})") from None
    missing = [key for key in REQUIRED if not isinstance(result, dict) or key not in result]
    if missing:
        raise ValueError(f"{path} is not a generate.py result: it lacks {', '.join(missing)}")
    return result


def run_label(result: dict[str, Any]) -> str:
    framework = "" if result["framework"] == "torch" else f"{result['framework']} "
    return f"{framework}{result['mode']} {result['layout']} T={result['prompt_tokens']}"


def panels(results: Sequence[dict[str, Any]]) -> list[Panel]:
    """The prefill seconds, the K/V bytes per rank and the decoding time of ``results``."""
    prefill: dict[str, tuple[float, str]] = {}
    kv: dict[str, tuple[float, str]] = {}
    decoding: dict[str, tuple[float, str]] = {}
    seen: set[str] = set()
    for i, result in enumerate(results):
        run = run_label(result)
        run = run if run not in seen else f"{run} ({i + 1})"  # two runs of the same prompt
        seen.add(run)
        own = "transformers" if result["framework"] == "torch" else "one device"
        paths = {
            f"cp={result['cp']}": result["prefill_s"],
            "cp=1": result.get("cp1_prefill_s"),
            own: result.get("one_device_prefill_s"),
        }
        for (path, seconds), colour in zip(paths.items(), ("C0", "C1", "C2"), strict=True):
            if seconds:
                prefill[f"{run}\n{path}"] = (statistics.median(seconds), colour)
        per_rank = result.get("kv_cache_bytes_per_rank")
        if per_rank:
            kv[f"{run}\none device"] = (result["kv_cache_bytes_one_device"] / 2**20, "C2")
            for rank, size in enumerate(per_rank):
                kv[f"{run}\nrank {rank}"] = (size / 2**20, "C0")
        if result.get("decode_s_per_token"):
            colour = "C0" if result["decode_on"] == "cp-group" else "C2"
            decoding[f"{run}\n{result['decode_on']}"] = (result["decode_s_per_token"] * 1e3, colour)
    return [
        Panel("prefill (median of the rounds)", "run / path", "seconds", bars=prefill),
        Panel("attention K/V cache (--decode-on cp-group)", "run / holder", "MiB", bars=kv),
        Panel("decoding", "run / where", "ms per token", bars=decoding),
    ]


def main(argv: Sequence[str] | None = None) -> int:
    """Exit code: 0, or 2 after a user error (one line naming the file or option)."""
    from hyperpar_gdn.cli import Parser

    parser = Parser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", type=Path, nargs="+", help="JSON files written by generate.py --out")
    parser.add_argument("--out", type=Path, default=Path("generate.png"), help="the PNG to write")
    try:  # the command line's UsageError is a ValueError too
        args = parser.parse_args(argv)
        results = [load_result(path) for path in args.results]
    except (ValueError, FileNotFoundError) as err:
        print(f"plot_generate.py: error: {err}", file=sys.stderr)
        return 2
    save_png(args.out, panels(results), width=6, dpi=120)
    print(f"wrote {args.out} ({len(results)} runs)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
