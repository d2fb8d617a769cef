import { CellHinter, HINT_DEBOUNCE_MS, HINT_MIN_INTERVAL_MS, IHintClock, wantsHint } from '../hint';
import { buildViewModel } from '../model';
import { mine, MiB, NOW, vm } from './fixtures';

/** A clock whose timers run when the test advances it. */
class FakeClock implements IHintClock {
  t = 0;
  private _timers = new Map<number, { at: number; fn: () => void }>();
  private _next = 1;
  now(): number {
    return this.t;
  }
  setTimeout(fn: () => void, ms: number): number {
    const id = this._next++;
    this._timers.set(id, { at: this.t + ms, fn });
    return id;
  }
  clearTimeout(handle: number): void {
    this._timers.delete(handle);
  }
  advance(ms: number): void {
    this.t += ms;
    for (const [id, timer] of [...this._timers].sort((a, b) => a[1].at - b[1].at)) {
      if (timer.at <= this.t) {
        this._timers.delete(id);
        timer.fn();
      }
    }
  }
}

const away = vm([mine('k1', { evicted_bytes: 60 * MiB }), mine('k2')]);

describe('wantsHint', () => {
  it('hints for my kernel whose memory is away, evicted or asleep', () => {
    expect(wantsHint(away, 'k1')).toBe(true);
    expect(wantsHint(vm([mine('k1', { state: 'asleep' })]), 'k1')).toBe(true);
  });

  it('does not hint where the memory is on the GPU, the kernel unknown or the status failed', () => {
    expect(wantsHint(away, 'k2')).toBe(false); // all of it resident
    expect(wantsHint(away, 'other')).toBe(false); // not GPU-shared (or not mine)
    expect(wantsHint(away, null)).toBe(false);
    expect(wantsHint(null, 'k1')).toBe(false);
    const failed = buildViewModel({ kind: 'error', statusCode: 503, message: '' }, NOW);
    expect(wantsHint(failed, 'k1')).toBe(false);
  });
});

describe('CellHinter', () => {
  it('sends one hint after the typing pauses, not one per key', () => {
    const clock = new FakeClock();
    const sent: string[] = [];
    const hinter = new CellHinter(k => sent.push(k), clock);
    for (let i = 0; i < 20; i++) {
      hinter.activity(away, 'k1');
      clock.advance(HINT_DEBOUNCE_MS / 4);
    }
    expect(sent).toEqual([]);
    clock.advance(HINT_DEBOUNCE_MS);
    expect(sent).toEqual(['k1']);
  });

  it('sends at most one hint per kernel in the minimum interval, then again', () => {
    const clock = new FakeClock();
    const sent: string[] = [];
    const hinter = new CellHinter(k => sent.push(k), clock);
    hinter.activity(away, 'k1');
    clock.advance(HINT_DEBOUNCE_MS);
    hinter.activity(away, 'k1');
    clock.advance(HINT_DEBOUNCE_MS);
    expect(sent).toEqual(['k1']);
    clock.advance(HINT_MIN_INTERVAL_MS);
    hinter.activity(away, 'k1');
    clock.advance(HINT_DEBOUNCE_MS);
    expect(sent).toEqual(['k1', 'k1']);
  });

  it('keeps kernels apart and sends nothing for resident memory', () => {
    const clock = new FakeClock();
    const sent: string[] = [];
    const hinter = new CellHinter(k => sent.push(k), clock);
    const both = vm([mine('k1', { evicted_bytes: MiB }), mine('k3', { state: 'asleep' })]);
    hinter.activity(both, 'k1');
    hinter.activity(both, 'k3');
    hinter.activity(both, 'k2');
    clock.advance(HINT_DEBOUNCE_MS);
    expect(sent.sort()).toEqual(['k1', 'k3']);
  });

  it('drops pending hints when disposed', () => {
    const clock = new FakeClock();
    const sent: string[] = [];
    const hinter = new CellHinter(k => sent.push(k), clock);
    hinter.activity(away, 'k1');
    hinter.dispose();
    clock.advance(HINT_DEBOUNCE_MS * 2);
    expect(sent).toEqual([]);
  });
});
