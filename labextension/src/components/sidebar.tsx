/**
 * The sidebar's content: the header (title, whether the panel follows live updates, refresh),
 * then the messages, warnings and the last action's outcome, a section per GPU and this server's
 * GPU-shared kernels that are on no GPU yet.
 */
import * as React from 'react';
import { Button, refreshIcon } from '@jupyterlab/ui-components';

import { IUnregisteredRow, IViewModel } from '../model';
import { IViewContext, keyed } from './common';
import { Device } from './device';

export type Connection = 'offline' | 'connecting' | 'live';

/** What the panel renders: its state at one update. */
export interface ISidebarState {
  model: IViewModel;
  connection: Connection;
  /** The outcome of the last action (released, evicted, or why not). */
  feedback: string | null;
  ctx: IViewContext;
}

export function Sidebar(props: { state: ISidebarState; onRefresh: () => void }): JSX.Element {
  const { model, connection, feedback, ctx } = props.state;
  return (
    <>
      <Header connection={connection} ctx={ctx} onRefresh={props.onRefresh} />
      <div className="jp-gpushare-body">
        {model.message && (
          <div className="jp-gpushare-message" data-state={model.state} role="status">
            {model.message}
          </div>
        )}
        {model.notice && <div className="jp-gpushare-notice">{model.notice}</div>}
        {model.warnings.length > 0 && (
          <ul className="jp-gpushare-warnings" role="alert">
            {keyed(model.warnings, w => `${w.deviceUuid}:${w.clientId}`).map(([key, w]) => (
              <li key={key} className="jp-gpushare-warning">{`⚠ ${w.text}`}</li>
            ))}
          </ul>
        )}
        {feedback && (
          <div className="jp-gpushare-feedback" role="status">
            {feedback}
          </div>
        )}
        {model.devices.map(dev => (
          <Device key={dev.uuid} dev={dev} ctx={ctx} />
        ))}
        {model.unregistered.length > 0 && <Unregistered rows={model.unregistered} />}
      </div>
    </>
  );
}

const CONNECTION_TITLES: Record<Connection, string> = {
  // Whether this panel follows the server, not whether a kernel talks to the scheduler.
  live: 'This panel updates as the GPU status changes (kernels are listed below)',
  connecting: 'Reconnecting to live updates…',
  offline: 'Not following updates (panel hidden)'
};

function Header(props: {
  connection: Connection;
  ctx: IViewContext;
  onRefresh: () => void;
}): JSX.Element {
  const { connection, ctx } = props;
  const refresh = 'Refresh the GPU status now';
  return (
    <div className="jp-gpushare-header">
      <h2 className="jp-gpushare-title">{ctx.trans.__('Shared GPU')}</h2>
      <span
        className="jp-gpushare-connection"
        data-state={connection}
        role="status"
        aria-label={`Live updates: ${connection}`}
        title={CONNECTION_TITLES[connection]}
      >
        {connection === 'live' ? 'live updates' : connection}
      </span>
      <Button
        minimal
        small
        className="jp-gpushare-refresh"
        type="button"
        title={refresh}
        aria-label={refresh}
        onClick={props.onRefresh}
      >
        <refreshIcon.react tag="span" elementSize="small" />
      </Button>
    </div>
  );
}

/** This server's GPU-shared kernels that are on no GPU yet, in the magic's words. */
function Unregistered(props: { rows: IUnregisteredRow[] }): JSX.Element {
  return (
    <section className="jp-gpushare-unregistered-section" aria-label="Kernels on no GPU yet">
      <h3 className="jp-gpushare-group-title">GPU-shared kernels on no GPU yet</h3>
      <ul className="jp-gpushare-kernels">
        {props.rows.map(row => (
          <li
            key={row.kernelId}
            className="jp-gpushare-kernel jp-gpushare-unregistered"
            data-mine=""
            data-kernel-id={row.kernelId}
            data-reason={row.reason}
            title={row.title}
          >
            <span className="jp-gpushare-kernel-text">
              <span className="jp-gpushare-kernel-name">{row.name}</span>
              <span className="jp-gpushare-unregistered-text">{row.text}</span>
            </span>
          </li>
        ))}
      </ul>
    </section>
  );
}
