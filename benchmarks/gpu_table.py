"""The docs' GPU tables from what ``benchmarks/gpu_check.sh`` wrote: the capture of 1 GB (``capture_blocking.json``)
and the throughput rounds (``throughput.json``), as Markdown on stdout, with the device line (``device.txt``)::

    python3 benchmarks/gpu_table.py gpu-check/        # the directory gpu_check.sh wrote ($OUT)
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

#: Throughput variants in the order the table shows them, with their column names.
COLUMNS = [("elastic-runner-fsdp", "FSDP2, every feature on"), ("elastic-runner-fsdp-bare", "FSDP2, every feature off"),
           ("baseline-fsdp", "plain FSDP2 script"), ("elastic-runner", "DDP, every feature on"),
           ("baseline", "plain DDP script")]
#: Per-round ratios (throughput.py's pairs) and what each says.
RATIOS = [("fsdp_on_vs_off", "FSDP2 on / off (aim ≥ 0.97)"), ("fsdp_vs_plain_fsdp", "FSDP2 on / plain (aim ≥ 0.97)"),
          ("ddp_vs_plain_ddp", "DDP on / plain")]


def _median_range(values: list[float], digits: int = 3) -> str:
    return f"{statistics.median(values):.{digits}f} ({min(values):.{digits}f}–{max(values):.{digits}f})"


def capture_table(data: dict[str, Any]) -> list[str]:
    lines = [f"Capture of {data['state_bytes'] / 1e9:.2f} GB after {data['step_ms']:g} ms of queued device work, "
             f"{data['rounds']} rounds (median, range):", "",
             "| capture | host blocked (ms) | copy landed after the round began (ms) | first capture (ms) |",
             "|---|---|---|---|"]
    for mode, name in (("inline", "in the step"), ("side-stream", "side stream")):
        row = data[mode]
        low, high = row["blocked_ms_range"]
        lines.append(f"| {name} | {row['blocked_ms_median']:.2f} ({low:.2f}–{high:.2f}) | {row['landed_ms_median']:.1f} "
                     f"| {data['first_capture_ms'][mode]:.0f} |")
    return lines


def throughput_table(data: dict[str, Any]) -> list[str]:
    (name, workload), = data["workloads"].items()
    rates = workload["rates"]
    shown = [(key, title) for key, title in COLUMNS if rates.get(key)]
    rounds = max(len(rates[key]) for key, _ in shown)
    lines = [f"Throughput, {name}, {workload['unit'].replace('_', ' ')} after {workload['skip']} warm-up steps, "
             f"{rounds} interleaved round(s):", "",
             "| round | " + " | ".join(title for _, title in shown) + " |", "|---" * (len(shown) + 1) + "|"]
    for index in range(rounds):
        cells = [f"{rates[key][index]:,.0f}" if index < len(rates[key]) else "—" for key, _ in shown]
        lines.append(f"| {index + 1} | " + " | ".join(cells) + " |")
    ratios = workload["ratios"]
    found = [(key, title) for key, title in RATIOS if key in ratios]
    if found:
        lines += ["", "| per-round ratio | median (range) |", "|---|---|"]
        for key, title in found:
            low, high = ratios[f"{key}_range"]
            lines.append(f"| {title} | {ratios[key]:.3f} ({low:.3f}–{high:.3f}) |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("directory", type=Path)
    args = parser.parse_args()
    out: list[str] = []
    device = args.directory / "device.txt"
    if device.exists():
        out += [f"Device: {device.read_text().strip()}", ""]
    for name, render in (("capture_blocking.json", capture_table), ("throughput.json", throughput_table)):
        path = args.directory / name
        if path.exists():
            out += render(json.loads(path.read_text())) + [""]
    if not out:
        raise SystemExit(f"{args.directory} holds none of gpu_check.sh's results (capture_blocking.json, throughput.json)")
    print("\n".join(out).rstrip())


if __name__ == "__main__":
    main()
