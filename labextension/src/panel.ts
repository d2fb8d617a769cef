/**
 * The sidebar widget: fetches the status document, follows the events websocket while shown,
 * and renders the view model (model.ts) with plain DOM (dom.ts). Other users' places and rows
 * are others.ts's, the sparklines sparkline_view.ts's; the toasts and the status-bar item are
 * the plugin's (index.ts, from notify.ts's notices).
 */
import { Dialog, showDialog } from '@jupyterlab/apputils';
import { URLExt } from '@jupyterlab/coreutils';
import { ITranslator, nullTranslator, TranslationBundle } from '@jupyterlab/translation';
import { ServerConnection } from '@jupyterlab/services';
import { Message } from '@lumino/messaging';
import { Widget } from '@lumino/widgets';

import { el, groupOf, swatch } from './dom';
import {
  buildViewModel,
  Fetched,
  formatBytes,
  formatDuration,
  formatPercent,
  IDeviceView,
  IUnregisteredRow,
  IKernelRow,
  IPlace,
  IStatus,
  IViewModel
} from './model';
import { renderOthers, renderPlace } from './others';
import { IHistory } from './sparkline';
import { deviceSparkRow, fetchHistory, kernelSparkRow } from './sparkline_view';

/** How often the panel fetches the history (the sparklines) while shown. */
const HISTORY_EVERY_TICKS = 5;

/** Reconnect delays of the events websocket: doubling from the first to the last. */
const BACKOFF_FIRST_MS = 500;
const BACKOFF_MAX_MS = 30000;

type Connection = 'offline' | 'connecting' | 'live';

export interface IPanelOptions {
  serverSettings?: ServerConnection.ISettings;
  /** JupyterLab's translator (its `jupyter_gpushare` domain); English without it. */
  translator?: ITranslator;
}

export class GPUSharePanel extends Widget {
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
    this._render();
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

  private async _act(row: IKernelRow, action: 'release' | 'evict'): Promise<void> {
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

  private _render(): void {
    const model = buildViewModel(this._fetched);
    const focused = document.activeElement as HTMLElement | null;
    const focusKey =
      focused && this.node.contains(focused) ? focused.getAttribute('data-focus-key') : null;

    const header = el(
      'div',
      { className: 'jp-gpushare-header' },
      el('h2', { className: 'jp-gpushare-title', text: this._trans.__('Shared GPU') }),
      el('span', {
        className: 'jp-gpushare-connection',
        'data-state': this._connection,
        role: 'status',
        'aria-label': `Live updates: ${this._connection}`,
        // Whether this panel follows the server, not whether a kernel talks to the scheduler.
        title:
          this._connection === 'live'
            ? 'This panel updates as the GPU status changes (kernels are listed below)'
            : this._connection === 'connecting'
              ? 'Reconnecting to live updates…'
              : 'Not following updates (panel hidden)',
        text: this._connection === 'live' ? 'live updates' : this._connection
      }),
      el('button', {
        className: 'jp-gpushare-button jp-gpushare-refresh',
        type: 'button',
        title: 'Refresh the GPU status now',
        'aria-label': 'Refresh the GPU status now',
        'data-focus-key': 'refresh',
        text: '⟳'
      })
    );
    header.querySelector('.jp-gpushare-refresh')!.addEventListener('click', () => {
      void this.refresh();
    });

    const body = el('div', { className: 'jp-gpushare-body' });
    if (model.message) {
      body.append(
        el('div', {
          className: 'jp-gpushare-message',
          'data-state': model.state,
          role: 'status',
          text: model.message
        })
      );
    }
    if (model.notice) {
      body.append(el('div', { className: 'jp-gpushare-notice', text: model.notice }));
    }
    if (model.warnings.length) {
      const list = el('ul', { className: 'jp-gpushare-warnings', role: 'alert' });
      for (const w of model.warnings) {
        list.append(el('li', { className: 'jp-gpushare-warning', text: `⚠ ${w.text}` }));
      }
      body.append(list);
    }
    if (this._feedback) {
      body.append(
        el('div', { className: 'jp-gpushare-feedback', role: 'status', text: this._feedback })
      );
    }
    for (const dev of model.devices) {
      body.append(this._renderDevice(dev));
    }
    if (model.unregistered.length) {
      body.append(renderUnregistered(model.unregistered));
    }

    this.node.replaceChildren(header, body);
    if (focusKey) {
      const again = this.node.querySelector<HTMLElement>(`[data-focus-key="${focusKey}"]`);
      again?.focus();
    }
  }

  private _renderDevice(dev: IDeviceView): HTMLElement {
    const used = dev.residentBytes;
    const section = el(
      'section',
      {
        className: 'jp-gpushare-device',
        'aria-label': `GPU ${dev.name}`,
        'data-uuid': dev.uuid
      },
      el(
        'div',
        { className: 'jp-gpushare-device-head' },
        el('span', { className: 'jp-gpushare-device-name', title: dev.uuid, text: dev.name }),
        el('span', {
          className: 'jp-gpushare-mode',
          'data-mode': dev.mode,
          title: dev.modeDescription,
          'aria-label': `Sharing mode: ${dev.modeLabel}. ${dev.modeDescription}`,
          text: dev.modeLabel
        })
      ),
      el('div', { className: 'jp-gpushare-summary', text: dev.summary })
    );

    // The memory pool as a stacked bar.
    const bar = el('div', {
      className: 'jp-gpushare-membar',
      role: 'progressbar',
      'aria-label': `Memory pool of ${dev.name}`,
      'aria-valuemin': 0,
      'aria-valuemax': dev.poolBytes,
      'aria-valuenow': Math.min(used, dev.poolBytes),
      'aria-valuetext':
        `${formatBytes(used)} of ${formatBytes(dev.poolBytes)} in use, ` +
        `${formatBytes(dev.evictedBytes)} evicted to host memory`
    });
    for (const seg of dev.segments) {
      const node = el('div', {
        className: `jp-gpushare-seg jp-gpushare-seg-${seg.kind}`,
        'data-mine': seg.mine,
        'data-user': seg.user,
        'data-color': seg.color >= 0 ? seg.color % 8 : null,
        title: seg.label
      });
      node.style.width = `${(seg.fraction * 100).toFixed(3)}%`;
      bar.append(node);
    }
    section.append(bar);
    section.append(
      el('div', {
        className: 'jp-gpushare-legend',
        text:
          `${formatBytes(used)} on the GPU · ${formatBytes(dev.freeBytes)} free` +
          (dev.evictedBytes ? ` · ${formatBytes(dev.evictedBytes)} on host` : '') +
          ` · pool ${formatBytes(dev.poolBytes)}` +
          (dev.totalBytes ? ` of ${formatBytes(dev.totalBytes)}` : '')
      })
    );
    if (dev.utilization !== null) {
      const u = Math.max(0, Math.min(100, dev.utilization));
      const ubar = el('div', {
        className: 'jp-gpushare-utilbar',
        role: 'progressbar',
        'aria-label': `Utilisation of ${dev.name}`,
        'aria-valuemin': 0,
        'aria-valuemax': 100,
        'aria-valuenow': Math.round(u),
        title: `Utilisation: ${Math.round(u)}%`
      });
      const fill = el('div', { className: 'jp-gpushare-utilfill' });
      fill.style.width = `${u}%`;
      ubar.append(fill);
      section.append(
        el('div', { className: 'jp-gpushare-label', text: `Utilisation ${Math.round(u)}%` }),
        ubar
      );
    }

    const deviceSpark = deviceSparkRow(this._history, dev, this._trans);
    if (deviceSpark) {
      section.append(deviceSpark);
    }

    if (dev.filtered) {
      // Other users' kernels are only summed: their holders and places in the queue by user.
      section.append(
        this._renderGroup('holders', this._trans.__('Holding the GPU'), dev.holders, dev.otherHolders),
        this._renderQueue(dev.queue, dev.waiters),
        this._renderGroup('idle', this._trans.__('Idle'), dev.idle),
        renderOthers(dev.others, this._trans)
      );
    } else {
      section.append(
        this._renderGroup('holders', this._trans.__('Holding the GPU'), dev.holders),
        this._renderGroup('waiters', this._trans.__('Waiting'), dev.waiters),
        this._renderGroup('idle', this._trans.__('Idle'), dev.idle)
      );
    }

    if (dev.mine.length) {
      const mine = el(
        'div',
        { className: 'jp-gpushare-mine', 'aria-label': 'My kernels on this GPU' },
        el('h3', { className: 'jp-gpushare-group-title', text: this._trans.__('My kernels') })
      );
      for (const row of dev.mine) {
        mine.append(this._renderQuota(row));
      }
      if (dev.myShare !== null) {
        mine.append(
          el('div', {
            className: 'jp-gpushare-share',
            text:
              `My share of GPU time: ${formatPercent(dev.myShare)}` +
              (dev.myWeightShare !== null
                ? ` (by weight: ${formatPercent(dev.myWeightShare)})`
                : '')
          })
        );
      }
      section.append(mine);
    }
    return section;
  }

  private _renderGroup(
    kind: string,
    title: string,
    rows: IKernelRow[],
    others: IPlace[] = []
  ): HTMLElement {
    const count = rows.length + others.length;
    const group = groupOf(kind, title, count);
    if (!count) {
      return group;
    }
    const list = el('ul', { className: 'jp-gpushare-kernels' });
    for (const row of rows) {
      list.append(this._renderKernel(row));
    }
    for (const place of others) {
      list.append(renderPlace(place, 'holder'));
    }
    group.append(list);
    return group;
  }

  /** A filtered document's queue, in order: the viewer's waiters and other users' places. */
  private _renderQueue(queue: IPlace[], waiters: IKernelRow[]): HTMLElement {
    const listed = new Set(queue.map(p => p.row?.id).filter(id => id !== undefined));
    // The viewer's waiters the queue does not name (e.g. waiting but not queued yet) go last.
    const rest = waiters.filter(r => !listed.has(r.id));
    const count = queue.length + rest.length;
    const group = groupOf('waiters', this._trans.__('Waiting'), count);
    if (!count) {
      return group;
    }
    const list = el('ul', { className: 'jp-gpushare-kernels' });
    for (const place of queue) {
      list.append(place.row ? this._renderKernel(place.row) : renderPlace(place, 'waiter'));
    }
    for (const row of rest) {
      list.append(this._renderKernel(row));
    }
    group.append(list);
    return group;
  }

  private _renderKernel(row: IKernelRow): HTMLElement {
    const roleText =
      row.role === 'holder'
        ? 'holds the GPU'
        : row.role === 'waiter'
          ? `waits${row.queuePosition !== null ? ` (#${row.queuePosition} in the queue)` : ''}`
          : 'idle';
    const details: string[] = [];
    if (!row.mine) {
      details.push(row.user);
    }
    if (row.role === 'waiter') {
      if (row.queuePosition !== null) {
        details.push(`#${row.queuePosition} in queue`);
      }
      details.push(`waiting ${formatDuration(row.waitingFor)}`);
    } else if (row.pastQuantum !== null) {
      details.push(`${formatDuration(row.pastQuantum)} past its turn`);
    } else if (row.state !== 'running' && row.state !== 'idle') {
      details.push(row.state);
    }
    details.push(formatBytes(row.usedBytes));
    if (row.evictedBytes) {
      details.push(`${formatBytes(row.evictedBytes)} on host`);
    }
    const item = el(
      'li',
      {
        className: 'jp-gpushare-kernel',
        'data-mine': row.mine,
        'data-role': row.role,
        'data-client-id': row.id,
        'data-near-quota': row.nearQuota,
        title: row.title,
        'aria-label': `${row.name}${row.mine ? ' (mine)' : ''}: ${roleText}`
      },
      swatch(row.color),
      el(
        'span',
        { className: 'jp-gpushare-kernel-text' },
        el('span', { className: 'jp-gpushare-kernel-name', text: row.name }),
        row.mine ? el('span', { className: 'jp-gpushare-badge', text: 'mine' }) : null,
        el('span', { className: 'jp-gpushare-kernel-meta', text: details.join(' · ') }),
        row.waitText
          ? el('span', {
              className: 'jp-gpushare-kernel-why',
              'data-reason': row.waitReason ?? '',
              text: row.waitText
            })
          : null
      )
    );
    const actions = el('span', { className: 'jp-gpushare-actions' });
    if (row.canRelease) {
      actions.append(this._button(row, 'release'));
    }
    if (row.canEvict) {
      actions.append(this._button(row, 'evict'));
    }
    if (actions.childElementCount) {
      item.append(actions);
    }
    return item;
  }

  private _button(row: IKernelRow, action: 'release' | 'evict'): HTMLButtonElement {
    const busy = this._busy.has(`${action}:${row.id}`);
    const title =
      action === 'release'
        ? `Release the GPU held by ${row.name}: its running work finishes, then others may run`
        : `Evict ${row.name}: release its GPU and move its memory to host memory (admin)`;
    const button = el('button', {
      className: `jp-gpushare-button jp-gpushare-${action}`,
      type: 'button',
      title,
      'aria-label': title,
      'data-focus-key': `${action}:${row.id}`,
      disabled: busy,
      text: action === 'release' ? this._trans.__('Release') : this._trans.__('Evict')
    });
    button.addEventListener('click', () => {
      void this._act(row, action);
    });
    return button;
  }

  private _renderQuota(row: IKernelRow): HTMLElement {
    const item = el(
      'div',
      { className: 'jp-gpushare-quota', 'data-near-quota': row.nearQuota },
      el('span', { className: 'jp-gpushare-kernel-name', text: row.name })
    );
    if (row.quotaBytes > 0) {
      const fraction = row.quotaFraction ?? 0;
      const bar = el('div', {
        className: 'jp-gpushare-quotabar',
        role: 'progressbar',
        'aria-label': `Memory of ${row.name} against its quota`,
        'aria-valuemin': 0,
        'aria-valuemax': row.quotaBytes,
        'aria-valuenow': Math.min(row.usedBytes, row.quotaBytes),
        'aria-valuetext': `${formatBytes(row.usedBytes)} of ${formatBytes(row.quotaBytes)}`
      });
      const fill = el('div', { className: 'jp-gpushare-quotafill' });
      fill.style.width = `${Math.min(100, fraction * 100).toFixed(2)}%`;
      bar.append(fill);
      item.append(
        el('span', {
          className: 'jp-gpushare-kernel-meta',
          text:
            `${formatBytes(row.usedBytes)} of ${formatBytes(row.quotaBytes)} quota ` +
            `(${formatPercent(fraction)})${row.nearQuota ? ' ⚠' : ''}`
        }),
        bar
      );
    } else {
      item.append(
        el('span', {
          className: 'jp-gpushare-kernel-meta',
          text: `${formatBytes(row.usedBytes)}, no quota`
        })
      );
    }
    if (row.gpuShare !== null) {
      item.append(
        el('span', {
          className: 'jp-gpushare-kernel-meta',
          text: `GPU time ${formatDuration(row.gpuSeconds)} (${formatPercent(row.gpuShare)})`
        })
      );
    }
    const sparks = kernelSparkRow(this._history, row);
    if (sparks) {
      item.append(sparks);
    }
    return item;
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

/** This server's GPU-shared kernels that are on no GPU yet, in the magic's words. */
function renderUnregistered(rows: IUnregisteredRow[]): HTMLElement {
  const list = el('ul', { className: 'jp-gpushare-kernels' });
  for (const row of rows) {
    list.append(
      el(
        'li',
        {
          className: 'jp-gpushare-kernel jp-gpushare-unregistered',
          'data-mine': true,
          'data-kernel-id': row.kernelId,
          'data-reason': row.reason,
          title: row.title
        },
        el(
          'span',
          { className: 'jp-gpushare-kernel-text' },
          el('span', { className: 'jp-gpushare-kernel-name', text: row.name }),
          el('span', { className: 'jp-gpushare-unregistered-text', text: row.text })
        )
      )
    );
  }
  return el(
    'section',
    { className: 'jp-gpushare-unregistered-section', 'aria-label': 'Kernels on no GPU yet' },
    el('h3', { className: 'jp-gpushare-group-title', text: 'GPU-shared kernels on no GPU yet' }),
    list
  );
}
