/**
 * Cell hints: tell the scheduler that a cell is about to run (POST
 * gpushare/api/kernels/{id}/hint), so that a kernel whose memory left the GPU while its notebook
 * was idle gets it back before the cell rather than after (docs/architecture.md, "Cell hints").
 *
 * A hint goes out when a code cell of a notebook whose kernel is GPU-shared gets the focus or an
 * edit while that kernel's memory is away (evicted or asleep, as the status document the sidebar
 * already fetches says), once the user has paused for `debounceMs` (typing sends one hint, not
 * one per key), and at most once per kernel in `minIntervalMs` (the scheduler also limits each
 * user's hints). Pure: index.ts gives it the timers, the clock and the request.
 */
import { IKernelRow, IViewModel } from './model';

/** A pause in the focus and edits of at least this long before the hint goes out. */
export const HINT_DEBOUNCE_MS = 400;
/** At most one hint per kernel in this long (the scheduler refills a user's hints every 10 s). */
export const HINT_MIN_INTERVAL_MS = 10_000;

/** Whether a row's memory is away from the GPU: evicted (some or all of it) or asleep. */
export function memoryAway(row: IKernelRow): boolean {
  return row.evictedBytes > 0 || row.state === 'asleep' || row.state === 'evicted';
}

/** My GPU-shared kernel with this Jupyter kernel id in the view model, or null. */
export function kernelRow(model: IViewModel | null, kernelId: string): IKernelRow | null {
  for (const dev of model?.devices ?? []) {
    for (const row of dev.mine) {
      if (row.kernelId === kernelId) {
        return row;
      }
    }
  }
  return null;
}

/** Whether a focus or an edit in a code cell of the kernel `kernelId` is worth a hint now. */
export function wantsHint(model: IViewModel | null, kernelId: string | null): boolean {
  if (!kernelId || model?.state !== 'ok') {
    return false;
  }
  const row = kernelRow(model, kernelId);
  return row !== null && memoryAway(row);
}

export interface IHintClock {
  now(): number;
  setTimeout(fn: () => void, ms: number): number;
  clearTimeout(handle: number): void;
}

/** Debounces the focus and edit activity of code cells into hints, per kernel. */
export class CellHinter {
  constructor(
    private _send: (kernelId: string) => void,
    private _clock: IHintClock,
    private _debounceMs: number = HINT_DEBOUNCE_MS,
    private _minIntervalMs: number = HINT_MIN_INTERVAL_MS
  ) {}

  /**
   * A code cell of the kernel `kernelId` got the focus or an edit; `model` is the newest view
   * of the status. Nothing is sent for a kernel whose memory is on the GPU, or unknown.
   */
  activity(model: IViewModel | null, kernelId: string | null): void {
    if (!kernelId || !wantsHint(model, kernelId)) {
      return;
    }
    const pending = this._pending.get(kernelId);
    if (pending !== undefined) {
      this._clock.clearTimeout(pending);
    }
    const handle = this._clock.setTimeout(() => this._fire(kernelId), this._debounceMs);
    this._pending.set(kernelId, handle);
  }

  /** Drop every pending hint (the extension is stopping). */
  dispose(): void {
    for (const handle of this._pending.values()) {
      this._clock.clearTimeout(handle);
    }
    this._pending.clear();
  }

  private _fire(kernelId: string): void {
    this._pending.delete(kernelId);
    const now = this._clock.now();
    const last = this._sent.get(kernelId);
    if (last !== undefined && now - last < this._minIntervalMs) {
      return;
    }
    this._sent.set(kernelId, now);
    this._send(kernelId);
  }

  private _pending = new Map<string, number>();
  private _sent = new Map<string, number>();
}
