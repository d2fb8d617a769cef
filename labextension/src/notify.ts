/**
 * What to tell the user between two looks at the status document: "your turn came", "your idle
 * kernel was moved off the GPU / put to sleep", "your kernel is near its quota"; and the status
 * bar's one-line summary of my kernels. Pure: view models in, notices out (index.ts shows them
 * with JupyterLab's Notification API; __tests__/notify.spec.ts checks them).
 */
import { formatBytes, formatDuration, formatPercent, IKernelRow, IViewModel } from './model';

/** The settings of schema/plugin.json that decide which notices are raised. */
export interface INotifyPrefs {
  /** "Your turn came" after a wait of at least `turnAfterSeconds`. */
  notifyTurn: boolean;
  turnAfterSeconds: number;
  /** An idle kernel of mine was evicted (memory moved to the host) or put to sleep. */
  notifyEvicted: boolean;
  /** A kernel of mine reached the quota warning (model.QUOTA_WARNING of its quota). */
  notifyQuota: boolean;
}

export const DEFAULT_PREFS: INotifyPrefs = {
  notifyTurn: true,
  turnAfterSeconds: 10,
  notifyEvicted: true,
  notifyQuota: true
};

export type NoticeKind = 'turn' | 'evicted' | 'asleep' | 'quota';

export interface INotice {
  kind: NoticeKind;
  /** The kernel (scheduler client id) it is about. */
  clientId: string;
  level: 'info' | 'success' | 'warning';
  text: string;
}

/** A translation function (ITranslator's `__`); identity by default. */
export type Translate = (msg: string, ...args: unknown[]) => string;

const identity: Translate = (msg: string, ...args: unknown[]) =>
  msg.replace(/%(\d+)/g, (_, i: string) => String(args[Number(i) - 1]));

function myRows(model: IViewModel): Map<string, IKernelRow> {
  const rows = new Map<string, IKernelRow>();
  for (const dev of model.devices) {
    for (const row of dev.mine) {
      rows.set(row.id, row);
    }
  }
  return rows;
}

/** Whether a row is asleep (its process checkpointed by the driver: GPUSHARE_STATE_ASLEEP). */
export function isAsleep(row: IKernelRow): boolean {
  return row.state === 'asleep';
}

/**
 * The notices between the view model seen before (`prev`, null at the first look: nothing is
 * raised for what was already so) and now.
 */
export function noticesBetween(
  prev: IViewModel | null,
  next: IViewModel,
  prefs: INotifyPrefs = DEFAULT_PREFS,
  __: Translate = identity
): INotice[] {
  if (prev === null) {
    return [];
  }
  const before = myRows(prev);
  const out: INotice[] = [];
  for (const [id, row] of myRows(next)) {
    const old = before.get(id);
    if (!old) {
      continue;
    }
    // The turn came: no longer waiting, and it holds the GPU or has used it since (a short
    // turn may end between two looks); an interrupted wait used none.
    const served = row.role === 'holder' || row.gpuSeconds > old.gpuSeconds;
    if (
      prefs.notifyTurn &&
      old.role === 'waiter' &&
      row.role !== 'waiter' &&
      served &&
      (old.waitingFor ?? 0) >= prefs.turnAfterSeconds
    ) {
      out.push({
        kind: 'turn',
        clientId: id,
        level: 'success',
        text: __('Your turn: %1 got the GPU after waiting %2.', row.name,
          formatDuration(old.waitingFor))
      });
    }
    if (prefs.notifyEvicted && row.role === 'idle') {
      if (isAsleep(row) && !isAsleep(old)) {
        out.push({
          kind: 'asleep',
          clientId: id,
          level: 'info',
          text: __(
            'Your idle kernel %1 was put to sleep: its GPU memory is saved, and it wakes at its next GPU call.',
            row.name
          )
        });
      } else if (!isAsleep(row) && row.evictedBytes > 0 && old.evictedBytes === 0) {
        out.push({
          kind: 'evicted',
          clientId: id,
          level: 'info',
          text: __(
            'Your idle kernel %1 was moved off the GPU: %2 now in host memory, restored at its next GPU call.',
            row.name,
            formatBytes(row.evictedBytes)
          )
        });
      }
    }
    if (prefs.notifyQuota && row.nearQuota && !old.nearQuota) {
      out.push({
        kind: 'quota',
        clientId: id,
        level: 'warning',
        text: __(
          '%1 uses %2 of its %3 quota (%4): allocations past the quota fail with out of memory.',
          row.name,
          formatBytes(row.usedBytes),
          formatBytes(row.quotaBytes),
          formatPercent(row.quotaFraction)
        )
      });
    }
  }
  return out;
}

/** The status bar's text: my kernels' states, or why there is nothing to show. */
export function statusBarText(model: IViewModel, __: Translate = identity): string {
  if (model.state === 'no-gpu') {
    return __('GPU: no NVIDIA GPU found');
  }
  if (model.state === 'no-scheduler' || model.state === 'error') {
    return __('GPU: unavailable');
  }
  if (model.state === 'loading') {
    return __('GPU: …');
  }
  const counts = { running: 0, waiting: 0, idle: 0, evicted: 0, asleep: 0 };
  for (const row of myRows(model).values()) {
    if (row.role === 'holder') {
      counts.running++;
    } else if (row.role === 'waiter') {
      counts.waiting++;
    } else if (isAsleep(row)) {
      counts.asleep++;
    } else if (row.evictedBytes > 0) {
      counts.evicted++;
    } else {
      counts.idle++;
    }
  }
  const parts: string[] = [];
  const words: [number, string][] = [
    [counts.running, __('%1 running', counts.running)],
    [counts.waiting, __('%1 waiting', counts.waiting)],
    [counts.idle, __('%1 idle', counts.idle)],
    [counts.evicted, __('%1 evicted', counts.evicted)],
    [counts.asleep, __('%1 asleep', counts.asleep)]
  ];
  for (const [count, word] of words) {
    if (count) {
      parts.push(word);
    }
  }
  return parts.length ? __('GPU: %1', parts.join(', ')) : __('GPU: no kernel of yours');
}
