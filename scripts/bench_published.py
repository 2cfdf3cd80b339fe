"""The cost model against published device runs: each published figure beside the prediction.

No timing here: :mod:`benchkit.published` prices every point that a public report measured (fla's
CP on H800 GPUs, an Ascend GDN layer at CP8, a serving report's prefill with a state relay) with
the cost model and the report's own device figures, and this script prints the table, the
ratios, the weak-scaling growth and what ``auto`` would choose, and writes them as JSON::

    PYTHONPATH=. python scripts/bench_published.py --out bench_published
"""

from __future__ import annotations

import argparse
from pathlib import Path

from benchkit.output import write_json
from benchkit.published import SETUPS, auto_rows, growth_rows, prediction_rows
from hyperpar_gdn.cli import HelpFormatter


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=HelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("bench_published"), help="folder for published.json")
    args = parser.parse_args()
    setups = [
        {"name": s.name, "source": s.source, "heads": s.heads, "notes": list(s.notes)}
        | {"flops": s.calibrated().flops, "saturating_heads": s.machine.saturating_heads}
        | {"intra": vars(s.machine.intra), "hidden": s.hidden, "matmul_flops": s.matmul_flops}
        for s in SETUPS
    ]
    result = {"setups": setups, "points": prediction_rows(), "growth": growth_rows(), "auto": auto_rows()}
    write_json(args.out / "published.json", result)
    print(
        f"{'setup':<28} {'mode':<11} {'cp':>3} {'T':>7} {'published ms':>12} {'predicted ms':>12} {'ratio':>6}"
    )
    for r in result["points"]:
        print(
            f"{r['setup']:<28} {r['mode']:<11} {r['cp']:>3} {r['seq_len']:>7} {r['published_ms']:>12.1f} "
            f"{r['predicted_ms']:>12.1f} {r['ratio']:>6.2f}"
        )
    for r in result["growth"]:
        print(
            f"{r['setup']} {r['mode']} at {r['tokens_per_rank']} tokens per rank, cp 4 -> 8: published "
            f"{r['published_growth']:+.1%}, predicted {r['predicted_growth']:+.1%} (ratio {r['ratio']:.2f})"
        )
    for r in result["auto"]:
        print(
            f"{r['setup']} cp={r['cp']} T={r['seq_len']}: auto picks {r['auto']} (among the published modes "
            f"{r['auto_among_published']}); fastest published {r['fastest_published']}"
        )
    print(f"wrote {args.out / 'published.json'}")


if __name__ == "__main__":
    main()
