/**
 * A GPU's section: its name and sharing mode, the memory pool as a stacked bar, utilisation,
 * who holds it, who waits (in queue order), who is idle, other users' kernels (filtered
 * documents), and my kernels against their quotas.
 */
import * as React from 'react';

import { formatBytes, formatPercent, IDeviceView, IKernelRow, IPlace, ISegment } from '../model';
import { colorOf, flag, Group, IViewContext, keyed } from './common';
import { KernelRow, Quota } from './kernel';
import { Others, Place, placeKey } from './others';
import { DeviceSparkRow } from './sparkline';

export function Device(props: { dev: IDeviceView; ctx: IViewContext }): JSX.Element {
  const { dev, ctx } = props;
  const __ = (text: string) => ctx.trans.__(text);
  return (
    <section className="jp-gpushare-device" aria-label={`GPU ${dev.name}`} data-uuid={dev.uuid}>
      <div className="jp-gpushare-device-head">
        <span className="jp-gpushare-device-name" title={dev.uuid}>
          {dev.name}
        </span>
        <span
          className="jp-gpushare-mode"
          data-mode={dev.mode}
          title={dev.modeDescription}
          aria-label={`Sharing mode: ${dev.modeLabel}. ${dev.modeDescription}`}
        >
          {dev.modeLabel}
        </span>
      </div>
      <div className="jp-gpushare-summary">{dev.summary}</div>
      <MemoryBar dev={dev} />
      <div className="jp-gpushare-legend">{legend(dev)}</div>
      {dev.utilization !== null && <Utilisation dev={dev} utilization={dev.utilization} />}
      <DeviceSparkRow history={ctx.history} dev={dev} trans={ctx.trans} />
      {dev.filtered ? (
        <>
          {/* Other users' kernels are only summed: their holders and places in the queue. */}
          <Kernels
            kind="holders"
            title={__('Holding the GPU')}
            rows={dev.holders}
            others={dev.otherHolders}
            ctx={ctx}
          />
          <Queue queue={dev.queue} waiters={dev.waiters} ctx={ctx} />
          <Kernels kind="idle" title={__('Idle')} rows={dev.idle} ctx={ctx} />
          <Others others={dev.others} trans={ctx.trans} />
        </>
      ) : (
        <>
          <Kernels kind="holders" title={__('Holding the GPU')} rows={dev.holders} ctx={ctx} />
          <Kernels kind="waiters" title={__('Waiting')} rows={dev.waiters} ctx={ctx} />
          <Kernels kind="idle" title={__('Idle')} rows={dev.idle} ctx={ctx} />
        </>
      )}
      {dev.mine.length > 0 && <Mine dev={dev} ctx={ctx} />}
    </section>
  );
}

function legend(dev: IDeviceView): string {
  return (
    `${formatBytes(dev.residentBytes)} on the GPU · ${formatBytes(dev.freeBytes)} free` +
    (dev.evictedBytes ? ` · ${formatBytes(dev.evictedBytes)} on host` : '') +
    ` · pool ${formatBytes(dev.poolBytes)}` +
    (dev.totalBytes ? ` of ${formatBytes(dev.totalBytes)}` : '')
  );
}

function segmentKey(seg: ISegment): string {
  return `${seg.kind}:${seg.id ?? seg.user ?? ''}`;
}

/** The memory pool as a stacked bar: a segment per kernel (or other user), evicted, free. */
function MemoryBar(props: { dev: IDeviceView }): JSX.Element {
  const { dev } = props;
  const used = dev.residentBytes;
  return (
    <div
      className="jp-gpushare-membar"
      role="progressbar"
      aria-label={`Memory pool of ${dev.name}`}
      aria-valuemin={0}
      aria-valuemax={dev.poolBytes}
      aria-valuenow={Math.min(used, dev.poolBytes)}
      aria-valuetext={
        `${formatBytes(used)} of ${formatBytes(dev.poolBytes)} in use, ` +
        `${formatBytes(dev.evictedBytes)} evicted to host memory`
      }
    >
      {keyed(dev.segments, segmentKey).map(([key, seg]) => (
        <div
          key={key}
          className={`jp-gpushare-seg jp-gpushare-seg-${seg.kind}`}
          data-mine={flag(seg.mine)}
          data-user={seg.user ?? undefined}
          data-color={colorOf(seg.color)}
          title={seg.label}
          style={{ width: `${(seg.fraction * 100).toFixed(3)}%` }}
        />
      ))}
    </div>
  );
}

function Utilisation(props: { dev: IDeviceView; utilization: number }): JSX.Element {
  const u = Math.max(0, Math.min(100, props.utilization));
  return (
    <>
      <div className="jp-gpushare-label">{`Utilisation ${Math.round(u)}%`}</div>
      <div
        className="jp-gpushare-utilbar"
        role="progressbar"
        aria-label={`Utilisation of ${props.dev.name}`}
        aria-valuemin={0}
        aria-valuemax={100}
        aria-valuenow={Math.round(u)}
        title={`Utilisation: ${Math.round(u)}%`}
      >
        <div className="jp-gpushare-utilfill" style={{ width: `${u}%` }} />
      </div>
    </>
  );
}

/** A group of the device's kernels, and other users' holders after them (filtered). */
function Kernels(props: {
  kind: string;
  title: string;
  rows: IKernelRow[];
  others?: IPlace[];
  ctx: IViewContext;
}): JSX.Element {
  const { kind, title, rows, ctx } = props;
  const others = props.others ?? [];
  return (
    <Group kind={kind} title={title} count={rows.length + others.length}>
      {rows.map(row => (
        <KernelRow key={row.id} row={row} ctx={ctx} />
      ))}
      {keyed(others, placeKey).map(([key, place]) => (
        <Place key={key} place={place} role="holder" />
      ))}
    </Group>
  );
}

/** A filtered document's queue, in order: the viewer's waiters and other users' places. */
function Queue(props: { queue: IPlace[]; waiters: IKernelRow[]; ctx: IViewContext }): JSX.Element {
  const { queue, waiters, ctx } = props;
  const listed = new Set(queue.map(p => p.row?.id).filter(id => id !== undefined));
  // The viewer's waiters the queue does not name (e.g. waiting but not queued yet) go last.
  const rest = waiters.filter(r => !listed.has(r.id));
  return (
    <Group kind="waiters" title={ctx.trans.__('Waiting')} count={queue.length + rest.length}>
      {keyed(queue, p => (p.row ? p.row.id : placeKey(p))).map(([key, place]) =>
        place.row ? (
          <KernelRow key={key} row={place.row} ctx={ctx} />
        ) : (
          <Place key={key} place={place} role="waiter" />
        )
      )}
      {rest.map(row => (
        <KernelRow key={row.id} row={row} ctx={ctx} />
      ))}
    </Group>
  );
}

/** My kernels on this GPU: memory against quota, GPU time, sparklines; my share of GPU time. */
function Mine(props: { dev: IDeviceView; ctx: IViewContext }): JSX.Element {
  const { dev, ctx } = props;
  return (
    <div className="jp-gpushare-mine" aria-label="My kernels on this GPU">
      <h3 className="jp-gpushare-group-title">{ctx.trans.__('My kernels')}</h3>
      {dev.mine.map(row => (
        <Quota key={row.id} row={row} ctx={ctx} />
      ))}
      {dev.myShare !== null && (
        <div className="jp-gpushare-share">
          {`My share of GPU time: ${formatPercent(dev.myShare)}` +
            (dev.myWeightShare !== null ? ` (by weight: ${formatPercent(dev.myWeightShare)})` : '')}
        </div>
      )}
    </div>
  );
}
