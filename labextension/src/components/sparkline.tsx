/**
 * The sidebar's sparklines as SVG: the last hour of a device's use and of each of my kernels'
 * memory and GPU use. The numbers come from sparkline.ts (pure, unit-tested).
 */
import * as React from 'react';
import { TranslationBundle } from '@jupyterlab/translation';

import { IDeviceView, IKernelRow } from '../model';
import { deviceUse, IHistory, kernelGpuUse, kernelMemory, Series, sparkline } from '../sparkline';

const SPARK_WIDTH = 120;
const SPARK_HEIGHT = 18;

interface ISpark {
  points: string;
  /** e.g. "Memory of a.ipynb on the GPU, last 12 min" */
  label: string;
  count: number;
}

/** A sparkline's points and label over the last hour (or what there is of it); null: none. */
function sparkOf(h: IHistory, series: Series, label: string, max?: number): ISpark | null {
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
  const minutes = Math.max(1, Math.round(span / 60));
  return { points, label: `${label}, last ${minutes} min`, count: series.length };
}

function Spark(props: { spark: ISpark; kind: string }): JSX.Element {
  const { spark, kind } = props;
  return (
    <svg
      className={`jp-gpushare-spark jp-gpushare-spark-${kind}`}
      width={SPARK_WIDTH}
      height={SPARK_HEIGHT + 2}
      viewBox={`0 -1 ${SPARK_WIDTH} ${SPARK_HEIGHT + 2}`}
      role="img"
      aria-label={spark.label}
      data-points={spark.count}
    >
      <title>{spark.label}</title>
      <polyline points={spark.points} />
    </svg>
  );
}

/** The device's row: its utilisation (NVML), else whether a kernel held it; none: no history. */
export function DeviceSparkRow(props: {
  history: IHistory | null;
  dev: IDeviceView;
  trans: TranslationBundle;
}): JSX.Element | null {
  const { history: h, dev, trans } = props;
  const use = h ? deviceUse(h, dev.uuid) : null;
  const spark =
    h && use
      ? sparkOf(
          h,
          use.series,
          use.measured ? `Utilisation of ${dev.name}` : `${dev.name} held by a kernel`,
          100
        )
      : null;
  if (!spark) {
    return null;
  }
  return (
    <div className="jp-gpushare-sparkrow">
      <span className="jp-gpushare-label">
        {use?.measured ? trans.__('Utilisation') : trans.__('GPU held')}
      </span>
      <Spark spark={spark} kind="device" />
    </div>
  );
}

/** One of my kernels' row: its memory on the GPU and its GPU use; none when neither is drawn. */
export function KernelSparkRow(props: {
  history: IHistory | null;
  row: IKernelRow;
}): JSX.Element | null {
  const { history: h, row } = props;
  if (!h) {
    return null;
  }
  const memory = sparkOf(h, kernelMemory(h, row.id), `Memory of ${row.name} on the GPU`);
  const gpu = sparkOf(h, kernelGpuUse(h, row.id), `GPU use of ${row.name}`, 1);
  if (!memory && !gpu) {
    return null;
  }
  return (
    <div className="jp-gpushare-sparkrow">
      {memory && <Spark spark={memory} kind="memory" />}
      {gpu && <Spark spark={gpu} kind="gpu" />}
    </div>
  );
}
