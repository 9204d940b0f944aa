// Per-answer timing, measured in the browser as the stream arrives: time to the first token, tokens per second,
// and each token's gap to the one before it, drawn as one bar per token in a small inline SVG.

const SVG = "http://www.w3.org/2000/svg";
const TOGETHER_MS = 1; // tokens of one engine step arrive together: the server's speculative decoding accepted drafts

export class Timing {
  constructor() {
    this.start = performance.now();
    this.marks = []; // one per token: {at, gap, token}
    this.usage = null;
  }

  /** Tokens that arrived together in one chunk: the first waited since the last chunk, the rest came with it. */
  add(tokens) {
    const now = performance.now();
    const last = this.marks.length ? this.marks[this.marks.length - 1].at : this.start;
    tokens.forEach((token, i) => this.marks.push({ at: now, gap: i === 0 ? now - last : 0, token }));
  }

  get ttft() { return this.marks.length ? this.marks[0].at - this.start : null; }

  /** Decode speed: tokens after the first over the time since the first. */
  get tokensPerSecond() {
    const n = this.marks.length;
    if (n < 2) return null;
    const span = this.marks[n - 1].at - this.marks[0].at;
    return span > 0 ? ((n - 1) * 1000) / span : null;
  }

  gapStats() {
    const gaps = this.marks.slice(1).map((m) => m.gap).sort((a, b) => a - b);
    if (!gaps.length) return null;
    return { median: gaps[Math.floor(gaps.length / 2)], max: gaps[gaps.length - 1] };
  }
}

const fmt = (value, digits = 0) => (value == null ? "–" : value.toFixed(digits));

/** Fills `panel` (a .timing element made by `timingPanel`) with the numbers and the plot. */
export function drawTiming(panel, timing) {
  const gaps = timing.gapStats();
  const u = timing.usage;
  const set = (name, text) => { panel.querySelector(`[data-stat="${name}"]`).textContent = text; };
  set("ttft", fmt(timing.ttft));
  set("tps", fmt(timing.tokensPerSecond, 1));
  set("tokens", String(timing.marks.length));
  set("gap", gaps ? `${fmt(gaps.median, 1)} / ${fmt(gaps.max, 1)}` : "–");
  set("prompt", u ? String(u.prompt_tokens) : "–");
  set("cached", u ? String(u.prompt_tokens_details?.cached_tokens ?? 0) : "–");
  set("completion", u ? String(u.completion_tokens) : "–");
  const top = Math.max(gaps ? gaps.max : 0, 1); // the first token's wait (TTFT) is drawn full height, in its own colour
  panel.querySelector('[data-axis="top"]').textContent = `${fmt(top, top < 10 ? 1 : 0)} ms`;
  drawPlot(panel.querySelector("svg"), timing, top);
}

function drawPlot(svg, timing, top) {
  const n = timing.marks.length;
  const width = Math.max(n, 60);
  svg.setAttribute("viewBox", `0 0 ${width} 100`);
  const bars = document.createDocumentFragment();
  timing.marks.forEach((mark, i) => {
    const h = i === 0 ? 100 : Math.max((mark.gap / top) * 100, 1.5);
    const bar = document.createElementNS(SVG, "rect");
    // a token that came with the one before it, without a wait of its own: an accepted draft (speculative decoding)
    const drafted = i > 0 && mark.gap < TOGETHER_MS;
    bar.setAttribute("class", i === 0 ? "mark first" : drafted ? "mark drafted" : "mark");
    bar.setAttribute("x", String(i + 0.1));
    bar.setAttribute("width", "0.8");
    bar.setAttribute("y", String(100 - h));
    bar.setAttribute("height", String(h));
    const title = document.createElementNS(SVG, "title");
    const what = i === 0 ? `first token after ${fmt(timing.ttft)} ms` : drafted ? "with the token before (an accepted draft)" : `+${fmt(mark.gap, 1)} ms`;
    title.textContent = `#${i + 1} ${JSON.stringify(mark.token)} ${what}`;
    bar.append(title);
    bars.append(bar);
  });
  svg.replaceChildren(bars);
}

/** The empty panel under an answer. */
export function timingPanel() {
  const panel = document.createElement("section");
  panel.className = "timing";
  panel.setAttribute("aria-label", "Timing");
  const stat = (name, label, unit = "", title = "") =>
    `<span class="stat"${title ? ` title="${title}"` : ""}><span class="label">${label}</span> <span data-stat="${name}">–</span>${unit}</span>`;
  const cached = "prompt tokens served from the server's prefix cache: an earlier request computed them, this one did not";
  panel.innerHTML =
    `<div class="stats">${stat("ttft", "TTFT", " ms")}${stat("tps", "speed", " tok/s")}${stat("tokens", "tokens")}` +
    `${stat("gap", "gap median/max", " ms")}</div>` +
    `<div class="stats usage">${stat("prompt", "prompt")}${stat("cached", "cached", "", cached)}${stat("completion", "completion")}</div>` +
    `<div class="plot-box"><span class="axis top" data-axis="top">– ms</span><span class="axis zero">0 ms</span></div>` +
    `<p class="legend">one bar per token, its height the wait since the token before (ms, to the scale on the left); ` +
    `<span class="swatch first"></span> the first token, after the TTFT (not to scale); ` +
    `<span class="swatch drafted"></span> a token that came with the one before, in the same step: a draft the model ` +
    `accepted (speculative decoding)</p>`;
  const svg = document.createElementNS(SVG, "svg");
  svg.setAttribute("class", "plot");
  svg.setAttribute("preserveAspectRatio", "none");
  svg.setAttribute("role", "img");
  svg.setAttribute("aria-label", "Wait before each token in ms (one bar per token)");
  panel.querySelector(".plot-box").prepend(svg);
  return panel;
}
