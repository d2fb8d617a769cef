/**
 * The sidebar's view model: the server extension's status document (docs/protocol.md,
 * docs/rest-api.yaml) turned into what the panel shows. Pure: no DOM, no network; the panel
 * (panel.tsx, through React) renders it and the unit tests (__tests__/model.spec.ts) check it.
 */

import { basename, IUnregisteredKernel, IUnregisteredRow, unregisteredRow } from './unregistered';

export { basename } from './unregistered';
export type { IUnregisteredKernel, IUnregisteredRow } from './unregistered';

/** Jupyter's view of a scheduler client (added by the server extension). */
export interface IJupyterView {
  local: boolean;
  kernel_id?: string | null;
  kernel_name?: string | null;
  execution_state?: string | null;
  user?: string | null;
  paths?: string[];
  sessions?: { id?: string; path?: string; name?: string; type?: string }[];
}

export interface IClientStatus {
  id: string;
  pid?: number;
  uid?: number;
  user?: string;
  label?: string;
  state: string;
  used_bytes?: number;
  managed_bytes?: number;
  pinned_bytes?: number;
  evicted_bytes?: number;
  quota_bytes?: number;
  weight?: number;
  gpu_seconds?: number;
  wait_seconds?: number;
  waiting_since?: number | null;
  queue_position?: number | null;
  /** Holders: this turn so far, its quantum, and how long a pending revoke is unanswered. */
  held_seconds?: number;
  quantum_seconds?: number;
  revoking_seconds?: number | null;
  /** Waiters: why they wait (docs/reliability.md). */
  wait?: IWaitReason | null;
  redacted?: boolean;
  jupyter?: IJupyterView;
}

export interface IWaitReason {
  /** recovering | releasing | queue | turn | past_quantum | memory */
  reason: string;
  text: string;
  holders?: {
    id: string;
    user?: string;
    state?: string;
    held_seconds?: number;
    quantum_seconds?: number;
    past_quantum_seconds?: number;
    revoking_seconds?: number | null;
  }[];
}

export interface IDeviceStatus {
  uuid: string;
  /** NVML's index (as nvidia-smi numbers GPUs); null for a device learnt from a kernel. */
  index?: number | null;
  name?: string;
  total_bytes?: number;
  pool_bytes: number;
  resident_bytes?: number;
  mode: string;
  quantum_ms?: number;
  holders: string[];
  queue: string[];
  clients: IClientStatus[];
  clients_truncated?: number;
  /** The device's utilisation as NVML last reported it (percent); null without NVML. */
  utilization_percent?: number | null;
  /**
   * Filtered documents only (a node scheduler's view for a non-admin, docs/protocol.md "Who
   * sees what"): `clients`, `holders` and `queue` list the viewer's own clients; these say the
   * rest: the user of each holder and of each waiter in order, and other users' clients summed.
   */
  holder_users?: string[];
  queue_users?: string[];
  others?: IOtherUserStatus[];
}

/** Another user's clients on a device, summed (filtered documents only). */
export interface IOtherUserStatus {
  user: string;
  clients: number;
  running: number;
  waiting: number;
  used_bytes: number;
  resident_bytes: number;
  evicted_bytes?: number;
  gpu_seconds?: number;
  wait_seconds?: number;
  weight?: number;
}

export interface IStatus {
  version?: string;
  socket?: string;
  nvml?: true | string;
  truncated?: boolean;
  devices?: IDeviceStatus[];
  viewer?: { name: string | null; admin: boolean };
  /** This server's GPU-shared kernels that no device lists (see IUnregisteredKernel). */
  unregistered?: IUnregisteredKernel[];
  /**
   * The node's host memory (docs/protocol.md, "Host memory"): the budget for staging and
   * evicted memory (0: not accounted), what the kernels' engines hold, and by whom.
   */
  host?: {
    budget_bytes: number;
    held_bytes: number;
    staging_bytes?: number;
    idle_holders?: number;
    by_user?: Record<string, number>;
  } | null;
  /** With a node scheduler: whom it took this server for (the document is filtered for it). */
  identity?: { user: string; admin: boolean; by: string };
  scheduler?: {
    mode: string;
    requested?: string;
    socket?: string;
    error?: string | null;
  };
}

/** What the panel knows: a document, or why it has none. */
export type Fetched =
  | { kind: 'loading' }
  | { kind: 'status'; status: IStatus }
  | { kind: 'error'; statusCode: number | null; message: string };

export type Role = 'holder' | 'waiter' | 'idle';

export interface IKernelRow {
  /** The scheduler's client id. */
  id: string;
  /** The Jupyter kernel id to act on (for this server's kernels), else null. */
  kernelId: string | null;
  /** What to call it: the notebook's file name, or "alice's kernel" when redacted. */
  name: string;
  /** Longer description for tooltips (full path, kernel id, user). */
  title: string;
  user: string;
  mine: boolean;
  redacted: boolean;
  role: Role;
  state: string;
  queuePosition: number | null;
  /** Seconds this client has been waiting now (waiters only). */
  waitingFor: number | null;
  /** Why it waits, as the scheduler says (waiters only): machine-readable code and text. */
  waitReason: string | null;
  waitText: string | null;
  /** Holders: seconds past the quantum while others wait for it, else null. */
  pastQuantum: number | null;
  usedBytes: number;
  residentBytes: number;
  evictedBytes: number;
  quotaBytes: number;
  /** used / quota, when there is a quota. */
  quotaFraction: number | null;
  nearQuota: boolean;
  gpuSeconds: number;
  /** This client's share of the GPU time used on the device so far (0..1). */
  gpuShare: number | null;
  canRelease: boolean;
  canEvict: boolean;
  /** Index into the panel's palette, stable per client within a device. */
  color: number;
}

export interface ISegment {
  kind: 'resident' | 'free' | 'evicted';
  /** A client id; for another user's summed clients (filtered documents) null. */
  id: string | null;
  /** Another user whose kernels the segment sums (filtered documents), else null. */
  user: string | null;
  label: string;
  bytes: number;
  /** Fraction of the bar (0..1). */
  fraction: number;
  mine: boolean;
  color: number;
}

/** Another user's kernels on a device, summed (from a filtered document's `others`). */
export interface IOtherUserRow {
  user: string;
  /** "bob's kernel" or "bob's 3 kernels". */
  name: string;
  kernels: number;
  running: number;
  waiting: number;
  /** How many of the GPU's holders are this user's. */
  holding: number;
  /** This user's places in the queue (from 1), in order. */
  queuePositions: number[];
  usedBytes: number;
  residentBytes: number;
  evictedBytes: number;
  gpuSeconds: number;
  /** This user's share of the GPU time used on the device so far (0..1). */
  gpuShare: number | null;
  /** Index into the panel's palette, after the viewer's own kernels' colours. */
  color: number;
}

/** A holder or a place in the queue of a filtered document: the viewer's kernel or a user's. */
export interface IPlace {
  /** Queue position from 1 (waiters), else null. */
  position: number | null;
  user: string;
  /** The viewer's own kernel (``row`` is it), or another user's (``row`` is null). */
  mine: boolean;
  row: IKernelRow | null;
  /** What to call it: the kernel's name, or "bob's kernel". */
  name: string;
  color: number;
}

export interface IWarning {
  deviceUuid: string;
  clientId: string;
  text: string;
}

export interface IDeviceView {
  uuid: string;
  /** NVML's index, or null. */
  index: number | null;
  /** The device's name; on a node with several GPUs prefixed "GPU <index>: " to tell them apart. */
  name: string;
  totalBytes: number;
  poolBytes: number;
  residentBytes: number;
  freeBytes: number;
  evictedBytes: number;
  mode: string;
  modeLabel: string;
  modeDescription: string;
  quantumSeconds: number | null;
  utilization: number | null;
  segments: ISegment[];
  holders: IKernelRow[];
  waiters: IKernelRow[];
  idle: IKernelRow[];
  mine: IKernelRow[];
  /** True when the document is filtered for the viewer (others' kernels only summed). */
  filtered: boolean;
  /** Filtered documents: other users' kernels, one row per user (else empty). */
  others: IOtherUserRow[];
  /** Filtered documents: other users holding the GPU, one place per holder (else empty). */
  otherHolders: IPlace[];
  /** Filtered documents: the whole queue in order, the viewer's kernels and others' (else empty). */
  queue: IPlace[];
  /** The viewer's kernels' share of the GPU time used on this device (0..1), if any. */
  myShare: number | null;
  /** What the weights entitle the viewer's kernels to: their weights over all weights (0..1). */
  myWeightShare: number | null;
  truncated: number;
  summary: string;
}

export type ViewState = 'loading' | 'ok' | 'no-gpu' | 'no-scheduler' | 'error';

export interface IViewModel {
  state: ViewState;
  /** The headline when there is nothing (or not everything) to show. */
  message: string | null;
  /** A secondary remark (e.g. NVML unavailable but devices learnt from kernels). */
  notice: string | null;
  devices: IDeviceView[];
  /** This server's GPU-shared kernels that are on no device yet. */
  unregistered: IUnregisteredRow[];
  warnings: IWarning[];
  viewer: { name: string | null; admin: boolean };
}

/** Memory use at or above this fraction of the quota is flagged. */
export const QUOTA_WARNING = 0.9;

const UNITS = ['B', 'KiB', 'MiB', 'GiB', 'TiB', 'PiB'];

/** Bytes as a short 1024-based size: "0 B", "512 B", "1.5 GiB", "700 MiB". */
export function formatBytes(bytes: number | null | undefined): string {
  if (bytes === null || bytes === undefined || !Number.isFinite(bytes)) {
    return '?';
  }
  let value = Math.max(0, bytes);
  let unit = 0;
  while (value >= 1024 && unit < UNITS.length - 1) {
    value /= 1024;
    unit++;
  }
  if (unit === 0) {
    return `${Math.round(value)} B`;
  }
  const digits = value >= 100 || Number.isInteger(value) ? 0 : 1;
  const text = value.toFixed(digits).replace(/\.0$/, '');
  return `${text} ${UNITS[unit]}`;
}

/** A duration in seconds as "0s", "4s", "2m 05s", "1h 03m". */
export function formatDuration(seconds: number | null | undefined): string {
  if (seconds === null || seconds === undefined || !Number.isFinite(seconds)) {
    return '?';
  }
  const s = Math.max(0, Math.floor(seconds));
  if (s < 60) {
    return `${s}s`;
  }
  const m = Math.floor(s / 60);
  if (m < 60) {
    return `${m}m ${String(s % 60).padStart(2, '0')}s`;
  }
  const h = Math.floor(m / 60);
  return `${h}h ${String(m % 60).padStart(2, '0')}m`;
}

/** A fraction (0..1) as a whole percentage: "42%". */
export function formatPercent(fraction: number | null | undefined): string {
  if (fraction === null || fraction === undefined || !Number.isFinite(fraction)) {
    return '?';
  }
  return `${Math.round(fraction * 100)}%`;
}

/** The last component of a path. */

function num(value: unknown): number {
  return typeof value === 'number' && Number.isFinite(value) ? value : 0;
}

function kernelIdOf(clientId: string): string {
  return clientId.split('#', 1)[0];
}

function clientUser(c: IClientStatus): string {
  return c.jupyter?.user || c.user || (c.uid !== undefined ? `uid ${c.uid}` : 'someone');
}

function nameOf(c: IClientStatus): { name: string; title: string } {
  const user = clientUser(c);
  const paths = c.jupyter?.paths ?? [];
  const sub = c.id.includes('#') ? ` (subprocess ${c.id.split('#')[1]})` : '';
  if (c.redacted) {
    return { name: `${user}'s kernel`, title: `A kernel of ${user}` };
  }
  if (paths.length) {
    return {
      name: paths.map(basename).join(', ') + sub,
      title: `${paths.join(', ')}${sub} (kernel ${kernelIdOf(c.id)})`
    };
  }
  if (c.label) {
    return { name: basename(c.label) + sub, title: `${c.label}${sub} (${c.id})` };
  }
  return { name: c.id, title: c.id };
}

function roleOf(c: IClientStatus, dev: IDeviceStatus): Role {
  if ((dev.holders ?? []).includes(c.id)) {
    return 'holder';
  }
  if ((dev.queue ?? []).includes(c.id) || c.state === 'waiting') {
    return 'waiter';
  }
  if (c.state === 'running' || c.state === 'revoking' || c.state === 'evicting') {
    return 'holder';
  }
  return 'idle';
}

const MODES: Record<string, [string, string]> = {
  shared: ['shared', 'Kernels fit the memory pool together and run side by side.'],
  turns: [
    'turns',
    "Kernels do not fit the memory pool together: they take turns, each one's memory moved to " +
      'the host while others run.'
  ]
};

/** "bob's kernel", "bob's 3 kernels". */
export function kernelsOf(user: string, count: number): string {
  return count === 1 ? `${user}'s kernel` : `${user}'s ${count} kernels`;
}

function deviceView(
  dev: IDeviceStatus,
  viewer: { name: string | null; admin: boolean },
  now: number,
  warnings: IWarning[],
  several = false,
  self: string | null = null
): IDeviceView {
  const clients = dev.clients ?? [];
  // A filtered document (docs/protocol.md "Who sees what") sums other users' clients per user.
  const filtered =
    Array.isArray(dev.others) || Array.isArray(dev.holder_users) || Array.isArray(dev.queue_users);
  const otherStats = (dev.others ?? []).filter(o => o && typeof o.user === 'string');
  const otherNames = new Set(otherStats.map(o => o.user));
  // Whether a holder or waiter of user ``u`` is someone else's: ``others`` names every other
  // user with clients on the device; the identity covers a user the sums may have missed.
  const isOther = (u: string) => otherNames.has(u) || (self !== null && u !== self);
  const totalGpu =
    clients.reduce((sum, c) => sum + num(c.gpu_seconds), 0) +
    otherStats.reduce((sum, o) => sum + num(o.gpu_seconds), 0);
  // Fair share is weighted: a kernel without a weight counts as 1, as the scheduler does.
  const weightOf = (c: IClientStatus) => (typeof c.weight === 'number' ? c.weight : 1);
  const totalWeight =
    clients.reduce((sum, c) => sum + weightOf(c), 0) +
    otherStats.reduce(
      (sum, o) => sum + (typeof o.weight === 'number' ? o.weight : num(o.clients)),
      0
    );
  const myWeight = clients.filter(c => c.jupyter?.local).reduce((s, c) => s + weightOf(c), 0);
  const rows: IKernelRow[] = clients.map((c, i) => {
    const mine = !!c.jupyter?.local;
    const role = roleOf(c, dev);
    const used = num(c.used_bytes);
    const evicted = Math.min(num(c.evicted_bytes), used);
    const quota = num(c.quota_bytes);
    const quotaFraction = quota > 0 ? used / quota : null;
    const { name, title } = nameOf(c);
    const queueIndex = (dev.queue ?? []).indexOf(c.id);
    const queuePosition =
      typeof c.queue_position === 'number'
        ? c.queue_position
        : queueIndex >= 0
          ? queueIndex + 1
          : null;
    let waitingFor: number | null = null;
    if (role === 'waiter') {
      waitingFor =
        typeof c.waiting_since === 'number'
          ? Math.max(0, now - c.waiting_since)
          : num(c.wait_seconds);
    }
    const kernelId = c.jupyter?.kernel_id ?? null;
    const row: IKernelRow = {
      id: c.id,
      kernelId: mine ? kernelId || kernelIdOf(c.id) : viewer.admin ? kernelIdOf(c.id) : null,
      name,
      title,
      user: clientUser(c),
      mine,
      redacted: !!c.redacted,
      role,
      state: c.state,
      queuePosition,
      waitingFor,
      waitReason: role === 'waiter' ? (c.wait?.reason ?? null) : null,
      waitText: role === 'waiter' ? (c.wait?.text ?? null) : null,
      pastQuantum: pastQuantumOf(c, dev),
      usedBytes: used,
      residentBytes: Math.max(0, used - evicted),
      evictedBytes: evicted,
      quotaBytes: quota,
      quotaFraction,
      nearQuota: quotaFraction !== null && quotaFraction >= QUOTA_WARNING,
      gpuSeconds: num(c.gpu_seconds),
      gpuShare: totalGpu > 0 ? num(c.gpu_seconds) / totalGpu : null,
      canRelease: (mine || viewer.admin) && role === 'holder',
      canEvict: viewer.admin && (used > 0 || role === 'holder'),
      color: i
    };
    if (row.nearQuota && mine) {
      warnings.push({
        deviceUuid: dev.uuid,
        clientId: c.id,
        text:
          `${row.name} uses ${formatBytes(used)} of its ${formatBytes(quota)} quota ` +
          `(${formatPercent(quotaFraction)}): allocations past the quota fail with out of memory.`
      });
    }
    return row;
  });

  // Other users' kernels (filtered documents), after the viewer's in the palette.
  const colorOf = new Map<string, number>();
  const others: IOtherUserRow[] = otherStats.map((o, j) => {
    const used = num(o.used_bytes);
    const evictedBytes = Math.min(num(o.evicted_bytes), used);
    colorOf.set(o.user, rows.length + j);
    return {
      user: o.user,
      name: kernelsOf(o.user, num(o.clients)),
      kernels: num(o.clients),
      running: num(o.running),
      waiting: num(o.waiting),
      holding: 0,
      queuePositions: [],
      usedBytes: used,
      residentBytes:
        typeof o.resident_bytes === 'number'
          ? Math.max(0, o.resident_bytes)
          : Math.max(0, used - evictedBytes),
      evictedBytes,
      gpuSeconds: num(o.gpu_seconds),
      gpuShare: totalGpu > 0 ? num(o.gpu_seconds) / totalGpu : null,
      color: rows.length + j
    };
  });
  const otherRow = (u: string) => others.find(o => o.user === u);
  const otherPlace = (u: string, position: number | null): IPlace => ({
    position,
    user: u,
    mine: false,
    row: null,
    name: `${u}'s kernel`,
    color: colorOf.get(u) ?? -1
  });
  const otherHolders: IPlace[] = [];
  for (const u of dev.holder_users ?? []) {
    if (isOther(u)) {
      otherHolders.push(otherPlace(u, null));
      const o = otherRow(u);
      if (o) {
        o.holding++;
      }
    }
  }
  // The whole queue in order: the viewer's own waiters are ``dev.queue``, in the same order.
  const queue: IPlace[] = [];
  const ownQueue = [...(dev.queue ?? [])];
  (dev.queue_users ?? []).forEach((u, i) => {
    if (isOther(u)) {
      queue.push(otherPlace(u, i + 1));
      otherRow(u)?.queuePositions.push(i + 1);
      return;
    }
    const id = ownQueue.shift();
    const k = id === undefined ? -1 : clients.findIndex(c => c.id === id);
    const row = k >= 0 ? rows[k] : null;
    if (row && typeof clients[k].queue_position !== 'number') {
      // ``dev.queue`` holds the viewer's waiters only: their place counts everyone's.
      row.queuePosition = i + 1;
    }
    queue.push({
      position: i + 1,
      user: u,
      mine: true,
      row,
      name: row ? row.name : `${u}'s kernel`,
      color: row ? row.color : -1
    });
  });

  // The scheduler counts a client that is not resident (a waiter not yet granted, or evicted)
  // by its pinned memory only: when its accounting says less is on the GPU than the clients'
  // own numbers, the waiters' managed memory is off the GPU.
  const claimed =
    rows.reduce((s, r) => s + r.residentBytes, 0) +
    others.reduce((s, o) => s + o.residentBytes, 0);
  if (typeof dev.resident_bytes === 'number' && claimed > dev.resident_bytes) {
    clients.forEach((c, i) => {
      const r = rows[i];
      if (r.role === 'waiter') {
        const onGpu = Math.min(num(c.pinned_bytes), r.usedBytes);
        r.evictedBytes = r.usedBytes - onGpu;
        r.residentBytes = onGpu;
      }
    });
  }

  const holders = rows.filter(r => r.role === 'holder');
  const waiters = rows
    .filter(r => r.role === 'waiter')
    .sort((a, b) => (a.queuePosition ?? 1e9) - (b.queuePosition ?? 1e9));
  const idle = rows.filter(r => r.role === 'idle');
  const mineRows = rows.filter(r => r.mine);

  const pool = num(dev.pool_bytes);
  const resident =
    rows.reduce((s, r) => s + r.residentBytes, 0) +
    others.reduce((s, o) => s + o.residentBytes, 0);
  const evicted =
    rows.reduce((s, r) => s + r.evictedBytes, 0) + others.reduce((s, o) => s + o.evictedBytes, 0);
  const residentBytes = typeof dev.resident_bytes === 'number' ? dev.resident_bytes : resident;
  const free = Math.max(0, pool - Math.max(resident, residentBytes));
  const denominator = Math.max(pool, resident) + evicted;
  const frac = (b: number) => (denominator > 0 ? b / denominator : 0);
  const segments: ISegment[] = [];
  // Who owns memory on the bar: my kernels and visible ones row by row, other users summed.
  const owners = [
    ...rows.map(r => ({ ...r, user: null as string | null })),
    ...others.map(o => ({ ...o, id: null as string | null, mine: false }))
  ];
  const ownerParts = (kind: 'resident' | 'evicted', where: string) => {
    for (const w of owners) {
      const bytes = kind === 'resident' ? w.residentBytes : w.evictedBytes;
      if (bytes > 0) {
        segments.push({
          kind,
          id: w.id,
          user: w.user,
          label: `${w.name}: ${formatBytes(bytes)} ${where}`,
          bytes,
          fraction: frac(bytes),
          mine: w.mine,
          color: w.color
        });
      }
    }
  };
  ownerParts('resident', 'on the GPU');
  if (free > 0) {
    segments.push({
      kind: 'free',
      id: null,
      user: null,
      label: `free: ${formatBytes(free)}`,
      bytes: free,
      fraction: frac(free),
      mine: false,
      color: -1
    });
  }
  ownerParts('evicted', 'off the GPU (host memory)');

  const myGpu = mineRows.reduce((s, r) => s + r.gpuSeconds, 0);
  const [modeLabel, modeDescription] = MODES[dev.mode] ?? [dev.mode || '?', ''];
  const util =
    typeof dev.utilization_percent === 'number' ? dev.utilization_percent : null;

  // Other users' holders, by user: "bob's 2 kernels".
  const holdingUsers = new Map<string, number>();
  for (const p of otherHolders) {
    holdingUsers.set(p.user, (holdingUsers.get(p.user) ?? 0) + 1);
  }
  const holderNames = [
    ...holders.map(h => h.name),
    ...[...holdingUsers].map(([u, n]) => kernelsOf(u, n))
  ];
  const holderCount = holders.length + otherHolders.length;
  const waiting = Math.max(waiters.length, queue.length);
  let summary: string;
  if (!rows.length && !others.length) {
    summary = dev.clients_truncated
      ? `${dev.clients_truncated} kernels (too many to list)`
      : 'No kernel uses this GPU.';
  } else if (holderCount) {
    summary = `${holderNames.join(', ')} ${holderCount > 1 ? 'hold' : 'holds'} the GPU`;
    if (waiting) {
      summary += `; ${waiting} waiting`;
    }
    summary += '.';
  } else if (waiting) {
    summary = `${waiting} waiting for the GPU.`;
  } else {
    summary = 'The GPU is free: every kernel is idle.';
  }

  const index = typeof dev.index === 'number' ? dev.index : null;
  const name = dev.name || dev.uuid;
  return {
    uuid: dev.uuid,
    index,
    name: several && index !== null ? `GPU ${index}: ${name}` : name,
    totalBytes: num(dev.total_bytes),
    poolBytes: pool,
    residentBytes,
    freeBytes: free,
    evictedBytes: evicted,
    mode: dev.mode,
    modeLabel,
    modeDescription,
    quantumSeconds: typeof dev.quantum_ms === 'number' ? dev.quantum_ms / 1000 : null,
    utilization: util,
    segments,
    holders,
    waiters,
    idle,
    mine: mineRows,
    filtered,
    others,
    otherHolders,
    queue,
    myShare: mineRows.length && totalGpu > 0 ? myGpu / totalGpu : null,
    myWeightShare: mineRows.length && totalWeight > 0 ? myWeight / totalWeight : null,
    truncated: num(dev.clients_truncated),
    summary
  };
}

/**
 * The view model of what the panel has fetched. ``now`` is the Unix time in seconds (for how
 * long waiters have waited).
 */
/** Seconds a holder is past its quantum while someone waits (a long holder), else null. */
export function pastQuantumOf(c: IClientStatus, dev: IDeviceStatus): number | null {
  if (typeof c.held_seconds !== 'number' || typeof c.quantum_seconds !== 'number') {
    return null;
  }
  const past = c.held_seconds - c.quantum_seconds;
  return past > 0 && (dev.queue ?? []).length > 0 ? past : null;
}

export function buildViewModel(fetched: Fetched, now: number = Date.now() / 1000): IViewModel {
  const empty = {
    devices: [] as IDeviceView[],
    unregistered: [] as IUnregisteredRow[],
    warnings: [] as IWarning[],
    viewer: { name: null, admin: false },
    notice: null
  };
  if (fetched.kind === 'loading') {
    return { ...empty, state: 'loading', message: 'Connecting to the GPU scheduler…' };
  }
  if (fetched.kind === 'error') {
    if (fetched.statusCode === 503) {
      return {
        ...empty,
        state: 'no-scheduler',
        message: `No GPU scheduler: ${fetched.message || 'the scheduler cannot be reached.'}`
      };
    }
    if (fetched.statusCode === 404) {
      return {
        ...empty,
        state: 'error',
        message: 'The gpushare server extension is not enabled on this server.'
      };
    }
    if (fetched.statusCode === 403) {
      return {
        ...empty,
        state: 'error',
        message: 'You are not allowed to see the GPU status on this server.'
      };
    }
    return { ...empty, state: 'error', message: fetched.message || 'Unknown error.' };
  }
  const status = fetched.status;
  const viewer = {
    name: status.viewer?.name ?? null,
    admin: !!status.viewer?.admin
  };
  const warnings: IWarning[] = [];
  const several = (status.devices ?? []).length > 1;
  const self = typeof status.identity?.user === 'string' ? status.identity.user : null;
  const devices = (status.devices ?? []).map(d =>
    deviceView(d, viewer, now, warnings, several, self)
  );
  const schedError = status.scheduler?.error ?? null;
  const nvml = status.nvml;
  const nvmlProblem = nvml !== undefined && nvml !== true ? String(nvml) : null;
  let state: ViewState = 'ok';
  let message: string | null = null;
  let notice: string | null = null;
  if (schedError && !devices.length) {
    state = 'no-scheduler';
    message = `No GPU scheduler: ${schedError}`;
  } else if (!devices.length) {
    state = 'no-gpu';
    message = nvmlProblem
      ? `No NVIDIA GPU found (${nvmlProblem}). GPUs also appear here when a kernel uses one.`
      : 'No GPU known yet. GPUs appear here when the scheduler finds them or a kernel uses one.';
  } else {
    if (schedError) {
      notice = `Scheduler: ${schedError}`;
    } else if (nvmlProblem) {
      notice = `NVML unavailable (${nvmlProblem}): GPUs are learnt from the kernels using them.`;
    }
  }
  if (status.truncated) {
    notice = (notice ? notice + ' ' : '') + 'Too many kernels to list them all.';
  }
  const unregistered = (status.unregistered ?? []).map(unregisteredRow);
  return { state, message, notice, devices, unregistered, warnings, viewer };
}
