/**
 * The sidebar widget: fetches the status document, follows the events websocket while shown,
 * and renders the view model (model.ts) through React (components/: the header and body in
 * sidebar.tsx, a GPU's section in device.tsx, kernel rows in kernel.tsx, other users' places in
 * others.tsx, sparklines in sparkline.tsx). Each update emits the panel's state to a `UseSignal`,
 * and React redraws only what changed: an element whose data did not change stays the same
 * node (focus, hover and selection survive updates). The toasts and the status-bar item are the
 * plugin's (index.ts, from notify.ts's notices).
 */
import * as React from 'react';
import { Dialog, showDialog } from '@jupyterlab/apputils';
import { URLExt } from '@jupyterlab/coreutils';
import { ITranslator, nullTranslator, TranslationBundle } from '@jupyterlab/translation';
import { ServerConnection } from '@jupyterlab/services';
import { ReactWidget, UseSignal } from '@jupyterlab/ui-components';
import { Message } from '@lumino/messaging';
import { Signal } from '@lumino/signaling';

import { buildViewModel, Fetched, formatBytes, IKernelRow, IStatus, IViewModel } from './model';
import { Action } from './components/common';
import { Connection, ISidebarState, Sidebar } from './components/sidebar';
import { IHistory } from './sparkline';

/** How often the panel fetches the history (the sparklines) while shown. */
const HISTORY_EVERY_TICKS = 5;

/** Reconnect delays of the events websocket: doubling from the first to the last. */
const BACKOFF_FIRST_MS = 500;
const BACKOFF_MAX_MS = 30000;

export interface IPanelOptions {
  serverSettings?: ServerConnection.ISettings;
  /** JupyterLab's translator (its `jupyter_gpushare` domain); English without it. */
  translator?: ITranslator;
}

export class GPUSharePanel extends ReactWidget {
  constructor(options: IPanelOptions = {}) {
    super();
    this._trans = (options.translator ?? nullTranslator).load('jupyter_gpushare');
    this.addClass('jp-gpushare-panel');
    this.node.setAttribute('role', 'region');
    this.node.setAttribute('aria-label', this._trans.__('Shared GPU'));
    this._settings = options.serverSettings ?? ServerConnection.makeSettings();
    this._onVisibility = () => {
      if (document.hidden) {
        this._stop();
      } else if (this.isVisible) {
        this._start();
      }
    };
    document.addEventListener('visibilitychange', this._onVisibility);
    this._onRefresh = () => void this.refresh();
    this._onAct = (row, action) => void this._act(row, action);
  }

  /** The latest view model (for tests and other plugins). */
  get model(): IViewModel {
    return buildViewModel(this._fetched);
  }

  get connection(): Connection {
    return this._connection;
  }

  dispose(): void {
    if (this.isDisposed) {
      return;
    }
    document.removeEventListener('visibilitychange', this._onVisibility);
    this._stop();
    super.dispose();
  }

  /** Fetch the last hour (the sparklines); without it the panel draws none. */
  async refreshHistory(): Promise<void> {
    this._history = await fetchHistory(this._settings);
    this._render();
  }

  /** Fetch the status document now (REST), whatever the websocket does. */
  async refresh(): Promise<void> {
    const url = URLExt.join(this._settings.baseUrl, 'gpushare/api/status');
    const generation = this._generation;
    let fetched: Fetched;
    try {
      const response = await ServerConnection.makeRequest(url, {}, this._settings);
      if (response.ok) {
        fetched = { kind: 'status', status: (await response.json()) as IStatus };
      } else {
        fetched = {
          kind: 'error',
          statusCode: response.status,
          message: await errorMessage(response)
        };
      }
    } catch (err) {
      fetched = { kind: 'error', statusCode: null, message: `Cannot reach the server: ${err}` };
    }
    // A websocket message that came meanwhile is newer than this answer.
    if (generation === this._generation) {
      this._setFetched(fetched);
    }
  }

  protected onAfterShow(msg: Message): void {
    super.onAfterShow(msg);
    this._start();
  }

  protected onAfterHide(msg: Message): void {
    super.onAfterHide(msg);
    this._stop();
  }

  protected onAfterAttach(msg: Message): void {
    super.onAfterAttach(msg);
    if (this.isVisible) {
      this._start();
    }
  }

  protected onBeforeDetach(msg: Message): void {
    this._stop();
    super.onBeforeDetach(msg);
  }

  // ------------------------------------------------------------------------------------------
  // Live updates

  private _start(): void {
    if (this._active) {
      return;
    }
    this._active = true;
    void this.refresh();
    this._connect();
    // Waits grow by themselves: re-render every second while shown.
    void this.refreshHistory();
    this._ticker = window.setInterval(() => {
      if (++this._ticks % HISTORY_EVERY_TICKS === 0) {
        void this.refreshHistory();
      }
      this._render();
    }, 1000);
  }

  private _stop(): void {
    this._active = false;
    if (this._ticker !== null) {
      window.clearInterval(this._ticker);
      this._ticker = null;
    }
    if (this._retry !== null) {
      window.clearTimeout(this._retry);
      this._retry = null;
    }
    const ws = this._ws;
    this._ws = null;
    if (ws) {
      ws.onclose = null;
      ws.onmessage = null;
      ws.onerror = null;
      ws.close();
    }
    this._setConnection('offline');
  }

  private _connect(): void {
    if (!this._active || this._ws) {
      return;
    }
    let url = URLExt.join(this._settings.wsUrl, 'gpushare/api/events');
    const token = this._settings.token;
    if (token && (this._settings as { appendToken?: boolean }).appendToken !== false) {
      url += `?token=${encodeURIComponent(token)}`;
    }
    this._setConnection('connecting');
    let ws: WebSocket;
    try {
      ws = new this._settings.WebSocket(url);
    } catch (err) {
      this._scheduleReconnect();
      return;
    }
    this._ws = ws;
    ws.onopen = () => {
      this._backoff = BACKOFF_FIRST_MS;
      this._setConnection('live');
    };
    ws.onmessage = (event: MessageEvent) => {
      let msg: { type?: string; status?: IStatus; status_code?: number; message?: string };
      try {
        msg = JSON.parse(String(event.data));
      } catch {
        return;
      }
      this._generation++;
      if (msg.type === 'status' && msg.status) {
        this._setFetched({ kind: 'status', status: msg.status });
      } else if (msg.type === 'error') {
        this._setFetched({
          kind: 'error',
          statusCode: msg.status_code ?? 503,
          message: msg.message ?? ''
        });
      }
    };
    ws.onerror = () => {
      /* onclose follows */
    };
    ws.onclose = () => {
      if (this._ws === ws) {
        this._ws = null;
      }
      this._scheduleReconnect();
    };
  }

  private _scheduleReconnect(): void {
    if (!this._active || this._retry !== null) {
      return;
    }
    this._setConnection('connecting');
    const delay = this._backoff;
    this._backoff = Math.min(this._backoff * 2, BACKOFF_MAX_MS);
    this._retry = window.setTimeout(() => {
      this._retry = null;
      // The REST answer says why (e.g. 503) while the socket is down.
      void this.refresh();
      this._connect();
    }, delay);
  }

  private _setConnection(state: Connection): void {
    if (this._connection !== state) {
      this._connection = state;
      this._render();
    }
  }

  private _setFetched(fetched: Fetched): void {
    this._fetched = fetched;
    this._render();
  }

  // ------------------------------------------------------------------------------------------
  // Actions

  private async _act(row: IKernelRow, action: Action): Promise<void> {
    if (!row.kernelId) {
      return;
    }
    if (action === 'evict') {
      // Evicting acts on someone's kernel (an admin's action): say what it does first.
      const answer = await showDialog({
        title: this._trans.__('Evict %1?', row.name),
        body: this._trans.__(
          '%1 (%2) gives the GPU back and its memory (%3 on the GPU) is moved to host memory; ' +
            'its next GPU call waits for a turn and restores it.',
          row.name,
          row.user,
          formatBytes(row.residentBytes)
        ),
        buttons: [
          Dialog.cancelButton({ label: this._trans.__('Cancel') }),
          Dialog.warnButton({ label: this._trans.__('Evict') })
        ]
      });
      if (!answer.button.accept) {
        return;
      }
    }
    const url = URLExt.join(
      this._settings.baseUrl,
      'gpushare/api/kernels',
      encodeURIComponent(row.kernelId),
      action
    );
    this._busy.add(`${action}:${row.id}`);
    this._render();
    try {
      const response = await ServerConnection.makeRequest(
        url,
        { method: 'POST', body: '{}' },
        this._settings
      );
      this._feedback = response.ok
        ? `${action === 'release' ? 'Released' : 'Evicted'} ${row.name}.`
        : `Could not ${action} ${row.name}: ${await errorMessage(response)}`;
    } catch (err) {
      this._feedback = `Could not ${action} ${row.name}: ${err}`;
    } finally {
      this._busy.delete(`${action}:${row.id}`);
    }
    if (!this._ws) {
      await this.refresh();
    }
    this._render();
  }

  // ------------------------------------------------------------------------------------------
  // Rendering

  /** The panel's content: rendered once, then again (by the signal) at each update. */
  protected render(): JSX.Element {
    return (
      <UseSignal signal={this._changed} initialArgs={this._state()}>
        {(_, state) => <Sidebar state={state!} onRefresh={this._onRefresh} />}
      </UseSignal>
    );
  }

  private _state(): ISidebarState {
    return {
      model: buildViewModel(this._fetched),
      connection: this._connection,
      feedback: this._feedback,
      ctx: {
        trans: this._trans,
        history: this._history,
        busy: new Set(this._busy),
        act: this._onAct
      }
    };
  }

  /** Something the panel shows changed (or time passed: waits grow): render it. */
  private _render(): void {
    this._changed.emit(this._state());
  }

  private _settings: ServerConnection.ISettings;
  private _fetched: Fetched = { kind: 'loading' };
  private _connection: Connection = 'offline';
  private _ws: WebSocket | null = null;
  private _retry: number | null = null;
  private _ticker: number | null = null;
  private _backoff = BACKOFF_FIRST_MS;
  private _active = false;
  private _generation = 0;
  private _busy = new Set<string>();
  private _trans: TranslationBundle;
  private _history: IHistory | null = null;
  private _ticks = 0;
  private _feedback: string | null = null;
  private _onVisibility: () => void;
  private _onRefresh: () => void;
  private _onAct: (row: IKernelRow, action: Action) => void;
  private _changed = new Signal<this, ISidebarState>(this);
}

/** The last hour (GET gpushare/api/history), or null when the server gives none. */
async function fetchHistory(settings: ServerConnection.ISettings): Promise<IHistory | null> {
  const url = URLExt.join(settings.baseUrl, 'gpushare/api/history');
  try {
    const response = await ServerConnection.makeRequest(url, {}, settings);
    return response.ok ? ((await response.json()) as IHistory) : null;
  } catch {
    return null;
  }
}

async function errorMessage(response: Response): Promise<string> {
  try {
    const body = await response.json();
    if (body && typeof body.message === 'string' && body.message) {
      return body.message;
    }
  } catch {
    /* not JSON */
  }
  return `${response.status} ${response.statusText}`;
}
