/**
 * A kernel's row in the device's groups (holders, waiters, idle) with its actions, and my
 * kernels' memory against their quotas.
 */
import * as React from 'react';
import { Button } from '@jupyterlab/ui-components';

import { formatBytes, formatDuration, formatPercent, IKernelRow } from '../model';
import { Action, flag, IViewContext, Swatch } from './common';
import { KernelSparkRow } from './sparkline';

/** A kernel's role in words, as its row's aria-label says it. */
function roleText(row: IKernelRow): string {
  if (row.role === 'holder') {
    return 'holds the GPU';
  }
  if (row.role === 'waiter') {
    return `waits${row.queuePosition !== null ? ` (#${row.queuePosition} in the queue)` : ''}`;
  }
  return 'idle';
}

/** The row's second line: whose, where in the queue, for how long, how much memory. */
function details(row: IKernelRow): string {
  const out: string[] = [];
  if (!row.mine) {
    out.push(row.user);
  }
  if (row.role === 'waiter') {
    if (row.queuePosition !== null) {
      out.push(`#${row.queuePosition} in queue`);
    }
    out.push(`waiting ${formatDuration(row.waitingFor)}`);
  } else if (row.pastQuantum !== null) {
    out.push(`${formatDuration(row.pastQuantum)} past its turn`);
  } else if (row.state !== 'running' && row.state !== 'idle') {
    out.push(row.state);
  }
  out.push(formatBytes(row.usedBytes));
  if (row.evictedBytes) {
    out.push(`${formatBytes(row.evictedBytes)} on host`);
  }
  return out.join(' · ');
}

export function KernelRow(props: { row: IKernelRow; ctx: IViewContext }): JSX.Element {
  const { row, ctx } = props;
  return (
    <li
      className="jp-gpushare-kernel"
      data-mine={flag(row.mine)}
      data-role={row.role}
      data-client-id={row.id}
      data-near-quota={flag(row.nearQuota)}
      title={row.title}
      aria-label={`${row.name}${row.mine ? ' (mine)' : ''}: ${roleText(row)}`}
    >
      <Swatch color={row.color} />
      <span className="jp-gpushare-kernel-text">
        <span className="jp-gpushare-kernel-name">{row.name}</span>
        {row.mine && <span className="jp-gpushare-badge">mine</span>}
        <span className="jp-gpushare-kernel-meta">{details(row)}</span>
        {row.waitText && (
          <span className="jp-gpushare-kernel-why" data-reason={row.waitReason ?? ''}>
            {row.waitText}
          </span>
        )}
      </span>
      {(row.canRelease || row.canEvict) && (
        <span className="jp-gpushare-actions">
          {row.canRelease && <ActionButton row={row} action="release" ctx={ctx} />}
          {row.canEvict && <ActionButton row={row} action="evict" ctx={ctx} />}
        </span>
      )}
    </li>
  );
}

function ActionButton(props: { row: IKernelRow; action: Action; ctx: IViewContext }): JSX.Element {
  const { row, action, ctx } = props;
  const title =
    action === 'release'
      ? `Release the GPU held by ${row.name}: its running work finishes, then others may run`
      : `Evict ${row.name}: release its GPU and move its memory to host memory (admin)`;
  return (
    <Button
      small
      className={`jp-gpushare-button jp-gpushare-${action}`}
      type="button"
      title={title}
      aria-label={title}
      disabled={ctx.busy.has(`${action}:${row.id}`)}
      onClick={() => ctx.act(row, action)}
    >
      {action === 'release' ? ctx.trans.__('Release') : ctx.trans.__('Evict')}
    </Button>
  );
}

/** One of my kernels: its memory against its quota, its GPU time and its sparklines. */
export function Quota(props: { row: IKernelRow; ctx: IViewContext }): JSX.Element {
  const { row, ctx } = props;
  const fraction = row.quotaFraction ?? 0;
  return (
    <div className="jp-gpushare-quota" data-near-quota={flag(row.nearQuota)}>
      <span className="jp-gpushare-kernel-name">{row.name}</span>
      {row.quotaBytes > 0 ? (
        <>
          <span className="jp-gpushare-kernel-meta">
            {`${formatBytes(row.usedBytes)} of ${formatBytes(row.quotaBytes)} quota ` +
              `(${formatPercent(fraction)})${row.nearQuota ? ' ⚠' : ''}`}
          </span>
          <div
            className="jp-gpushare-quotabar"
            role="progressbar"
            aria-label={`Memory of ${row.name} against its quota`}
            aria-valuemin={0}
            aria-valuemax={row.quotaBytes}
            aria-valuenow={Math.min(row.usedBytes, row.quotaBytes)}
            aria-valuetext={`${formatBytes(row.usedBytes)} of ${formatBytes(row.quotaBytes)}`}
          >
            <div
              className="jp-gpushare-quotafill"
              style={{ width: `${Math.min(100, fraction * 100).toFixed(2)}%` }}
            />
          </div>
        </>
      ) : (
        <span className="jp-gpushare-kernel-meta">{`${formatBytes(row.usedBytes)}, no quota`}</span>
      )}
      {row.gpuShare !== null && (
        <span className="jp-gpushare-kernel-meta">
          {`GPU time ${formatDuration(row.gpuSeconds)} (${formatPercent(row.gpuShare)})`}
        </span>
      )}
      <KernelSparkRow history={ctx.history} row={row} />
    </div>
  );
}
