/**
 * The sidebar's sparklines as SVG: the last hour of a device's use and of each of my kernels'
 * memory and GPU use. The numbers come from sparkline.ts (pure, unit-tested); this module fetches
 * the history and makes the elements the panel places.
 */
import { URLExt } from '@jupyterlab/coreutils';
import { ServerConnection } from '@jupyterlab/services';
import { TranslationBundle } from '@jupyterlab/translation';

import { el } from './dom';
import { IDeviceView, IKernelRow } from './model';
import { deviceUse, IHistory, kernelGpuUse, kernelMemory, Series, sparkline } from './sparkline';

const SPARK_WIDTH = 120;
const SPARK_HEIGHT = 18;
const SVG_NS = 'http://www.w3.org/2000/svg';

/** The last hour (GET gpushare/api/history), or null when the server gives none. */
export async function fetchHistory(settings: ServerConnection.ISettings): Promise<IHistory | null> {
  const url = URLExt.join(settings.baseUrl, 'gpushare/api/history');
  try {
    const response = await ServerConnection.makeRequest(url, {}, settings);
    return response.ok ? ((await response.json()) as IHistory) : null;
  } catch {
    return null;
  }
}

/** A sparkline of the last hour (or of what there is of it), as an SVG. */
function spark(
  h: IHistory,
  series: Series,
  label: string,
  kind: string,
  max?: number
): Element | null {
  if (!series.length) {
    return null;
  }
  const span = Math.min(h.window_seconds, Math.max(60, h.now - series[0][0]));
  const points = sparkline(series, {
    now: h.now,
    window: span,
    width: SPARK_WIDTH,
    height: SPARK_HEIGHT,
    max
  });
  if (!points) {
    return null;
  }
  const svg = document.createElementNS(SVG_NS, 'svg');
  svg.setAttribute('class', `jp-gpushare-spark jp-gpushare-spark-${kind}`);
  svg.setAttribute('width', String(SPARK_WIDTH));
  svg.setAttribute('height', String(SPARK_HEIGHT + 2));
  svg.setAttribute('viewBox', `0 -1 ${SPARK_WIDTH} ${SPARK_HEIGHT + 2}`);
  svg.setAttribute('role', 'img');
  const minutes = Math.max(1, Math.round(span / 60));
  svg.setAttribute('aria-label', `${label}, last ${minutes} min`);
  svg.setAttribute('data-points', String(series.length));
  const title = document.createElementNS(SVG_NS, 'title');
  title.textContent = `${label}, last ${minutes} min`;
  const line = document.createElementNS(SVG_NS, 'polyline');
  line.setAttribute('points', points);
  svg.append(title, line);
  return svg;
}

/** The device's row: its utilisation (NVML), else whether a kernel held it; null: no history. */
export function deviceSparkRow(
  h: IHistory | null,
  dev: IDeviceView,
  trans: TranslationBundle
): HTMLElement | null {
  const use = h ? deviceUse(h, dev.uuid) : null;
  const deviceSpark =
    h && use
      ? spark(
          h,
          use.series,
          use.measured ? `Utilisation of ${dev.name}` : `${dev.name} held by a kernel`,
          'device',
          100
        )
      : null;
  if (!deviceSpark) {
    return null;
  }
  return el(
    'div',
    { className: 'jp-gpushare-sparkrow' },
    el('span', {
      className: 'jp-gpushare-label',
      text: use?.measured ? trans.__('Utilisation') : trans.__('GPU held')
    }),
    deviceSpark
  );
}

/** One of my kernels' row: its memory on the GPU and its GPU use; null when neither is drawn. */
export function kernelSparkRow(h: IHistory | null, row: IKernelRow): HTMLElement | null {
  if (!h) {
    return null;
  }
  const memory = spark(h, kernelMemory(h, row.id), `Memory of ${row.name} on the GPU`, 'memory');
  const gpu = spark(h, kernelGpuUse(h, row.id), `GPU use of ${row.name}`, 'gpu', 1);
  if (!memory && !gpu) {
    return null;
  }
  return el('div', { className: 'jp-gpushare-sparkrow' }, memory, gpu);
}
