import { buildViewModel } from '../model';
import { DEFAULT_PREFS, noticesBetween, statusBarText } from '../notify';
import { mine, MiB, NOW, vm } from './fixtures';

const waiting = (id: string, since: number) =>
  mine(id, { state: 'waiting', waiting_since: NOW - since, queue_position: 1 });

describe('noticesBetween', () => {
  it('raises nothing at the first look, whatever is already so', () => {
    const model = vm([mine('a', { state: 'running' }), mine('b', { evicted_bytes: 50 * MiB })]);
    expect(noticesBetween(null, model)).toEqual([]);
  });

  it('says "your turn" when a long wait ends, and not after a short one', () => {
    const before = vm([waiting('a', 14), waiting('b', 3)]);
    const after = vm([mine('a', { state: 'running' }), mine('b', { state: 'running' })]);
    const notices = noticesBetween(before, after);
    expect(notices).toEqual([
      {
        kind: 'turn',
        clientId: 'a',
        level: 'success',
        text: 'Your turn: a.ipynb got the GPU after waiting 14s.'
      }
    ]);
    // The threshold is a setting.
    const low = noticesBetween(before, after, { ...DEFAULT_PREFS, turnAfterSeconds: 2 });
    expect(low.map(n => n.clientId)).toEqual(['a', 'b']);
    // And the notice can be switched off.
    expect(noticesBetween(before, after, { ...DEFAULT_PREFS, notifyTurn: false })).toEqual([]);
  });

  it('sees a turn that ended between two looks, but not an interrupted wait', () => {
    const before = vm([waiting('a', 20), waiting('b', 20)]);
    const after = vm([mine('a', { gpu_seconds: 1.5 }), mine('b')]);
    expect(noticesBetween(before, after).map(n => [n.kind, n.clientId])).toEqual([['turn', 'a']]);
  });

  it('tells of an idle kernel moved off the GPU or put to sleep, once', () => {
    const before = vm([mine('a'), mine('b')]);
    const after = vm([mine('a', { evicted_bytes: 84 * MiB }), mine('b', { state: 'asleep' })]);
    const notices = noticesBetween(before, after);
    expect(notices.map(n => [n.kind, n.clientId])).toEqual([
      ['evicted', 'a'],
      ['asleep', 'b']
    ]);
    expect(notices[0].text).toContain('a.ipynb was moved off the GPU: 84 MiB now in host memory');
    expect(notices[1].text).toContain('b.ipynb was put to sleep');
    expect(noticesBetween(after, after)).toEqual([]);
    expect(noticesBetween(before, after, { ...DEFAULT_PREFS, notifyEvicted: false })).toEqual([]);
  });

  it('warns when a kernel reaches its quota warning', () => {
    const before = vm([mine('a', { used_bytes: 100 * MiB, quota_bytes: 128 * MiB })]);
    const after = vm([mine('a', { used_bytes: 120 * MiB, quota_bytes: 128 * MiB })]);
    const [notice, ...rest] = noticesBetween(before, after);
    expect(rest).toEqual([]);
    expect(notice.level).toBe('warning');
    expect(notice.text).toBe(
      'a.ipynb uses 120 MiB of its 128 MiB quota (94%): allocations past the quota fail with ' +
        'out of memory.'
    );
    expect(noticesBetween(before, after, { ...DEFAULT_PREFS, notifyQuota: false })).toEqual([]);
  });

  it('passes its strings through the translator', () => {
    const before = vm([waiting('a', 30)]);
    const after = vm([mine('a', { state: 'running' })]);
    const upper = (msg: string, ...args: unknown[]) =>
      msg.toUpperCase().replace(/%(\d)/g, (_, i: string) => String(args[Number(i) - 1]));
    expect(noticesBetween(before, after, DEFAULT_PREFS, upper)[0].text).toBe(
      'YOUR TURN: a.ipynb GOT THE GPU AFTER WAITING 30s.'
    );
  });
});

describe('statusBarText', () => {
  it("counts my kernels' states", () => {
    const model = vm([
      mine('a', { state: 'running' }),
      waiting('b', 5),
      waiting('c', 1),
      mine('d', { evicted_bytes: 10 * MiB }),
      mine('e', { state: 'asleep' }),
      mine('f')
    ]);
    expect(statusBarText(model)).toBe('GPU: 1 running, 2 waiting, 1 idle, 1 evicted, 1 asleep');
  });

  it('says when there is no GPU, no scheduler, or nothing of mine', () => {
    expect(statusBarText(buildViewModel({ kind: 'status', status: { nvml: 'no NVML', devices: [] } }))).toBe(
      'GPU: no NVIDIA GPU found'
    );
    expect(
      statusBarText(buildViewModel({ kind: 'error', statusCode: 503, message: 'down' }))
    ).toBe('GPU: unavailable');
    expect(statusBarText(vm([]))).toBe('GPU: no kernel of yours');
  });
});
