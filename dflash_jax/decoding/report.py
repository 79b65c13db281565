"""Presenting evaluation results: a terminal table and a PNG (τ per set, histogram, per-slot rates)."""

from __future__ import annotations

import numpy as np

# (title, width, value format); the first column is left-aligned and as wide as the longest set
# name (at least its width here), the others right-aligned.
COLUMNS = (
    ("set", 18, "s"),
    ("prompts", 7, "d"),
    ("tau", 6, ".2f"),
    ("DFlash tok/s", 12, ".1f"),
    ("target tok/s", 12, ".1f"),
    ("DFlash ms/tok", 13, ".2f"),
    ("target ms/tok", 13, ".2f"),
    ("speedup", 7, ".2f"),
    ("after 1st token", 15, ".2f"),
)


def _render(columns: tuple, rows: list[tuple], *, left: int = 1) -> list[str]:
    """Header, rule and one line per row of values (None prints '-'): the first `left` columns
    left-aligned, the others right-aligned; the first as wide as its longest value."""
    widths = [max([columns[0][1], *(len(row[0]) for row in rows)])] + [w for _, w, _ in columns[1:]]

    def line(cells: list[str]) -> str:
        return "  ".join(c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    header = line([title for title, _, _ in columns])
    body = [line(["-" if v is None else format(v, fmt) for v, (_, _, fmt) in zip(row, columns)]) for row in rows]
    return [header, "-" * len(header), *body]


def table(results: dict[str, dict]) -> str:
    """One row per prompt set (the last column: the speedup after the first token, the prefill
    left out), then each set's acceptance-length histogram as fractions."""
    rows = [
        (
            name,
            r["num_prompts"],
            r["tau"],
            r["dflash"]["tokens_per_s"],
            r["target"]["tokens_per_s"],
            r["dflash"]["ms_per_token"],
            r["target"]["ms_per_token"],
            r["speedup"],
            r.get("decode_speedup"),  # None, or absent from older versions' results saved in a workdir
        )
        for name, r in results.items()
    ]
    lines = _render(COLUMNS, rows)
    for name, r in results.items():
        hist = np.asarray(r["histogram"], float)
        fractions = hist / max(hist.sum(), 1)
        lines.append(f"{name}: acceptance lengths 1..{len(hist)}: " + " ".join(f"{f:.2f}" for f in fractions))
    return "\n".join(lines)


# The engine's figures beside ours (`engines.server.engine_figures`): τ, steps, drafts, speed, identity.
ENGINE_COLUMNS = (
    ("set", 18, "s"),
    ("served", 7, "s"),
    ("our tau", 7, ".2f"),
    ("engine tau", 10, ".2f"),
    ("steps", 6, "d"),
    ("drafted", 8, "d"),
    ("accepted", 8, "d"),
    ("+drafter tok/s", 14, ".1f"),
    ("alone tok/s", 11, ".1f"),
    ("+drafter ms/tok", 15, ".2f"),
    ("alone ms/tok", 12, ".2f"),
    ("speedup", 7, ".2f"),
    ("identical", 9, ".2f"),
)


def engine_table(ours: dict[str, dict], engine: dict) -> str:
    """One row per target the engine served (`engine["served"]`'s keys: llama.cpp's GGUF as it is
    or widened to float32, vLLM's dtype) and prompt set: our decoder's τ, then the engine's
    counters and speeds (decoding after the prompt, as the engine times it) and the fraction of
    texts equal to the target alone; then what a step costs in the engine."""
    served = engine["served"]
    rows = [
        (
            name,
            weights,
            ours.get(name, {}).get("tau"),
            e["tau"],
            e["steps"],
            e["drafted"],
            e["accepted"],
            e["drafter"]["tokens_per_s"],
            e["target"]["tokens_per_s"],
            e["drafter"]["ms_per_token"],
            e["target"]["ms_per_token"],
            e["speedup"],
            e["identical_outputs"],
        )
        for weights, sets in served.items()
        for name, e in sets.items()
    ]
    lines = [f"{engine['name']}, greedy, the first turn of every prompt:", *_render(ENGINE_COLUMNS, rows, left=2)]
    for weights, sets in served.items():
        for name, e in sets.items():
            if c := e.get("step_costs"):
                line = (
                    f"{name} ({weights}): a step {c['step_ms']:.1f} ms = {c['step_in_decode_steps']:.2f} target "
                    f"decode steps ({c['decode_ms']:.1f} ms)"
                )
                if "verify_ms" in c:
                    line += (
                        f": verify ({c['verify_tokens']:.0f} tokens) {c['verify_ms']:.1f} ms = "
                        f"{c['verify_in_decode_steps']:.2f}, drafter and the rest {c['drafter_ms']:.1f} ms = "
                        f"{c['drafter_in_decode_steps']:.2f}"
                    )
                lines.append(f"{line}; break-even tau {c['step_in_decode_steps']:.2f}")
    return "\n".join(lines)


def plot(results: dict[str, dict], block_size: int, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only; never needs a display
    import matplotlib.pyplot as plt

    fig, (ax_tau, ax_hist, ax_slots) = plt.subplots(
        1, 3, figsize=(16, 4.5), gridspec_kw={"width_ratios": [max(2, len(results)), 4, 4]}
    )
    names = list(results)
    taus = [results[name]["tau"] for name in names]
    bars = ax_tau.bar(range(len(names)), taus, color=[f"C{i}" for i in range(len(names))])
    ax_tau.bar_label(bars, fmt="%.2f")
    ax_tau.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=8)
    ax_tau.set(ylabel="mean acceptance length", title="τ per prompt set", ylim=(0, block_size))
    lengths = np.arange(1, block_size + 1)
    width = 0.8 / max(len(results), 1)
    for i, (name, r) in enumerate(results.items()):
        hist = np.asarray(r["histogram"], float)
        ax_hist.bar(
            lengths + (i - (len(results) - 1) / 2) * width,
            hist / max(hist.sum(), 1),
            width,
            label=f"{name} (τ={r['tau']:.2f}, {r['speedup']:.2f}x)",
        )
        ax_slots.plot(np.arange(1, block_size), r["slot_acceptance"], marker="o", label=name)
    ax_hist.set(
        xlabel="acceptance length per step",
        ylabel="fraction of steps",
        title="Acceptance length histogram",
        xticks=lengths,
    )
    ax_slots.set(
        xlabel="draft slot",
        ylabel="fraction of steps accepting it",
        ylim=(0, 1.02),
        title="Per-slot acceptance",
        xticks=np.arange(1, block_size),
    )
    ax_hist.legend(fontsize=8)
    ax_slots.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
