import {
  basename,
  buildViewModel,
  formatBytes,
  formatDuration,
  formatPercent,
  IClientStatus,
  IDeviceStatus,
  IStatus
} from '../model';

const MiB = 1 << 20;
const GiB = 1 << 30;
const NOW = 1_700_000_000;

function client(id: string, extra: Partial<IClientStatus> = {}): IClientStatus {
  return {
    id,
    pid: 100,
    uid: 1000,
    user: 'alice',
    label: `${id}.ipynb`,
    state: 'idle',
    used_bytes: 0,
    managed_bytes: 0,
    pinned_bytes: 0,
    evicted_bytes: 0,
    quota_bytes: 0,
    weight: 1,
    gpu_seconds: 0,
    wait_seconds: 0,
    waiting_since: null,
    queue_position: null,
    redacted: false,
    jupyter: { local: false, kernel_id: null },
    ...extra
  };
}

function mine(id: string, path: string, extra: Partial<IClientStatus> = {}): IClientStatus {
  return client(id, {
    label: path,
    jupyter: {
      local: true,
      kernel_id: id.split('#')[0],
      kernel_name: 'python3-gpushare',
      execution_state: 'busy',
      paths: [path],
      sessions: [{ id: 's', path, name: path, type: 'notebook' }],
      user: 'alice'
    },
    ...extra
  });
}

function device(clients: IClientStatus[], extra: Partial<IDeviceStatus> = {}): IDeviceStatus {
  return {
    uuid: 'GPU-1',
    name: 'NVIDIA H100 80GB HBM3',
    total_bytes: 80 * GiB,
    pool_bytes: GiB,
    resident_bytes: 0,
    mode: 'turns',
    quantum_ms: 5000,
    holders: [],
    queue: [],
    clients,
    ...extra
  };
}

function status(devices: IDeviceStatus[], extra: Partial<IStatus> = {}): IStatus {
  return {
    version: '0.1.0',
    socket: '/tmp/s.sock',
    nvml: true,
    devices,
    viewer: { name: 'alice', admin: false },
    scheduler: { mode: 'embedded', requested: 'auto', socket: '/tmp/s.sock', error: null },
    ...extra
  };
}

function vm(s: IStatus) {
  return buildViewModel({ kind: 'status', status: s }, NOW);
}

/** The scenario of the end-to-end test: A holds, B waits, C idles (someone else's). */
function turns(): IStatus {
  return status([
    device(
      [
        mine('ka', 'work/a.ipynb', {
          state: 'running',
          used_bytes: 700 * MiB,
          gpu_seconds: 30
        }),
        mine('kb', 'b.ipynb', {
          state: 'waiting',
          used_bytes: 700 * MiB,
          evicted_bytes: 684 * MiB,
          waiting_since: NOW - 65,
          queue_position: 1,
          gpu_seconds: 10
        }),
        client('kc', {
          user: 'bob',
          uid: 1001,
          label: '',
          redacted: true,
          used_bytes: 100 * MiB,
          gpu_seconds: 60
        })
      ],
      { holders: ['ka'], queue: ['kb'], resident_bytes: 816 * MiB }
    )
  ]);
}

describe('formatting', () => {
  it('formats bytes with 1024-based units', () => {
    expect(formatBytes(0)).toBe('0 B');
    expect(formatBytes(512)).toBe('512 B');
    expect(formatBytes(1024)).toBe('1 KiB');
    expect(formatBytes(1.5 * GiB)).toBe('1.5 GiB');
    expect(formatBytes(700 * MiB)).toBe('700 MiB');
    expect(formatBytes(80 * GiB)).toBe('80 GiB');
    expect(formatBytes(85520809984)).toBe('79.6 GiB');
    expect(formatBytes(undefined)).toBe('?');
    expect(formatBytes(-5)).toBe('0 B');
  });

  it('formats waits', () => {
    expect(formatDuration(0)).toBe('0s');
    expect(formatDuration(4.9)).toBe('4s');
    expect(formatDuration(65)).toBe('1m 05s');
    expect(formatDuration(3 * 3600 + 3 * 60)).toBe('3h 03m');
    expect(formatDuration(null)).toBe('?');
  });

  it('formats percentages and paths', () => {
    expect(formatPercent(0.904)).toBe('90%');
    expect(formatPercent(null)).toBe('?');
    expect(basename('work/deep/a.ipynb')).toBe('a.ipynb');
    expect(basename('a.ipynb')).toBe('a.ipynb');
  });
});

describe('holders, waiters and idle kernels', () => {
  it('sorts clients into who holds, who waits (in queue order, for how long), who idles', () => {
    const m = vm(turns());
    expect(m.state).toBe('ok');
    expect(m.message).toBeNull();
    const [d] = m.devices;
    expect(d.holders.map(r => r.name)).toEqual(['a.ipynb']);
    expect(d.waiters.map(r => r.name)).toEqual(['b.ipynb']);
    expect(d.waiters[0].queuePosition).toBe(1);
    expect(d.waiters[0].waitingFor).toBe(65);
    expect(d.idle.map(r => r.id)).toEqual(['kc']);
    expect(d.modeLabel).toBe('turns');
    expect(d.summary).toBe('a.ipynb holds the GPU; 1 waiting.');
    expect(d.quantumSeconds).toBe(5);
  });

  it("says why a waiter waits and how far a long holder is past its quantum", () => {
    const s = turns();
    const [dev] = s.devices ?? [];
    const [ka, kb] = dev.clients;
    ka.held_seconds = 300;
    ka.quantum_seconds = 60;
    ka.revoking_seconds = 200;
    kb.wait = {
      reason: 'releasing',
      text: "waiting for alice's kernel to finish its GPU work: asked to release 3 min ago, 4 min past its 60 s quantum",
      holders: [{ id: 'ka', user: 'alice', state: 'revoking', past_quantum_seconds: 240 }]
    };
    const [d] = vm(s).devices;
    expect(d.waiters[0].waitReason).toBe('releasing');
    expect(d.waiters[0].waitText).toContain('4 min past its 60 s quantum');
    expect(d.holders[0].pastQuantum).toBe(240);
    expect(d.holders[0].waitText).toBeNull();
    expect(d.idle[0].pastQuantum).toBeNull();
  });

  it('does not call a holder long when nobody waits for it', () => {
    const s = turns();
    const [dev] = s.devices ?? [];
    const [ka] = dev.clients;
    ka.held_seconds = 300;
    ka.quantum_seconds = 60;
    dev.queue = [];
    expect(vm(s).devices[0].holders[0].pastQuantum).toBeNull();
  });

  it('orders waiters by queue position', () => {
    const s = status([
      device(
        [
          client('x', { state: 'waiting', queue_position: 2 }),
          client('y', { state: 'waiting', queue_position: 1 }),
          client('h', { state: 'running' })
        ],
        { holders: ['h'], queue: ['y', 'x'] }
      )
    ]);
    expect(vm(s).devices[0].waiters.map(r => r.id)).toEqual(['y', 'x']);
  });

  it('falls back to the queue list and wait_seconds', () => {
    const s = status([
      device([client('w', { state: 'waiting', queue_position: null, wait_seconds: 3 })], {
        queue: ['w']
      })
    ]);
    const [w] = vm(s).devices[0].waiters;
    expect(w.queuePosition).toBe(1);
    expect(w.waitingFor).toBe(3);
    expect(vm(s).devices[0].summary).toBe('1 waiting for the GPU.');
  });

  it('says when nobody uses the GPU', () => {
    const d = vm(status([device([], { mode: 'shared' })])).devices[0];
    expect(d.summary).toBe('No kernel uses this GPU.');
    expect(d.modeLabel).toBe('shared');
    expect(d.segments).toEqual([
      expect.objectContaining({ kind: 'free', bytes: GiB, fraction: 1 })
    ]);
    const idle = vm(status([device([client('i')], { mode: 'shared' })])).devices[0];
    expect(idle.summary).toBe('The GPU is free: every kernel is idle.');
  });
});

describe('my kernels and redaction', () => {
  it('highlights this server kernels by jupyter.local and names them by notebook', () => {
    const d = vm(turns()).devices[0];
    expect(d.mine.map(r => r.id)).toEqual(['ka', 'kb']);
    const a = d.holders[0];
    expect(a.mine).toBe(true);
    expect(a.kernelId).toBe('ka');
    expect(a.title).toContain('work/a.ipynb');
    expect(a.canRelease).toBe(true);
    expect(a.canEvict).toBe(false);
    // Waiting kernels hold nothing to release.
    expect(d.waiters[0].canRelease).toBe(false);
  });

  it("shows other users' kernels by user only", () => {
    const c = vm(turns()).devices[0].idle[0];
    expect(c.redacted).toBe(true);
    expect(c.mine).toBe(false);
    expect(c.name).toBe("bob's kernel");
    expect(c.title).not.toContain('ipynb');
    expect(c.kernelId).toBeNull();
    expect(c.canRelease).toBe(false);
    expect(c.canEvict).toBe(false);
  });

  it('names subprocess clients and unredacted foreign clients by label', () => {
    const s = status(
      [
        device([
          mine('ka#42', 'a.ipynb', { state: 'running' }),
          client('kz', { label: 'other/z.ipynb', user: 'bob', state: 'idle', used_bytes: MiB })
        ])
      ],
      { viewer: { name: 'root', admin: true } }
    );
    const d = vm(s).devices[0];
    expect(d.holders[0].name).toBe('a.ipynb (subprocess 42)');
    expect(d.holders[0].kernelId).toBe('ka');
    const z = d.idle[0];
    expect(z.name).toBe('z.ipynb');
    expect(z.kernelId).toBe('kz');
    expect(z.canEvict).toBe(true);
  });

  it('lets admins evict and release any holder', () => {
    const s = turns();
    s.viewer = { name: 'admin', admin: true };
    const d = vm(s).devices[0];
    expect(d.holders[0].canEvict).toBe(true);
    expect(d.idle[0].canEvict).toBe(true);
    expect(vm(s).viewer.admin).toBe(true);
  });

  it('computes my share of GPU time', () => {
    const d = vm(turns()).devices[0];
    expect(d.myShare).toBeCloseTo(40 / 100);
    expect(d.holders[0].gpuShare).toBeCloseTo(0.3);
  });

  it('computes what the weights entitle me to', () => {
    const s = turns();
    const clients = s.devices![0].clients;
    const total = clients.length;
    const mine = clients.filter(c => c.jupyter?.local).length;
    expect(vm(s).devices[0].myWeightShare).toBeCloseTo(mine / total);
    // A weight-3 kernel of mine counts three times.
    const first = clients.find(c => c.jupyter?.local)!;
    first.weight = 3;
    expect(vm(s).devices[0].myWeightShare).toBeCloseTo((mine + 2) / (total + 2));
  });
});

describe('memory', () => {
  it('stacks resident memory per kernel, free, and evicted memory', () => {
    const d = vm(turns()).devices[0];
    const kinds = d.segments.map(s => `${s.kind}:${s.id ?? ''}`);
    expect(kinds).toEqual(['resident:ka', 'resident:kb', 'resident:kc', 'free:', 'evicted:kb']);
    const byId = Object.fromEntries(d.segments.map(s => [`${s.kind}:${s.id}`, s]));
    expect(byId['resident:kb'].bytes).toBe(16 * MiB);
    expect(byId['evicted:kb'].bytes).toBe(684 * MiB);
    expect(d.freeBytes).toBe(GiB - 816 * MiB);
    const total = d.segments.reduce((s, x) => s + x.fraction, 0);
    expect(total).toBeCloseTo(1);
    expect(byId['resident:ka'].mine).toBe(true);
    expect(byId['resident:kc'].mine).toBe(false);
  });

  it("counts a waiter that was never granted by its pinned memory, as the scheduler does", () => {
    const s = status([
      device(
        [
          mine('ka', 'a.ipynb', { state: 'running', used_bytes: 716 * MiB, pinned_bytes: 16 * MiB }),
          mine('kb', 'b.ipynb', {
            state: 'waiting',
            used_bytes: 716 * MiB,
            pinned_bytes: 16 * MiB,
            queue_position: 1
          })
        ],
        { holders: ['ka'], queue: ['kb'], resident_bytes: 732 * MiB }
      )
    ]);
    const d = vm(s).devices[0];
    expect(d.waiters[0].residentBytes).toBe(16 * MiB);
    expect(d.waiters[0].evictedBytes).toBe(700 * MiB);
    expect(d.freeBytes).toBe(GiB - 732 * MiB);
    expect(d.segments.map(x => `${x.kind}:${x.id ?? ''}`)).toEqual([
      'resident:ka',
      'resident:kb',
      'free:',
      'evicted:kb'
    ]);
  });

  it('warns near the quota (>= 90%) for my kernels only', () => {
    const s = status([
      device([
        mine('k1', 'near.ipynb', { used_bytes: 950 * MiB, quota_bytes: GiB }),
        mine('k2', 'far.ipynb', { used_bytes: 100 * MiB, quota_bytes: GiB }),
        mine('k3', 'exact.ipynb', { used_bytes: 0.9 * GiB, quota_bytes: GiB }),
        mine('k4', 'none.ipynb', { used_bytes: GiB, quota_bytes: 0 }),
        client('k5', { used_bytes: GiB, quota_bytes: GiB, redacted: true, user: 'bob' })
      ])
    ]);
    const m = vm(s);
    const rows = Object.fromEntries(m.devices[0].idle.map(r => [r.id, r]));
    expect(rows.k1.nearQuota).toBe(true);
    expect(rows.k1.quotaFraction).toBeCloseTo(0.928, 2);
    expect(rows.k2.nearQuota).toBe(false);
    expect(rows.k3.nearQuota).toBe(true);
    expect(rows.k4.quotaFraction).toBeNull();
    expect(rows.k4.nearQuota).toBe(false);
    expect(m.warnings.map(w => w.clientId)).toEqual(['k1', 'k3']);
    expect(m.warnings[0].text).toContain('near.ipynb uses 950 MiB of its 1 GiB quota (93%)');
  });

  it('reports utilisation when the scheduler sends it', () => {
    expect(vm(turns()).devices[0].utilization).toBeNull();
    const s = status([device([], { utilization_percent: 37 })]);
    expect(vm(s).devices[0].utilization).toBe(37);
  });
});

describe('several GPUs', () => {
  it('names each GPU by its index, with its own kernels', () => {
    const s = status([
      device([client('a', { state: 'running' })], { uuid: 'GPU-0', index: 0, holders: ['a'] }),
      device([client('b', { state: 'running' })], { uuid: 'GPU-1', index: 1, holders: ['b'] })
    ]);
    const model = vm(s);
    expect(model.devices.map(d => d.name)).toEqual([
      'GPU 0: NVIDIA H100 80GB HBM3',
      'GPU 1: NVIDIA H100 80GB HBM3'
    ]);
    expect(model.devices.map(d => d.index)).toEqual([0, 1]);
    expect(model.devices[0].holders.map(r => r.id)).toEqual(['a']);
    expect(model.devices[1].holders.map(r => r.id)).toEqual(['b']);
  });

  it('keeps the plain name for a single GPU or a GPU without an index', () => {
    expect(vm(status([device([], { index: 0 })])).devices[0].name).toBe(
      'NVIDIA H100 80GB HBM3'
    );
    const learnt = vm(status([device([]), device([], { uuid: 'GPU-2', index: 1 })]));
    expect(learnt.devices.map(d => [d.name, d.index])).toEqual([
      ['NVIDIA H100 80GB HBM3', null],
      ['GPU 1: NVIDIA H100 80GB HBM3', 1]
    ]);
  });
});

describe('no GPU, no scheduler', () => {
  it('says when there is no GPU (NVML error, no devices)', () => {
    const m = vm(status([], { nvml: 'NVML Shared Library Not Found' }));
    expect(m.state).toBe('no-gpu');
    expect(m.message).toContain('No NVIDIA GPU found');
    expect(m.message).toContain('NVML Shared Library Not Found');
    const none = vm(status([]));
    expect(none.state).toBe('no-gpu');
    expect(none.message).toContain('No GPU known yet');
  });

  it('lists GPU-shared kernels on no GPU yet, in the words of the magic', () => {
    const noGpu = vm(
      status([], {
        nvml: 'disabled',
        unregistered: [
          {
            kernel_id: 'k-0123456789',
            kernel_name: 'python3-gpushare',
            execution_state: 'idle',
            paths: ['work/a.ipynb'],
            reason: 'no-gpu',
            text: 'no NVIDIA GPU found: runs without a GPU'
          }
        ]
      })
    );
    expect(noGpu.state).toBe('no-gpu');
    expect(noGpu.unregistered).toEqual([
      {
        kernelId: 'k-0123456789',
        name: 'a.ipynb',
        title: 'work/a.ipynb (kernel k-0123456789, python3-gpushare)',
        reason: 'no-gpu',
        text: 'no NVIDIA GPU found: runs without a GPU'
      }
    ]);
    // Beside a device whose scheduler does not list it yet (no GPU call so far).
    const early = vm(
      status([device([mine('kb', 'b.ipynb')])], {
        unregistered: [
          {
            kernel_id: 'ka-5678901234',
            reason: 'no-gpu-call',
            text: 'not registered yet (at its first GPU call); holds no GPU'
          }
        ]
      })
    );
    expect(early.state).toBe('ok');
    expect(early.devices[0].mine.map(r => r.name)).toEqual(['b.ipynb']);
    expect(early.unregistered.map(r => [r.name, r.text])).toEqual([
      ['kernel ka-56789', 'not registered yet (at its first GPU call); holds no GPU']
    ]);
    expect(vm(status([])).unregistered).toEqual([]);
  });

  it('keeps devices learnt from kernels when NVML failed, with a notice', () => {
    const m = vm(status([device([])], { nvml: 'no driver' }));
    expect(m.state).toBe('ok');
    expect(m.notice).toContain('NVML unavailable (no driver)');
  });

  it('says when there is no scheduler (503 or scheduler.error)', () => {
    const m = buildViewModel({
      kind: 'error',
      statusCode: 503,
      message: 'cannot connect to /run/gpushare/scheduler.sock'
    });
    expect(m.state).toBe('no-scheduler');
    expect(m.message).toBe('No GPU scheduler: cannot connect to /run/gpushare/scheduler.sock');
    const e = vm(
      status([], {
        scheduler: { mode: 'node', requested: 'node', socket: '/x', error: 'it did not start' }
      })
    );
    expect(e.state).toBe('no-scheduler');
    expect(e.message).toBe('No GPU scheduler: it did not start');
  });

  it('explains other errors and the loading state', () => {
    expect(buildViewModel({ kind: 'loading' }).state).toBe('loading');
    expect(buildViewModel({ kind: 'error', statusCode: 404, message: '' }).message).toContain(
      'not enabled'
    );
    expect(buildViewModel({ kind: 'error', statusCode: 403, message: '' }).message).toContain(
      'not allowed'
    );
    const other = buildViewModel({ kind: 'error', statusCode: null, message: 'boom' });
    expect(other.state).toBe('error');
    expect(other.message).toBe('boom');
  });

  it('notes a truncated document', () => {
    const m = vm(status([device([], { clients_truncated: 300 })], { truncated: true }));
    expect(m.notice).toContain('Too many kernels');
    expect(m.devices[0].summary).toBe('300 kernels (too many to list)');
    expect(m.devices[0].truncated).toBe(300);
  });
});

/**
 * A node scheduler's document filtered for alice (docs/protocol.md "Who sees what"): her own
 * clients in full; bob (holding, and third in the queue) and carol (first in the queue) summed.
 */
function filtered(extra: Partial<IStatus> = {}): IStatus {
  return status(
    [
      device(
        [
          mine('ka', 'a.ipynb', { state: 'waiting', used_bytes: 200 * MiB, waiting_since: NOW - 5 }),
          mine('kb', 'b.ipynb', { state: 'idle', used_bytes: 50 * MiB, gpu_seconds: 10 })
        ],
        {
          holders: [],
          queue: ['ka'],
          resident_bytes: 550 * MiB,
          holder_users: ['bob'],
          queue_users: ['carol', 'alice', 'bob'],
          others: [
            {
              user: 'bob',
              clients: 2,
              running: 1,
              waiting: 1,
              used_bytes: 300 * MiB,
              resident_bytes: 200 * MiB,
              evicted_bytes: 100 * MiB,
              gpu_seconds: 40,
              wait_seconds: 3,
              weight: 2
            },
            {
              user: 'carol',
              clients: 1,
              running: 0,
              waiting: 1,
              used_bytes: 100 * MiB,
              resident_bytes: 100 * MiB,
              evicted_bytes: 0,
              gpu_seconds: 0,
              wait_seconds: 9,
              weight: 1
            }
          ]
        }
      )
    ],
    {
      identity: { user: 'alice', admin: false, by: 'token' },
      scheduler: { mode: 'node', requested: 'node', socket: '/run/gpushare.sock', error: null },
      ...extra
    }
  );
}

describe("other users' kernels in a filtered document", () => {
  it('says which other user holds the GPU and how many wait', () => {
    const d = vm(filtered()).devices[0];
    expect(d.filtered).toBe(true);
    expect(d.holders).toEqual([]);
    expect(d.otherHolders.map(p => [p.user, p.name, p.mine])).toEqual([
      ['bob', "bob's kernel", false]
    ]);
    expect(d.summary).toBe("bob's kernel holds the GPU; 3 waiting.");
  });

  it('lists the whole queue in order, other users by name, my kernel at its real place', () => {
    const d = vm(filtered()).devices[0];
    expect(d.queue.map(p => [p.position, p.user, p.mine, p.name])).toEqual([
      [1, 'carol', false, "carol's kernel"],
      [2, 'alice', true, 'a.ipynb'],
      [3, 'bob', false, "bob's kernel"]
    ]);
    // dev.queue lists only alice's waiter; without the client's own queue_position her place
    // counts everyone's queue.
    expect(d.queue[1].row?.id).toBe('ka');
    expect(d.waiters.map(r => [r.id, r.queuePosition])).toEqual([['ka', 2]]);
    expect(d.idle.map(r => r.id)).toEqual(['kb']);
  });

  it("keeps the scheduler's own queue_position for my waiters", () => {
    const doc = filtered();
    doc.devices![0].clients[0].queue_position = 2;
    expect(vm(doc).devices[0].waiters[0].queuePosition).toBe(2);
  });

  it('has a row per other user with kernel count, memory, place and GPU time', () => {
    const d = vm(filtered()).devices[0];
    expect(d.others.map(o => o.user)).toEqual(['bob', 'carol']);
    const [bob, carol] = d.others;
    expect(bob).toMatchObject({
      name: "bob's 2 kernels",
      kernels: 2,
      running: 1,
      waiting: 1,
      holding: 1,
      queuePositions: [3],
      usedBytes: 300 * MiB,
      residentBytes: 200 * MiB,
      evictedBytes: 100 * MiB,
      gpuSeconds: 40
    });
    expect(bob.gpuShare).toBeCloseTo(0.8);
    expect(carol).toMatchObject({ name: "carol's kernel", holding: 0, queuePositions: [1] });
    // Colours after alice's two kernels, distinct from hers.
    expect([bob.color, carol.color]).toEqual([2, 3]);
    expect(d.otherHolders[0].color).toBe(2);
    // My share counts everyone's GPU time and weights, not just mine.
    expect(d.myShare).toBeCloseTo(10 / 50);
    expect(d.myWeightShare).toBeCloseTo(2 / 5);
  });

  it("stacks other users' memory per user in the bar, apart from mine", () => {
    const d = vm(filtered()).devices[0];
    const kinds = d.segments.map(s => `${s.kind}:${s.id ?? s.user ?? ''}`);
    expect(kinds).toEqual([
      'resident:ka',
      'resident:kb',
      'resident:bob',
      'resident:carol',
      'free:',
      'evicted:bob'
    ]);
    const bob = d.segments[2];
    expect(bob).toMatchObject({ mine: false, user: 'bob', id: null, bytes: 200 * MiB, color: 2 });
    expect(bob.label).toBe("bob's 2 kernels: 200 MiB on the GPU");
    expect(d.segments[5].label).toBe("bob's 2 kernels: 100 MiB off the GPU (host memory)");
    expect(d.segments.filter(s => s.mine).map(s => s.id)).toEqual(['ka', 'kb']);
    expect(d.freeBytes).toBe(GiB - 550 * MiB);
    expect(d.evictedBytes).toBe(100 * MiB);
    expect(d.segments.reduce((s, x) => s + x.fraction, 0)).toBeCloseTo(1);
  });

  it('names my own holder first when another user holds too', () => {
    const doc = filtered();
    const dev = doc.devices![0];
    dev.clients[0] = mine('ka', 'a.ipynb', { state: 'running', used_bytes: 200 * MiB });
    dev.holders = ['ka'];
    dev.queue = [];
    dev.holder_users = ['alice', 'bob'];
    dev.queue_users = ['carol', 'bob'];
    const d = vm(doc).devices[0];
    expect(d.holders.map(r => r.id)).toEqual(['ka']);
    expect(d.otherHolders.map(p => p.user)).toEqual(['bob']);
    expect(d.queue.map(p => [p.position, p.user])).toEqual([
      [1, 'carol'],
      [2, 'bob']
    ]);
    expect(d.summary).toBe("a.ipynb, bob's kernel hold the GPU; 2 waiting.");
  });

  it('tells other users apart by the summed users when the identity is missing', () => {
    const doc = filtered({ identity: undefined });
    const d = vm(doc).devices[0];
    expect(d.queue.map(p => p.mine)).toEqual([false, true, false]);
    expect(d.otherHolders.map(p => p.user)).toEqual(['bob']);
  });

  it('shows a GPU used only by other users', () => {
    const doc = filtered();
    const dev = doc.devices![0];
    dev.clients = [];
    dev.queue = [];
    dev.queue_users = ['carol', 'bob'];
    const d = vm(doc).devices[0];
    expect(d.summary).toBe("bob's kernel holds the GPU; 2 waiting.");
    expect(d.mine).toEqual([]);
    expect(d.myShare).toBeNull();
    expect(d.others.map(o => o.color)).toEqual([0, 1]);
  });

  it('leaves the unfiltered (embedded or admin) document as it was', () => {
    for (const doc of [turns(), { ...turns(), identity: { user: 'root', admin: true, by: 'uid' } }]) {
      const d = vm(doc).devices[0];
      expect(d.filtered).toBe(false);
      expect(d.others).toEqual([]);
      expect(d.otherHolders).toEqual([]);
      expect(d.queue).toEqual([]);
      expect(d.segments.every(s => s.user === null)).toBe(true);
      expect(d.segments.map(s => `${s.kind}:${s.id ?? ''}`)).toEqual([
        'resident:ka',
        'resident:kb',
        'resident:kc',
        'free:',
        'evicted:kb'
      ]);
      expect(d.summary).toBe('a.ipynb holds the GPU; 1 waiting.');
      expect(d.waiters[0].queuePosition).toBe(1);
      expect(d.myShare).toBeCloseTo(40 / 100);
    }
  });
});
