/** The status documents the view-model tests build on: a client of alice's, and one device's view
 * model holding the given clients (holders and queue from their states). */
import { buildViewModel, IClientStatus, IDeviceStatus, IStatus } from '../model';

export const MiB = 1 << 20;
export const NOW = 1_700_000_000;

export function mine(id: string, extra: Partial<IClientStatus> = {}): IClientStatus {
  return {
    id,
    user: 'alice',
    label: `/home/alice/${id}.ipynb`,
    state: 'idle',
    used_bytes: 100 * MiB,
    pinned_bytes: 16 * MiB,
    evicted_bytes: 0,
    quota_bytes: 0,
    jupyter: { local: true, kernel_id: id, paths: [`${id}.ipynb`] },
    ...extra
  };
}

export function vm(clients: IClientStatus[], dev: Partial<IDeviceStatus> = {}) {
  const status: IStatus = {
    nvml: true,
    devices: [
      {
        uuid: 'GPU-1',
        pool_bytes: 1024 * MiB,
        mode: 'turns',
        holders: clients.filter(c => c.state === 'running').map(c => c.id),
        queue: clients.filter(c => c.state === 'waiting').map(c => c.id),
        clients,
        ...dev
      }
    ],
    viewer: { name: 'alice', admin: false }
  };
  return buildViewModel({ kind: 'status', status }, NOW);
}
