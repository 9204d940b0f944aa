"""The PNG: TTFT and ITL distributions per concurrency level and server (box plots), and tok/s per level; the
title names the prompt set (give the shared run its own --plot path)."""

from __future__ import annotations

from pathlib import Path


def plot(payload: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    servers = {name: s for name, s in payload["servers"].items() if s.get("levels")}
    levels = sorted({lv["concurrency"] for s in servers.values() for lv in s["levels"]})
    if not servers or not levels:
        return
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    width = 0.8 / len(servers)
    fig, axes = plt.subplots(1, 3, figsize=(6 + 2.5 * len(levels) + 2 * len(servers), 5))
    for ax, key, title in ((axes[0], "ttft_ms", "TTFT (ms)"), (axes[1], "itl_ms", "inter-chunk latency (ms)")):
        for i, (name, server) in enumerate(servers.items()):
            by_conc = {lv["concurrency"]: lv["raw"][key] for lv in server["levels"]}
            xs = [j + (i - (len(servers) - 1) / 2) * width for j, c in enumerate(levels) if by_conc.get(c)]
            data = [by_conc[c] for c in levels if by_conc.get(c)]
            if not data:
                continue
            box = ax.boxplot(data, positions=xs, widths=width * 0.9, patch_artist=True, showfliers=True,
                             flierprops={"markersize": 2, "alpha": 0.4})
            for patch in box["boxes"]:
                patch.set_facecolor(colors[i % len(colors)])
                patch.set_alpha(0.6)
            ax.plot([], [], color=colors[i % len(colors)], linewidth=6, alpha=0.6, label=name)
        ax.set_xticks(range(len(levels)), [str(c) for c in levels])
        ax.set_xlabel("concurrency")
        ax.set_title(title)
        values = [v for s in servers.values() for lv in s["levels"] for v in lv["raw"][key] if v > 0]
        if values and max(values) / min(values) > 30:
            ax.set_yscale("log")
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize="small")
    for i, (name, server) in enumerate(servers.items()):
        pts = sorted((lv["concurrency"], lv["output_tok_s"]) for lv in server["levels"])
        axes[2].plot([levels.index(c) for c, _ in pts], [t for _, t in pts], marker="o",
                     color=colors[i % len(colors)], label=name)
    axes[2].set_xticks(range(len(levels)), [str(c) for c in levels])
    axes[2].set_xlabel("concurrency")
    axes[2].set_title("output tokens/s (aggregate)")
    axes[2].grid(alpha=0.3)
    axes[2].legend(fontsize="small")
    meta = payload["meta"]
    fig.suptitle(f"{meta['model_dir'].rstrip('/').split('/')[-1]}, {meta.get('prompts', 'short')} prompts, "
                 f"max_tokens {meta['max_tokens']}, "
                 f"{meta['machine']['cpu_model']} x{meta['machine']['nproc']}", fontsize="medium")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
