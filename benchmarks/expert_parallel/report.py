"""The README's tables of ``run_gpus.sh`` calls, from the files they wrote (nothing typed by hand).

    python3 benchmarks/expert_parallel/report.py OUT            # print the Markdown
    python3 benchmarks/expert_parallel/report.py OUT --write    # keep the raw files, update README
    python3 benchmarks/expert_parallel/report.py TESTS BENCH1 BENCH2 --write   # several calls

``OUT`` is a call's ``$OUT`` folder (``versions.txt``, ``gpu_tests.{txt,json}``,
``layout_tests.{txt,json}``, ``expert_parallel_<G>gpu*.json``). Several folders (one machine
size, e.g. a call of ``PHASES=tests`` and calls of ``PHASES=bench`` with one preset each) make one
block: their benchmark rows are joined, each call's scaling computed within that call only.
``--write`` copies the files to ``results/<G>gpu/`` beside this script with ``REPORT.md`` (every
test's outcome, the tests' gaps, the whole throughput table) and replaces the README's block
between ``<!-- report:<G>gpu -->`` and ``<!-- /report:<G>gpu -->`` (added before "## Not run"
when missing) with a summary: the outcomes and the scaling table, one row per preset and router.
A README number always has its raw file next to it.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
README = HERE / "README.md"


def _json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def _pct(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{100 * value:.{digits}f}%"


def _sci(value: float | None) -> str:
    return "-" if value is None else f"{value:.1e}"


def _outcomes(path: Path | None) -> str:
    """pytest's closing summary line ("5 passed, 1 skipped in 212.3s"), or why there is none."""
    if path is None or not path.is_file():
        return "not run"
    lines = [line.strip("= ") for line in path.read_text(errors="replace").splitlines()]
    summary = [line for line in lines if re.search(r"\d+ (passed|failed|error|skipped)", line)]
    return summary[-1] if summary else "no summary line (stopped by its time limit?)"


def _test_rows(path: Path) -> list[str]:
    """Each test's PASSED / FAILED / SKIPPED / XFAIL line of ``pytest -rA``."""
    if not path.is_file():
        return []
    pattern = re.compile(r"^(PASSED|FAILED|SKIPPED|XFAIL|XPASS|ERROR) (.+)$")
    rows = []
    for line in path.read_text(errors="replace").splitlines():
        match = pattern.match(line)
        if not match:
            continue
        outcome, rest = match.group(1).lower(), match.group(2)
        if rest.startswith("["):  # SKIPPED [n] file:line: reason
            rows.append(f"{outcome}: {rest.split(': ', 1)[-1]}")
        else:
            test, _, reason = rest.partition(" - ")
            rows.append(f"{test.split('::')[-1]}: {outcome}" + (f" ({reason})" if reason else ""))
    return rows


def _step(value: int | None) -> str:
    return "none" if value is None else f"step {value}"


def _control(row: dict[str, Any]) -> str:
    if not row:
        return "-"
    return (
        f"{_pct(row.get('max_rel'))}, {_pct(row.get('mean_rel'), 3)}, "
        f"{_step(row.get('first_differing_step'))}"
    )


def expert_parallel_table(tests: dict[str, Any]) -> list[str]:
    rows = tests.get("expert_parallel_vs_one_gpu", {})
    if not rows:
        return []
    gpus = tests.get("gpus", "?")
    out = [
        f"Expert parallelism on {gpus} GPUs against one GPU (100 steps), and the two controls "
        f"against the same one-GPU run: plain DDP on {gpus} GPUs, and one GPU with the start "
        "changed by 1e-7 (max gap, mean gap, first routing difference):",
        "",
        "| router | step 1: loss gap, routing differing | first routing difference "
        "(flips, largest margin) | steps 1-10 max | max (step) | mean | last 20 steps' mean "
        "| control: DDP | control: perturbed |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for router, row in rows.items():
        routing = row.get("routing", {})
        step1 = routing.get("step1", {})
        first = routing.get("at_first_difference") or {}
        out.append(
            f"| {router} | {_sci(row.get('step1_rel'))}, {step1.get('differing')} of "
            f"{step1.get('tokens')} | {_step(routing.get('first_differing_step'))} "
            f"({first.get('choice_flips', '-')}, {_sci(first.get('max_margin_flipped'))}) | "
            f"{_sci(row.get('first10_max_rel'))} | {_pct(row.get('max_rel'))} "
            f"({row.get('max_rel_step')}) | {_pct(row.get('mean_rel'), 3)} | "
            f"{_pct(row.get('last20_mean_rel'), 3)} | {_control(row.get('control_ddp', {}))} | "
            f"{_control(row.get('control_perturbed_one_gpu', {}))} |"
        )
    resume = tests.get("resume_after_kill")
    zero = tests.get("deepspeed_vs_ddp", {})
    if resume or zero:
        out += ["", "| comparison | step 1 | max (step) | mean |", "|---|---|---|---|"]
    if resume:
        out.append(
            f"| resumed after SIGKILL at checkpoint-50 vs uninterrupted (steps 51-55: "
            f"{_sci(resume.get('first_steps_after_resume_max_rel'))}) | "
            f"{_sci(resume.get('step1_rel'))} | {_pct(resume.get('max_rel'))} "
            f"({resume.get('max_rel_step')}) | {_pct(resume.get('mean_rel'), 3)} |"
        )
    for stage, row in zero.items():
        out.append(
            f"| DeepSpeed {stage} vs DDP, 30 steps | {_sci(row.get('step1_rel'))} | "
            f"{_pct(row.get('max_rel'))} ({row.get('max_rel_step')}) | "
            f"{_pct(row.get('mean_rel'), 3)} |"
        )
    return out


def _layout_row(label: str, row: dict[str, Any], checkpoints: str = "-") -> str:
    window = row.get("steps") or ["?", "?"]
    return (
        f"| {label} | {window[0]}-{window[1]} | {_sci(row.get('step1_rel'))} | "
        f"{_sci(row.get('window_max_rel'))} | {_sci(row.get('max_rel'))} "
        f"({row.get('max_rel_step', '-')}) | {_sci(row.get('mean_rel'))} | {checkpoints} |"
    )


def layout_table(layouts: dict[str, Any]) -> list[str]:
    """The layout tests' gaps: each run against the run it must equal (the test's module
    docstring: tight over a window from where they part, the mean over all steps)."""
    if not layouts:
        return []
    w = layouts.get("processes", "?")
    half = w // 2 if isinstance(w, int) else "?"
    out = [
        f"Launch and process layouts on {w} GPUs ({layouts.get('steps')} steps, maxscore): "
        "loss gaps over the compared steps, the window's largest (held tight), the largest and "
        "the mean over all (chaos past the window):",
        "",
        "| comparison | steps | step 1 | window max | max (step) | mean | checkpoints: largest "
        "difference |",
        "|---|---|---|---|---|---|---|",
    ]
    row = layouts.get("dp_ep_fsdp_vs_one")
    if row:
        ep = layouts.get("expert_parallel_a", half)
        dp = w // ep if isinstance(w, int) and isinstance(ep, int) and ep else "?"
        out.append(_layout_row(f"dp {dp} x ep {ep} + FSDP2 vs 1 GPU", row))
    row = layouts.get("two_agents_vs_one_launch")
    if row:
        diffs = row.get("checkpoint_max_abs_diff") or {}
        checkpoints = ", ".join(f"{name}: {_sci(value)}" for name, value in diffs.items()) or "-"
        out.append(_layout_row("two torchrun agents (--nnodes 2) vs one launch", row, checkpoints))
    row = layouts.get("resume_one_launch_to_two_agents")
    if row:
        checkpoints = _sci(row.get("checkpoint_max_abs_diff"))
        label = "one launch's checkpoint resumed by two agents (c10d) vs uninterrupted"
        out.append(_layout_row(label, row, checkpoints))
    chain = layouts.get("reshard_chain", {})
    for key, label in (
        ("w_to_half", f"checkpoint resharded {w} -> {half} vs the {w}-GPU run"),
        ("half_to_one", f"then {half} -> 1 vs the {half}-GPU run"),
    ):
        if chain.get(key):
            out.append(_layout_row(label, chain[key]))
    to_one = chain.get("c_vs_one_process")
    if to_one:
        out += [
            "",
            f"The chain's last run against the one-GPU run over all steps: largest gap "
            f"{_sci(to_one.get('max_rel'))}, mean {_sci(to_one.get('mean_rel'))}; final weights "
            f"{_sci(chain.get('final_weights_max_rel_norm'))} of a tensor's norm from the "
            f"one-GPU run's (the uninterrupted {w}-GPU run: "
            f"{_sci(chain.get('uninterrupted_max_rel_norm'))}).",
        ]
    return out


def _setting(bench: dict[str, Any], runs: list[dict[str, Any]]) -> str:
    """The benchmark's setting, from its first call's meta and its first run."""
    meta = next(iter(bench.get("meta", {}).values()), {})
    return (
        f"compiled, bf16, micro-batch {runs[0].get('micro_batch_per_gpu')} x "
        f"{meta.get('seq_len')} per GPU, steps {meta.get('warmup_steps_excluded', 0) + 1}-"
        f"{meta.get('steps')} timed"
    )


def throughput_table(bench: dict[str, Any]) -> list[str]:
    scaling = bench.get("scaling", [])
    runs = [r for r in bench.get("runs", []) if "error" not in r]
    if not runs:
        return _failed_and_skipped(bench)
    out = [
        f"Throughput ({_setting(bench, runs)}):",
        "",
        "| preset | router | GPUs | tokens/s | 1-GPU tokens/s | speedup | efficiency | "
        "vs gshard | MFU |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    one = [r for r in runs if r["gpus"] == 1]
    for r in sorted(one, key=lambda r: (r["preset"], r["router"])):
        gshard = next(
            (g for g in one if g["preset"] == r["preset"] and g["router"] == "gshard"), None
        )
        ratio = r["tokens_per_s"] / gshard["tokens_per_s"] if gshard else None
        out.append(
            f"| {r['preset']} | {r['router']} | 1 | {r['tokens_per_s']:,.0f} | - | - | - | "
            f"{'-' if ratio is None else f'{ratio:.3f}'} | {_pct(r.get('mfu'), 1)} |"
        )
    for s in sorted(scaling, key=lambda s: (s["preset"], s["gpus"], s["router"])):

        def fmt(value: float | None, spec: str) -> str:
            return "-" if value is None else format(value, spec)

        out.append(
            f"| {s['preset']} | {s['router']} | {s['gpus']} | {s['tokens_per_s']:,.0f} | "
            f"{fmt(s['one_gpu_tokens_per_s'], ',.0f')} | {fmt(s['speedup'], '.2f')} | "
            f"{_pct(s['scaling_efficiency'], 1)} | {fmt(s['vs_gshard_same_gpus'], '.3f')} | "
            f"{_pct(s['mfu'], 1)} |"
        )
    return out + _failed_and_skipped(bench)


def scaling_summary(bench: dict[str, Any]) -> list[str]:
    """The README's table: per preset and router, tokens/s on one GPU, and on each larger count
    tokens/s with its scaling efficiency and its ratio to gshard on as many GPUs (all within
    one call: ``bench.py summarize``); then the failed runs and the runs without time left."""
    runs = [r for r in bench.get("runs", []) if "error" not in r]
    if not runs:
        return _failed_and_skipped(bench)
    counts = sorted({r["gpus"] for r in runs})
    ones = {(r["preset"], r["router"]): r["tokens_per_s"] for r in runs if r["gpus"] == 1}
    larger = {(s["preset"], s["router"], s["gpus"]): s for s in bench.get("scaling", [])}
    out = [
        f"Tokens/s ({_setting(bench, runs)}; in brackets: scaling efficiency against that many "
        "times one GPU, and maxscore / gshard on as many GPUs):",
        "",
        "| preset | router | " + " | ".join(f"{c} GPU{'s' * (c > 1)}" for c in counts) + " |",
        "|---|---|" + "---|" * len(counts),
    ]
    for preset, router in sorted({(r["preset"], r["router"]) for r in runs}):
        cells = []
        for count in counts:
            if count == 1:
                tps, gshard = ones.get((preset, router)), ones.get((preset, "gshard"))
                ratio = f" ({tps / gshard:.3f})" if tps and gshard and router != "gshard" else ""
                cells.append("-" if tps is None else f"{tps:,.0f}{ratio}")
                continue
            row = larger.get((preset, router, count))
            if row is None:
                cells.append("-")
                continue
            versus = row.get("vs_gshard_same_gpus")
            brackets = [_pct(row.get("scaling_efficiency"), 1)]
            if router != "gshard" and versus is not None:
                brackets.append(f"{versus:.3f}")
            cells.append(f"{row['tokens_per_s']:,.0f} ({', '.join(brackets)})")
        out.append(f"| {preset} | {router} | " + " | ".join(cells) + " |")
    return out + _failed_and_skipped(bench)


def _failed_and_skipped(bench: dict[str, Any]) -> list[str]:
    out = []
    for r in bench.get("runs", []):
        if "error" in r:
            out += [
                "",
                f"{r['preset']} / {r['router']} on {r.get('gpus', '?')} GPUs failed: {r['error']}",
            ]
    if bench.get("skipped"):
        out += ["", "Not run (no time left in the call): " + "; ".join(bench["skipped"]) + "."]
    return out


def _check_call_folder(folder: Path) -> None:
    if not (folder / "versions.txt").is_file():
        raise SystemExit(f"{folder} has no versions.txt: not the $OUT folder of a run_gpus.sh call")


def _tests_folder(folders: list[Path], stem: str) -> Path | None:
    """The one folder with ``<stem>.txt`` or ``<stem>.json`` (a test session's output and
    report), or None."""
    found = [f for f in folders if any((f / f"{stem}{x}").is_file() for x in (".txt", ".json"))]
    if len(found) > 1:
        raise SystemExit(
            f"{stem} output is in {len(found)} of the folders ({', '.join(map(str, found))}): give "
            "the call whose tests should be reported, and the others' benchmark folders"
        )
    return found[0] if found else None


def merged_benchmark(folders: list[Path]) -> dict[str, Any]:
    """Every call's ``bench.py summarize`` file joined: runs, scaling (each computed within its
    own call, so no ratio compares two machines) and skipped runs."""
    merged: dict[str, Any] = {"meta": {}, "scaling": [], "runs": [], "skipped": []}
    for folder in folders:
        for path in sorted(folder.glob("expert_parallel_*gpu*.json")):
            data = _json(path)
            prefix = f"{folder.name}/" if len(folders) > 1 else ""
            for tag, meta in data.get("meta", {}).items():
                merged["meta"][prefix + tag] = meta
            for key in ("scaling", "runs", "skipped"):
                merged[key] += data.get(key, [])
    seen: set[tuple[Any, ...]] = set()
    for run in merged["runs"]:
        key = (run.get("preset"), run.get("router"), run.get("gpus"))
        if key in seen:
            # Its ratios would pair runs of two calls (two machines, or one at two times).
            raise SystemExit(
                f"{key[0]} / {key[1]} on {key[2]} GPUs is in two of the calls: give one"
            )
        seen.add(key)
    return merged


def _gpu_count(folders: list[Path], tests: dict[str, Any], layouts: dict[str, Any]) -> int | None:
    counts = {tests.get("gpus"), layouts.get("processes")}
    for folder in folders:
        for path in folder.glob("expert_parallel_*gpu*.json"):
            count = re.match(r"expert_parallel_(\d+)gpu", path.name)
            counts.add(int(count.group(1)) if count else None)
    counts.discard(None)
    if len(counts) > 1:
        raise SystemExit(f"the folders are of machines of different sizes ({sorted(counts)} GPUs)")
    return counts.pop() if counts else None


@dataclass
class Report:
    """One machine size's report: ``full`` (``results/<G>gpu/REPORT.md``: every test's line,
    the tests' gaps, the whole throughput table) and ``summary`` (the README's block)."""

    gpus: int | None
    full: str
    summary: str
    #: The joined benchmark rows and the folder each test session's files came from.
    bench: dict[str, Any] = field(default_factory=dict)
    tests_from: dict[str, Path | None] = field(default_factory=dict)


def render(*folders: Path) -> Report:
    """The Markdown of one or more calls' files, and their GPU count (None if nothing says it)."""
    if not folders:
        raise SystemExit("give at least one run_gpus.sh $OUT folder")
    calls = list(folders)
    for folder in calls:
        _check_call_folder(folder)
    gpu_folder = _tests_folder(calls, "gpu_tests")
    layout_folder = _tests_folder(calls, "layout_tests")
    tests = _json(gpu_folder / "gpu_tests.json") if gpu_folder else {}
    layouts = _json(layout_folder / "layout_tests.json") if layout_folder else {}
    bench = merged_benchmark(calls)
    gpus = _gpu_count(calls, tests, layouts)
    measured = []
    for folder in calls:
        versions = (folder / "versions.txt").read_text().strip().splitlines()
        measured.append("; ".join(v for v in versions if v))
    if len(measured) == 1:
        head = [f"Measured: {measured[0]}.", ""]
    else:
        head = [f"Measured in {len(measured)} calls:", ""]
        head += [f"{i}. {m}." for i, m in enumerate(measured, 1)] + [""]
    rows = []
    for script, folder, stem in (
        ("test_expert_parallel_gpu.py", gpu_folder, "gpu_tests"),
        ("test_expert_parallel_layouts.py", layout_folder, "layout_tests"),
    ):
        output = folder / f"{stem}.txt" if folder else None
        head.append(f"`{script}`: {_outcomes(output)}.")
        rows += _test_rows(output) if output else []
    full = list(head)
    if rows:
        full += ["", *(f"* {row}" for row in rows)]
    for table in (expert_parallel_table(tests), layout_table(layouts), throughput_table(bench)):
        if table:
            full += ["", *table]
    summary = list(head)
    table = scaling_summary(bench)
    if table:
        summary += ["", *table]
    where = f"results/{gpus}gpu/REPORT.md"
    summary += ["", f"Every test's outcome, the tests' gaps and MFU: [`{where}`]({where})."]
    tests_from = {"gpu_tests": gpu_folder, "layout_tests": layout_folder}
    return Report(gpus, "\n".join(full) + "\n", "\n".join(summary) + "\n", bench, tests_from)


def write(folders: list[Path], report: Report) -> None:
    """Copy the calls' files to ``results/<G>gpu/`` with ``REPORT.md``, and replace the README's
    block for G GPUs with the summary."""
    if report.gpus is None:
        raise SystemExit("no file in the folders says how many GPUs the calls used")
    gpus = report.gpus
    raw = HERE / "results" / f"{gpus}gpu"
    raw.mkdir(parents=True, exist_ok=True)
    for stem, source in report.tests_from.items():
        for suffix in (".json", ".txt"):
            if source and (source / f"{stem}{suffix}").is_file():
                shutil.copyfile(source / f"{stem}{suffix}", raw / f"{stem}{suffix}")
    if len(folders) == 1:
        shutil.copyfile(folders[0] / "versions.txt", raw / "versions.txt")
    else:
        (raw / "versions.txt").write_text(
            "".join(
                f"# call {i}: {f.name}\n{(f / 'versions.txt').read_text().strip()}\n"
                for i, f in enumerate(folders, 1)
            )
        )
    if report.bench.get("runs") or report.bench.get("skipped"):
        (raw / "expert_parallel.json").write_text(json.dumps(report.bench, indent=2) + "\n")
    title = f"# Expert parallelism on {gpus} GPUs: the tests and the throughput\n\n"
    (raw / "REPORT.md").write_text(title + report.full)
    start, end = f"<!-- report:{gpus}gpu -->", f"<!-- /report:{gpus}gpu -->"
    block = f"{start}\n{report.summary}{end}"
    text = README.read_text()
    if start in text and end in text:
        text = text[: text.index(start)] + block + text[text.index(end) + len(end) :]
    else:
        heading = f"### {gpus} GPUs (raw files: `results/{gpus}gpu/`)\n\n{block}\n\n"
        anchor = "## Not run"
        text = text.replace(anchor, heading + anchor, 1) if anchor in text else text + heading
    README.write_text(text)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "folders", type=Path, nargs="+", help="run_gpus.sh calls' $OUT folders (one machine size)"
    )
    parser.add_argument("--write", action="store_true", help="copy the files, update README.md")
    args = parser.parse_args(argv)
    report = render(*args.folders)
    print(report.full)
    if args.write:
        write(args.folders, report)
        print(
            f"README.md updated; raw files and REPORT.md in {HERE / 'results' / f'{report.gpus}gpu'}"
        )


if __name__ == "__main__":
    main()
