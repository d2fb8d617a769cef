/**
 * Sparklines of the last hour (GET gpushare/api/history, docs/rest-api.yaml): which series to
 * draw and the SVG polyline of each. Pure (the panel makes the SVG element; the unit tests in
 * __tests__/sparkline.spec.ts check the numbers).
 */

/** One point of a series: [t, ...values]; see docs/rest-api.yaml's History. */
export type HistoryPoint = (number | string | null)[];

export interface IHistory {
  now: number;
  window_seconds: number;
  resolution_seconds: number;
  kernels: Record<string, { user?: string; label?: string; points: HistoryPoint[] }>;
  users: Record<string, { points: HistoryPoint[] }>;
  devices: Record<string, { points: HistoryPoint[] }>;
}

/** [t, value] pairs. */
export type Series = [number, number][];

function num(v: unknown): number | null {
  return typeof v === 'number' && Number.isFinite(v) ? v : null;
}

/** A kernel's memory on the GPU (resident bytes) over time. */
export function kernelMemory(history: IHistory, id: string): Series {
  const points = history.kernels[id]?.points ?? [];
  return points
    .map(p => [num(p[0]), num(p[1])] as const)
    .filter((p): p is [number, number] => p[0] !== null && p[1] !== null);
}

/**
 * A kernel's share of the wall clock spent holding the GPU between two points (0..1): the rise of
 * its cumulative GPU time over the time between them.
 */
export function kernelGpuUse(history: IHistory, id: string): Series {
  const points = history.kernels[id]?.points ?? [];
  const out: Series = [];
  for (let i = 1; i < points.length; i++) {
    const [t0, g0] = [num(points[i - 1][0]), num(points[i - 1][3])];
    const [t1, g1] = [num(points[i][0]), num(points[i][3])];
    if (t0 === null || t1 === null || g0 === null || g1 === null || t1 <= t0) {
      continue;
    }
    out.push([t1, Math.max(0, Math.min(1, (g1 - g0) / (t1 - t0)))]);
  }
  return out;
}

/**
 * A GPU's use over time: NVML's utilisation (percent) where known, else whether someone held
 * the GPU (100) or not (0) — the stand-in for a machine without NVML.
 */
export function deviceUse(history: IHistory, uuid: string): { series: Series; measured: boolean } {
  const points = history.devices[uuid]?.points ?? [];
  const measured = points.some(p => num(p[1]) !== null);
  const series: Series = [];
  for (const p of points) {
    const t = num(p[0]);
    const value = measured ? num(p[1]) : (num(p[4]) ?? 0) > 0 ? 100 : 0;
    if (t !== null && value !== null) {
      series.push([t, value]);
    }
  }
  return { series, measured };
}

export interface ISparkOptions {
  /** The right edge's time, and how much time the width covers (seconds). */
  now: number;
  window: number;
  width: number;
  height: number;
  /** The top of the scale; default: the series' largest value (at least 1). */
  max?: number;
}

/**
 * The SVG polyline `points` of a step chart of `series` (each value holds until the next; the
 * last until `now`), or '' when there is nothing to draw.
 */
export function sparkline(series: Series, o: ISparkOptions): string {
  const start = o.now - o.window;
  const visible = series.filter(([t]) => t <= o.now);
  if (!visible.length) {
    return '';
  }
  const max = o.max ?? Math.max(1, ...visible.map(([, v]) => v));
  const x = (t: number) => ((Math.max(t, start) - start) / o.window) * o.width;
  const y = (v: number) => o.height - (Math.max(0, Math.min(v, max)) / max) * o.height;
  const r = (n: number) => Math.round(n * 10) / 10;
  const out: string[] = [];
  visible.forEach(([t, v], i) => {
    if (i > 0) {
      out.push(`${r(x(t))},${r(y(visible[i - 1][1]))}`);
    }
    out.push(`${r(x(t))},${r(y(v))}`);
  });
  out.push(`${r(o.width)},${r(y(visible[visible.length - 1][1]))}`);
  return out.join(' ');
}
